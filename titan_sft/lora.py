"""LoRA as a model converter (``model.converters = ["lora"]``, settings in ``[lora]``), for any objective.

The chosen block projections become :class:`LoRALinear`: the frozen base weight plus ``lora_a`` [r, in] and
``lora_b`` [out, r], output ``x W^T + (alpha / r) * dropout(x) A^T B^T``. ``lora_b`` starts at zero, so training
starts from the base model exactly. Every other parameter is frozen, except the RMSNorm weights with
``lora.train_norms``; the optimizer (``titan_sft.optimizer``) only sees trainable parameters, so it keeps no state
for the frozen base.

Composition: the adapters are plain parameters of the linear itself, so FSDP2 shards them with the block and the
tensor-parallel styles place them with the weight (column-wise: both sharded on dim 0; row-wise: replicated);
DTensor then computes the exact branch under any layout. Activation checkpointing recomputes the branch with the
block (with dropout > 0 the RNG state is kept for the recompute).

On disk: DCP checkpoints hold the adapters like any parameter; HF exports merge them into the base weights
(:func:`merge_lora`); :func:`save_peft_adapter` writes what PEFT loads (``adapter_config.json`` +
``adapter_model.safetensors``, HF module names; trained norms as ``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from titan_sft.config import JobConfig, Lora
from titan_sft.registry import register_converter

# HF projection name -> native module path inside a block
TARGETS = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
           "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
ADAPTER_KEYS = ("lora_a", "lora_b")


class LoRALinear(nn.Linear):
    """nn.Linear (frozen) with a low-rank update; still an nn.Linear, so parallel styles apply to it."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, key: str):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.scale = alpha / rank
        self.dropout = dropout  # a float, not a submodule: parallel styles partition every submodule of a linear
        self.key = zlib.crc32(key.encode())  # seeds this module's init: the same for any layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        return F.linear(x, self.weight) + F.linear(F.linear(h, self.lora_a), self.lora_b) * self.scale

    def reset_converter_parameters(self, seed: int) -> None:
        """A ~ kaiming-uniform (PEFT's init: bound 1 / sqrt(in)), B = 0, drawn whole on the CPU from (seed, module
        name) and each rank keeps its shard, so every layout starts from the same adapters."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + self.key)
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.rand(self.lora_a.shape, generator=g, dtype=torch.float32) * 2 * bound - bound
        with torch.no_grad():
            for p, full in ((self.lora_a, a), (self.lora_b, torch.zeros(self.lora_b.shape))):
                _copy_full(p, full)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the whole tensor ``full`` into ``param`` (plain, or a DTensor: this rank's shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def apply_lora(model: nn.Module, cfg: JobConfig, device: torch.device | None = None) -> list[str]:
    """Converts the target projections of every block and freezes the rest; returns the converted names."""
    lo = cfg.lora
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, block in model.layers.items():
        for hf_name in lo.targets:
            parent_path, attr = TARGETS[hf_name].rsplit(".", 1)
            parent = block.get_submodule(parent_path)
            fqn = f"layers.{i}.{TARGETS[hf_name]}"
            setattr(parent, attr, LoRALinear(getattr(parent, attr), lo.rank, lo.alpha, lo.dropout, fqn))
            names.append(fqn)
    if lo.train_norms:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.requires_grad_(True)
    return names


def is_adapter_key(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in ADAPTER_KEYS


def merge_lora(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with the adapters folded into their base weights: W + scale * B @ A (in fp32)."""
    out = {}
    for name, t in state.items():
        if is_adapter_key(name):
            continue
        prefix = name[: -len("weight")]
        if name.endswith(".weight") and prefix + "lora_a" in state:
            a, b = state[prefix + "lora_a"].float(), state[prefix + "lora_b"].float()
            t = (t.float() + scale * (b @ a)).to(t.dtype)
        out[name] = t
    return out


def lora_scale(cfg: JobConfig) -> float | None:
    """alpha / rank when the run uses LoRA, else None."""
    return cfg.lora.alpha / cfg.lora.rank if "lora" in cfg.model.converters else None


def save_peft_adapter(state: dict[str, torch.Tensor], lo: Lora, out_dir: str | Path, base_model: str | None,
                      train_norms: bool, native_to_hf) -> Path:
    """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (run on one rank, with
    a full state dict). The trained norm weights go in as ``modules_to_save``, so ``PeftModel.from_pretrained``
    restores them with the adapters."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, norm_modules = {}, set()
    for name, t in state.items():
        if is_adapter_key(name):
            base = native_to_hf(name[: -len("lora_a")] + "weight")[: -len(".weight")]
            kind = "lora_A" if name.endswith("lora_a") else "lora_B"
            tensors[f"base_model.model.{base}.{kind}.weight"] = t.contiguous()
        elif train_norms and "norm" in name:
            hf = native_to_hf(name)
            tensors[f"base_model.model.{hf}"] = t.contiguous()
            norm_modules.add(hf.split(".")[-2])
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout, "target_modules": sorted(lo.targets),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": sorted(norm_modules) or None, "use_rslora": False, "use_dora": False,
    }
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


register_converter("lora", apply_lora)
