"""AdamW with the recipe's weight-decay mask (recipe items 1-2)."""

from __future__ import annotations

import torch
from torch import nn

from titan_sft.config import Optimizer as OptConfig


def is_decayed(name: str, param: nn.Parameter) -> bool:
    """No decay for norms (any name containing "norm"), the token embedding, and biases; the rest decays.

    An untied output head decays; a tied one is the embedding (it appears once, as ``tok_embeddings.weight``).
    """
    return not ("norm" in name or "tok_embeddings" in name or name.endswith(".bias"))


def decay_groups(model: nn.Module) -> tuple[list[str], list[str]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():  # shared (tied) tensors are listed once
        if p.requires_grad:
            (decay if is_decayed(name, p) else no_decay).append(name)
    return decay, no_decay


def build_optimizer(model: nn.Module, cfg: OptConfig) -> torch.optim.Optimizer:
    params = dict(model.named_parameters())
    decay, no_decay = decay_groups(model)
    groups = [
        {"params": [params[n] for n in decay], "weight_decay": cfg.weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]
    kwargs = {"fused": True} if cfg.fused else {"foreach": cfg.foreach}
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs)
