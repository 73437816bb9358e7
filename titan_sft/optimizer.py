"""AdamW with the recipe's weight-decay mask (recipe items 1-2), the optional 8-bit AdamW of bitsandbytes, and
learning-rate scaling by batch size."""

from __future__ import annotations

import torch
from torch import nn

from titan_sft.config import ConfigError
from titan_sft.config import Optimizer as OptConfig


def is_decayed(name: str, param: nn.Parameter) -> bool:
    """No decay for norms (any name containing "norm"), the token embedding, and biases; the rest decays.

    An untied output head decays; a tied one is the embedding (it appears once, as ``tok_embeddings.weight``).
    """
    return not ("norm" in name or "tok_embeddings" in name or name.endswith(".bias"))


def decay_groups(model: nn.Module, mask: str = "recipe") -> tuple[list[str], list[str]]:
    """Names of the trainable parameters that decay and that do not: :func:`is_decayed` (``mask`` "recipe"), or
    every trainable parameter decays ("all", the masked-diffusion reference script's AdamW over all of them).

    A pipeline's last stage holds its own copy of a tied head (``model.tied_copies()``, named ``output.weight``):
    it is the embedding, so it decays exactly when the embedding does; decaying one copy only would pull the two
    apart.
    """
    copies = {id(p) for p in getattr(model, "tied_copies", list)()}
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # shared (tied) tensors are listed once
        if p.requires_grad:
            decayed = mask == "all" or (is_decayed(name, p) and id(p) not in copies)
            (decay if decayed else no_decay).append(name)
    return decay, no_decay


def scaled_lr(cfg: OptConfig, global_batch: int) -> float:
    """``optimizer.lr`` scaled by (global_batch / reference_batch): its square root (``sqrt``, Adam's usual rule),
    linearly, or not at all."""
    ratio = global_batch / cfg.reference_batch
    return cfg.lr * {"none": 1.0, "sqrt": ratio**0.5, "linear": ratio}[cfg.lr_scaling]


def build_optimizer(model: nn.Module, cfg: OptConfig, global_batch: int | None = None) -> torch.optim.Optimizer:
    """AdamW (or bitsandbytes' AdamW8bit) over the trainable parameters, with the decay mask; the learning rate
    is :func:`scaled_lr` of ``global_batch`` (the packed examples per step)."""
    lr = scaled_lr(cfg, global_batch) if global_batch else cfg.lr
    params = dict(model.named_parameters())
    decay, no_decay = decay_groups(model, cfg.decay_mask)
    # An empty group (decay_mask "all", or LoRA factors without trained norms) is left out: torch's flattened
    # optimizer state dict, which checkpoints store, cannot be loaded back into an optimizer holding one.
    groups = [g for g in ({"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
                          {"params": [params[n] for n in no_decay], "weight_decay": 0.0}) if g["params"]]
    if cfg.name == "adamw8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise ConfigError("config key 'optimizer.name': 'adamw8bit' needs bitsandbytes (pip install "
                              "'titan_sft[bnb]' or pip install bitsandbytes); or use 'adamw'") from None
        return bnb.optim.AdamW8bit(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    kwargs = {"fused": True} if cfg.fused else {"foreach": cfg.foreach}
    return torch.optim.AdamW(groups, lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)
