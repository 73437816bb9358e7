"""QLoRA's frozen base in 4-bit NormalFloat (``lora.base_quant = "nf4"``).

The frozen linear weights of the blocks (and the routed experts' stacked weights) are stored as torchao's NF4
format (the QLoRA paper's: 64-element blocks, each scaled by its absmax; the absmax scalers themselves quantized
to int8 in groups, around their mean). torchao does the quantization (``to_nf4``); its dequantization is written
out here with the same operations in the same order (asserted bitwise equal), so the matmul path is plain torch
that compiles and runs on any supported torch.

Why torchao and not bitsandbytes: torchao's NF4 runs on CPU as on CUDA (so the CPU tests exercise the real
path), and its codes are plain tensors that FSDP2 can shard. Why not torchao's ``NF4Tensor`` subclass as the
parameter: its FSDP2 hooks assume a 1-D mesh of more than one rank (our 1-rank and HSDP layouts fail in torch
2.13) and it cannot hold 3-D expert weights. Here each quantized weight ``w`` becomes four frozen parameters of its
module, flat 1-D tensors FSDP2 shards like any other (unevenly, no alignment rules):

- ``w_nf4``: uint8 [numel / 2], two 4-bit codes per byte;
- ``w_nf4_scalers``: int8 [numel / 64], each block's absmax, quantized;
- ``w_nf4_factors``: [numel / 64 / s], the scalers' quantization factor per group of s blocks;
- ``w_nf4_mean``: [1], the scalers' mean;

(factors and mean in the weight's storage dtype, as torchao keeps them). Every rank quantizes the whole tensor
(read from the HF files or drawn by the seeded init, one tensor at a time) and keeps its shard of the pieces: the
scalers' mean is a property of the whole tensor, so quantizing per shard would give every layout other numbers.
The base is therefore bitwise the same NF4 model for any world size.

Forward dequantizes the gathered pieces to the compute dtype and runs the bf16 matmul; backward dequantizes again
(:class:`_NF4Linear`) instead of keeping the dequantized weight alive until then. A weight whose size is not a
multiple of 64 elements stays in its dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from titan_sft.models.moe import local

BLOCK = 64  # elements per absmax block (QLoRA's and torchao's default)
MAX_SCALER_BLOCK = 256  # blocks per scaler-quantization group (torchao's default)
PIECES = ("", "_scalers", "_factors", "_mean")  # w_nf4, w_nf4_scalers, ... (see the module docstring)
# NF4's 16 levels (the QLoRA paper's, as torchao stores them)
LEVELS = (-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461, 0.3379,
          0.4407, 0.5626, 0.7230, 1.0)


def quantizable(shape: tuple[int, ...] | torch.Size) -> bool:
    """Whether a weight of this shape is stored in NF4: whole 64-element blocks."""
    n = 1
    for s in shape:
        n *= s
    return n % BLOCK == 0 and n > 0


def scaler_block(numel: int) -> int:
    """Blocks per scaler group: 256, or the largest power of two dividing the block count (small tensors). It
    depends on the shape only, so every layout quantizes alike."""
    n_blocks, s = numel // BLOCK, MAX_SCALER_BLOCK
    while n_blocks % s:
        s //= 2
    return s


def piece_shapes(numel: int) -> dict[str, tuple[int]]:
    """The four pieces' (flat) shapes for a weight of ``numel`` elements, by suffix."""
    n_blocks = numel // BLOCK
    return {"": (numel // 2,), "_scalers": (n_blocks,), "_factors": (n_blocks // scaler_block(numel),),
            "_mean": (1,)}


def quantize(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """NF4 pieces of the whole tensor ``w`` (torchao's ``to_nf4``, in ``w``'s dtype), by suffix."""
    from titan_sft.converters import _quiet_torchao

    with _quiet_torchao():
        from torchao.quantization import to_nf4
    flat = w.detach().contiguous().view(-1, w.shape[-1])
    t = to_nf4(flat, BLOCK, scaler_block(w.numel()))
    return {"": t.quantized_data, "_scalers": t.quantized_scalers, "_factors": t.quantization_factor,
            "_mean": t.scaler_mean.reshape(1)}


_LEVELS: dict[tuple, torch.Tensor] = {}


def _levels(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The 16 levels on ``device`` in ``dtype``, made once: a tensor from a Python list on a GPU is a blocking
    host-to-device copy, which every matmul would otherwise pay."""
    key = (device, dtype)
    if key not in _LEVELS:
        _LEVELS[key] = torch.tensor(LEVELS, dtype=dtype, device=device)
    return _LEVELS[key]


def dequantize(codes: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor,
               shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The weight back from its pieces: torchao's ``get_original_weight`` (same operations, same order, in the
    pieces' dtype), then cast to ``dtype``."""
    levels = _levels(codes.device, factors.dtype)
    block_scale = ((scalers.view(factors.numel(), -1) / factors.unsqueeze(-1)).flatten().to(factors.dtype)
                   + mean.reshape(()))
    repeated = block_scale.unsqueeze(-1).expand(block_scale.numel(), BLOCK // 2).flatten()
    first = levels[(codes >> 4).long()] * repeated
    second = levels[(codes & 0b1111).long()] * repeated
    return torch.stack([first, second], dim=-1).reshape(shape).to(dtype)


def pieces(module: nn.Module, name: str) -> list[torch.Tensor]:
    """The four (gathered) pieces of ``module``'s quantized weight ``name``."""
    return [local(getattr(module, f"{name}_nf4{suffix}")) for suffix in PIECES]


def weight(module: nn.Module, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``module``'s quantized weight ``name`` dequantized to ``dtype``."""
    return dequantize(*pieces(module, name), module.nf4_shapes[name], dtype)


class _NF4Linear(torch.autograd.Function):
    """x W^T with W given by its NF4 pieces: dequantized in forward and again in backward, so no dequantized copy
    of W waits for backward (W is frozen: no gradient for it)."""

    @staticmethod
    def forward(ctx, x, codes, scalers, factors, mean, shape):
        ctx.save_for_backward(codes, scalers, factors, mean)
        ctx.shape = shape
        return F.linear(x, dequantize(codes, scalers, factors, mean, shape, x.dtype))

    @staticmethod
    def backward(ctx, grad):
        w = dequantize(*ctx.saved_tensors, ctx.shape, grad.dtype)
        return grad @ w, None, None, None, None, None


def linear(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, W)`` for a module whose ``weight`` is quantized."""
    return _NF4Linear.apply(x, *pieces(module, "weight"), module.nf4_shapes["weight"])


def quantize_module(module: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Replaces ``module``'s frozen parameters ``names`` by their NF4 pieces: on the meta device (a model before
    sharding) empty, the values come at load (:func:`fill`); a materialized (unsharded) weight is quantized on the
    spot. Returns the names quantized."""
    done = []
    shapes = dict(getattr(module, "nf4_shapes", {}))
    for name in names:
        p = getattr(module, name)
        if not quantizable(p.shape):
            continue
        q = None if p.is_meta else quantize(p)
        delattr(module, name)
        for suffix, shape in piece_shapes(p.numel()).items():
            dtype = {"": torch.uint8, "_scalers": torch.int8}.get(suffix, p.dtype)
            value = torch.empty(shape, dtype=dtype, device=p.device) if q is None else q[suffix]
            module.register_parameter(f"{name}_nf4{suffix}", nn.Parameter(value, requires_grad=False))
        shapes[name] = tuple(p.shape)
        done.append(name)
    module.nf4_shapes = shapes
    return done


def by_block(keys) -> list[list[str]]:
    """Native keys grouped by their block (``layers.<i>.``), in order: whole weights are read a block at a time."""
    groups: dict[str, list[str]] = {}
    for k in keys:
        groups.setdefault(".".join(k.split(".")[:2]), []).append(k)
    return list(groups.values())


def fill_from_dcp(model: nn.Module, path: str) -> None:
    """Quantizes the NF4 weights of ``model`` from a DCP checkpoint holding them unquantized (a weights-only
    starting point, ``convert from-hf``): each rank reads whole tensors, one block at a time, and keeps its
    shard of the codes."""
    import torch.distributed.checkpoint as dcp

    quantized = quantized_weights(model)
    for keys in by_block(quantized):
        state = {"model": {k: torch.empty(full_shape(*quantized[k]), dtype=torch.float32) for k in keys}}
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
        for k, w in state["model"].items():
            fill(*quantized[k], w)


def full_shape(module: nn.Module, name: str) -> tuple[int, ...]:
    """The unquantized shape of ``module``'s NF4 weight ``name``."""
    return module.nf4_shapes[name]


def fill(module: nn.Module, name: str, full: torch.Tensor) -> None:
    """Quantizes the whole weight ``full`` into ``module``'s pieces of ``name`` (each rank keeps its shard)."""
    from titan_sft.lora import _copy_full

    factors = getattr(module, f"{name}_nf4_factors")  # its dtype is the weight's storage dtype
    q = quantize(full.to(device=local(factors).device, dtype=factors.dtype))
    with torch.no_grad():
        for suffix in PIECES:
            _copy_full(getattr(module, f"{name}_nf4{suffix}"), q[suffix])


def is_nf4_key(key: str) -> bool:
    """Whether a state-dict key is a piece of an NF4 weight."""
    return "_nf4" in key.rsplit(".", 1)[-1]


def weight_key(key: str) -> str | None:
    """``layers.0.attention.wq.weight_nf4`` -> ``layers.0.attention.wq.weight`` (None for the other pieces)."""
    module, leaf = key.rsplit(".", 1)
    return f"{module}.{leaf[: -len('_nf4')]}" if leaf.endswith("_nf4") else None


def quantized_weights(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every quantized weight of ``model``: its native key (``layers.0.attention.wq.weight``) -> (module, name)."""
    from titan_sft.parallel.distributed import unwrapped_name

    return {unwrapped_name(f"{fqn}.{name}" if fqn else name): (m, name)
            for fqn, m in model.named_modules() for name in getattr(m, "nf4_shapes", {})}


def restore(full: dict[str, torch.Tensor], originals: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A gathered state dict with each NF4 weight's pieces replaced by ``originals[key]`` (its unquantized
    weight): what exports and merges read."""
    out = {k: v for k, v in full.items() if not is_nf4_key(k)}
    for k in full:
        if (w := weight_key(k)) is not None:
            out[w] = originals[w]
    return out


def dequantized_state(full: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]],
                      dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights as the run computed with them: each NF4 weight (pieces in ``full``) dequantized."""
    return restore(full, {w: dequantize(*(full[f"{w}_nf4{s}"] for s in PIECES), shapes[w], dtype)
                          for w in shapes})
