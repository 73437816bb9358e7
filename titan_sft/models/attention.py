"""Attention with pluggable backends that all honour document boundaries of packed rows.

A packed row is one flattened sequence ``[1, T]`` holding several documents; ``cu_seqlens`` (int32,
``[n_docs + 1]``, starting at 0 and ending at T) marks where each document starts. Tokens attend only to tokens
of their own document (causally, or bidirectionally for masked-diffusion objectives). Trailing padding is passed
as one more segment, so it attends only to itself.

Backends:
    sdpa: ``F.scaled_dot_product_attention`` with a dense boolean mask (``[T, T]``). Runs everywhere; it is
        the reference for tests and CPU runs.
    flex: FlexAttention with a document ``BlockMask``; sparse, so cost grows with the documents' own lengths.
    flash_varlen: ``flash_attn_varlen_func`` with ``cu_seqlens`` (GPU, flash-attn installed).

The mask (or block mask) is built once per forward by :meth:`Attention.prepare` and shared by all layers.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BACKENDS = ("sdpa", "flex", "flash_varlen")


class BackendUnavailable(RuntimeError):
    """The configured attention backend cannot run here; raised at start-up, never mid-step."""


def check_backend(name: str, device: torch.device | str) -> None:
    """Raises :class:`BackendUnavailable` with a clear message when ``name`` cannot run on ``device``."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise BackendUnavailable(f"model.attention: unknown backend '{name}'; allowed: {', '.join(BACKENDS)}")
    if name == "flex":
        try:
            from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
        except ImportError as e:  # pragma: no cover - torch too old
            raise BackendUnavailable(f"model.attention 'flex' needs torch with FlexAttention: {e}") from None
    if name == "flash_varlen":
        if device.type != "cuda":
            raise BackendUnavailable(
                "model.attention 'flash_varlen' needs a CUDA device; use 'sdpa' (or 'flex') on " + device.type
            )
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


def dense_document_mask(cu_seqlens: torch.Tensor, total: int, causal: bool) -> torch.Tensor:
    """Boolean ``[total, total]`` mask, True where query i may attend to key j."""
    seg = segment_ids(cu_seqlens, total)
    mask = seg[:, None] == seg[None, :]
    if causal:
        mask &= torch.ones(total, total, dtype=torch.bool, device=seg.device).tril()
    return mask


@dataclass
class AttentionMask:
    """What a backend needs to mask one forward; built once per forward, shared by every layer."""

    causal: bool
    cu_seqlens: torch.Tensor | None = None  # int32 [n_docs + 1]; None = one document per row
    max_seqlen: int = 0
    dense: torch.Tensor | None = None  # sdpa: bool [T, T]
    block_mask: Any = None  # flex: BlockMask


class AttentionBackend:
    """Stateless attention kernel dispatcher; one per model, selected by ``model.attention``."""

    def __init__(self, backend: str, causal: bool = True):
        if backend not in BACKENDS:
            raise BackendUnavailable(f"model.attention: unknown backend '{backend}'; allowed: {', '.join(BACKENDS)}")
        self.backend = backend
        self.causal = causal

    def prepare(self, batch: int, seqlen: int, device: torch.device, cu_seqlens: torch.Tensor | None) -> AttentionMask:
        """Builds the mask for a forward over ``[batch, seqlen]`` tokens."""
        if cu_seqlens is not None and batch != 1:
            raise ValueError(f"packed rows (cu_seqlens) must be flattened to batch 1, got batch {batch}")
        if cu_seqlens is None:
            if self.backend == "sdpa":
                return AttentionMask(causal=self.causal)
            if self.backend == "flash_varlen":
                # One document per row; flash varlen sees the batch flattened.
                cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device=device)
                return AttentionMask(causal=self.causal, cu_seqlens=cu, max_seqlen=seqlen)
            cu_seqlens = torch.tensor([0, seqlen], dtype=torch.int32, device=device)  # flex: broadcast over batch
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
        if self.backend == "sdpa":
            return AttentionMask(self.causal, cu_seqlens, dense=dense_document_mask(cu_seqlens, seqlen, self.causal))
        if self.backend == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            seg = segment_ids(cu_seqlens, seqlen)
            causal = self.causal

            def mask_mod(b, h, q_idx, kv_idx):
                same = seg[q_idx] == seg[kv_idx]
                return (same & (q_idx >= kv_idx)) if causal else same

            block = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seqlen, KV_LEN=seqlen, device=device)
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
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=mask.block_mask, enable_gqa=True)
        from flash_attn import flash_attn_varlen_func

        b, h, t, d = q.shape
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
