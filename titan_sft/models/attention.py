"""Attention with pluggable backends that all honour document boundaries of packed rows.

A batch of packed rows ``[B, T]`` holds several documents per row; ``cu_seqlens`` (int32, ``[n_docs + 1]``,
from 0 to B * T) marks where each document starts in the flattened ``B * T`` tokens, and every row boundary
(a multiple of T) is a document boundary. Tokens attend only to tokens of their own document (causally, or
bidirectionally for masked-diffusion objectives). Trailing padding is passed as one more segment, so it attends
only to itself.

Backends:
    sdpa: ``F.scaled_dot_product_attention`` with a dense boolean mask per row (``[B, 1, T, T]``; never one
        spanning rows, whose cost would grow with the square of the whole microbatch). Runs everywhere; it is
        the reference for tests and CPU runs.
    flex: FlexAttention with a per-row document ``BlockMask``; sparse, so cost grows with the documents' lengths.
        Compiled on GPU (uncompiled FlexAttention is a slow reference implementation).
    varlen: torch's own ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention kernels shipped with torch)
        with ``cu_seqlens`` over the flattened rows (GPU, bf16/fp16). Its signature changed across torch releases
        (2.10: ``is_causal``; 2.11: ``window_size``; 2.13: ``enable_gqa`` too): only the arguments the installed
        torch accepts are passed, and key/value heads are expanded for GQA where it has no ``enable_gqa``.
    flash_varlen: ``flash_attn_varlen_func`` from the flash-attn package, same metadata (GPU, bf16/fp16).
    auto: resolved once at start-up (:func:`resolve_backend`): flash_varlen where flash-attn is installed, else
        varlen, on GPU; sdpa on CPU.

The mask (or block mask) is built once per forward by :meth:`Attention.prepare` and shared by all layers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flex", "varlen", "flash_varlen")
CPU_BACKENDS = ("sdpa", "flex")  # flex: forward only (no CPU backward), for evaluation and tests
FLASH_BACKENDS = ("varlen", "flash_varlen")  # FlashAttention kernels: fp16/bf16 inputs only


class BackendUnavailable(RuntimeError):
    """The configured attention backend cannot run here; raised at start-up, never mid-step."""


def resolve_backend(name: str, device: torch.device | str) -> tuple[str, str | None]:
    """The backend ``auto`` stands for on ``device`` (others unchanged), and the notice to print (None: none)."""
    if name != "auto":
        return name, None
    if torch.device(device).type != "cuda":
        return "sdpa", "[init] model.attention auto: sdpa (no GPU)"
    if importlib.util.find_spec("flash_attn") is not None:
        return "flash_varlen", "[init] model.attention auto: flash_varlen (flash-attn is installed)"
    return "varlen", "[init] model.attention auto: varlen (torch's FlashAttention kernels; flash-attn not installed)"


def check_backend(name: str, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
    """Raises :class:`BackendUnavailable` with a clear message when ``name`` cannot run on ``device`` with
    ``dtype`` compute (None: not checked)."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise BackendUnavailable(f"model.attention: unknown backend '{name}'; allowed: {', '.join(BACKENDS)}")
    if name == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:  # pragma: no cover - torch too old
            raise BackendUnavailable(f"model.attention 'flex' needs torch with FlexAttention: {e}") from None
    if name in FLASH_BACKENDS and device.type != "cuda":
        raise BackendUnavailable(f"model.attention '{name}' needs a CUDA device; on {device.type} use one of: "
                                 f"{', '.join(CPU_BACKENDS)}")
    if name in FLASH_BACKENDS and dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        raise BackendUnavailable(f"model.attention '{name}' runs FlashAttention kernels, which take bf16/fp16 only; "
                                 f"this run computes in {str(dtype).removeprefix('torch.')}: set "
                                 "training.param_dtype = 'bfloat16', or use 'sdpa' or 'flex' for fp32")
    if name == "varlen":
        try:
            from torch.nn.attention.varlen import varlen_attn  # noqa: F401
        except ImportError as e:  # pragma: no cover - torch too old
            raise BackendUnavailable(f"model.attention 'varlen' needs torch with torch.nn.attention.varlen: {e}") from None
    if name == "flash_varlen":
        if importlib.util.find_spec("flash_attn") is None:
            raise BackendUnavailable(
                "model.attention 'flash_varlen' needs flash-attn (pip install 'titan_sft[gpu]'); or use 'sdpa'/'flex'"
            )


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Document index of every token: ``[total]`` long, from ``cu_seqlens`` ``[n_docs + 1]``."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(torch.arange(len(lengths), device=cu_seqlens.device), lengths, output_size=total)


def positions_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int, reset: bool) -> torch.Tensor:
    """RoPE positions ``[1, total]``: contiguous ``0..total-1`` (the recipe), or restarting at 0 per document."""
    pos = torch.arange(total, device=cu_seqlens.device)
    if reset:
        pos = pos - cu_seqlens[:-1].long()[segment_ids(cu_seqlens, total)]
    return pos.unsqueeze(0)


def dense_document_mask(cu_seqlens: torch.Tensor, total: int, causal: bool, rows: int = 1) -> torch.Tensor:
    """Boolean mask per row, ``[rows, 1, T, T]`` with T = total / rows: True where query i may attend to key j.

    Rows are independent (a document never crosses a row boundary), so no mask spans two rows.
    """
    t = total // rows
    seg = segment_ids(cu_seqlens, total).view(rows, t)
    mask = seg[:, :, None] == seg[:, None, :]
    if causal:
        mask &= torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
    return mask.unsqueeze(1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A boolean attention mask as sdpa adds it to the scores: 0 where allowed, -inf elsewhere (``dtype`` None:
    the boolean mask itself)."""
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


@dataclass
class AttentionMask:
    """What a backend needs to mask one forward; built once per forward, shared by every layer."""

    causal: bool
    cu_seqlens: torch.Tensor | None = None  # int32 [n_docs + 1]; None = one document per row
    max_seqlen: int = 0
    dense: torch.Tensor | None = None  # sdpa: [B, 1, T, T], bool or (given a dtype) additive 0 / -inf
    block_mask: Any = None  # flex: BlockMask
    # Linear-attention layers (Gated DeltaNet): each token's index within its document [B, T]; None when every row
    # is one document. Set by the model when it has such layers.
    doc_position: torch.Tensor | None = None


class AttentionBackend:
    """Stateless attention kernel dispatcher; one per model, selected by ``model.attention``."""

    def __init__(self, backend: str, causal: bool = True):
        if backend not in BACKENDS:
            raise BackendUnavailable(f"model.attention: unknown backend '{backend}'; allowed: {', '.join(BACKENDS)}")
        self.backend = backend
        self.causal = causal

    def default_positions(self, seqlen: int, device: torch.device) -> torch.Tensor:
        """RoPE positions [1, seqlen] of rows given without positions: 0..seqlen-1 (broadcast over rows)."""
        return torch.arange(seqlen, device=device).unsqueeze(0)

    def row_length(self, seqlen: int) -> int:
        """The length of the rows ``cu_seqlens`` covers for a forward over ``seqlen`` tokens per row (context
        parallel's Ulysses: the unsharded row's)."""
        return seqlen

    def prepare(self, batch: int, seqlen: int, device: torch.device, cu_seqlens: torch.Tensor | None,
                dtype: torch.dtype | None = None) -> AttentionMask:
        """Builds the mask for a forward over ``[batch, seqlen]`` tokens (``cu_seqlens`` over the flattened rows).

        ``dtype`` (the compute dtype): sdpa's dense mask is made additive (0 / -inf) in it once here. sdpa turns a
        boolean mask into exactly that on every call, and the CPU kernel keeps each layer's copy for backward; one
        shared copy keeps one [T, T] mask per forward instead of one per layer (the numbers are the same)."""
        if cu_seqlens is None:
            if self.backend == "sdpa":
                return AttentionMask(causal=self.causal)
            # One document per row.
            cu_seqlens = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
        total = batch * seqlen
        if self.backend == "sdpa":
            dense = dense_document_mask(cu_seqlens, total, self.causal, rows=batch)
            return AttentionMask(self.causal, cu_seqlens, dense=additive_mask(dense, dtype))
        if self.backend == "flex":
            seg = segment_ids(cu_seqlens, total).view(batch, seqlen)
            causal = self.causal

            def mask_mod(b, h, q_idx, kv_idx):
                same = seg[b, q_idx] == seg[b, kv_idx]
                return (same & (q_idx >= kv_idx)) if causal else same

            rows = None if batch == 1 else batch
            block = block_mask_fn(device)(mask_mod, B=rows, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=device)
            return AttentionMask(self.causal, cu_seqlens, block_mask=block)
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
        return AttentionMask(self.causal, cu_seqlens, max_seqlen=max_seqlen)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """q: [B, H, T, D]; k, v: [B, Hkv, T, D] -> [B, H, T, D]."""
        if self.backend == "sdpa":
            if mask.dense is None:
                return F.scaled_dot_product_attention(q, k, v, is_causal=mask.causal, enable_gqa=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, enable_gqa=True)
        if self.backend == "flex":
            return _flex_attention(q.is_cuda)(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
        b, h, t, d = q.shape
        if self.backend == "varlen":
            from torch.nn.attention.varlen import varlen_attn

            kwargs, expand = varlen_kwargs(mask.causal)
            if expand and k.shape[1] != h:  # GQA on a torch without enable_gqa: repeat each kv head
                k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
            out = varlen_attn(
                q.transpose(1, 2).reshape(b * t, h, d),
                k.transpose(1, 2).reshape(b * t, k.shape[1], d),
                v.transpose(1, 2).reshape(b * t, v.shape[1], d),
                mask.cu_seqlens, mask.cu_seqlens, mask.max_seqlen, mask.max_seqlen, **kwargs,
            )
            return out.reshape(b, t, h, d).transpose(1, 2)
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(
            q.transpose(1, 2).reshape(b * t, h, d),
            k.transpose(1, 2).reshape(b * t, k.shape[1], d),
            v.transpose(1, 2).reshape(b * t, v.shape[1], d),
            mask.cu_seqlens,
            mask.cu_seqlens,
            mask.max_seqlen,
            mask.max_seqlen,
            causal=mask.causal,
        )
        return out.reshape(b, t, h, d).transpose(1, 2)


def varlen_kwargs(causal: bool, params: set[str] | None = None) -> tuple[dict, bool]:
    """Keyword arguments for the installed ``varlen_attn`` (``params``: its parameter names, read from its
    signature by default) and whether key/value heads must be expanded (no ``enable_gqa``)."""
    if params is None:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = set(inspect.signature(varlen_attn).parameters)
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0) if causal else (-1, -1)}
    elif "is_causal" in params:
        kwargs = {"is_causal": causal}
    else:
        raise BackendUnavailable("model.attention 'varlen': this torch's varlen_attn takes neither window_size nor "
                                 "is_causal; use 'flex' or 'flash_varlen'")
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs, "enable_gqa" not in params


_COMPILED_FLEX = None
_COMPILED_BLOCK_MASK = None


def block_mask_fn(device: torch.device):
    """``create_block_mask``, compiled once on GPU as torchtitan does: run eagerly it evaluates ``mask_mod`` on
    every (query, key) pair of every row (at 32k, ~1G mask elements per forward) before it keeps the blocks; the
    compiled form never materialises them. On CPU (the reference path, short rows) it runs eagerly."""
    global _COMPILED_BLOCK_MASK
    from torch.nn.attention.flex_attention import create_block_mask

    if device.type != "cuda":
        return create_block_mask
    if _COMPILED_BLOCK_MASK is None:
        _COMPILED_BLOCK_MASK = torch.compile(create_block_mask)
    return _COMPILED_BLOCK_MASK


def _flex_attention(cuda: bool):
    """FlexAttention, compiled once on GPU (its eager form materialises scores and is only a reference)."""
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not cuda:
        return flex_attention
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    return _COMPILED_FLEX
