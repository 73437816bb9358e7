"""Context parallel: every packed row split along the sequence across the ``cp`` ranks of the mesh.

The cp ranks of one data-parallel rank read the same microbatches (like tp ranks); each runs the model on its
part of every row (:class:`SequenceShard`: which positions, how targets and loss weights follow them) and the
objective's loss on that part, so the step's loss is the sum over the cp ranks and FSDP sums their gradients
(it shards over the cp ranks too). Everything but attention is per token and needs no communication; attention
sees the whole row through one of two exchanges (``parallelism.cp_mode``):

* ``ulysses`` (DeepSpeed-Ulysses; Arctic Long Sequence Training): before attention an all-to-all turns sequence
  shards of all heads into whole rows of ``heads / cp`` heads, any backend attends with the unsharded row's
  masks (document isolation, causal or bidirectional, the same ``cu_seqlens``), and a second all-to-all turns
  the output back. Needs the heads (per tp rank) divisible by cp. Key/value heads fewer than cp (GQA) are
  repeated to ``lcm(kv_heads, cp)`` before the exchange, each copy sent to the ranks whose query heads use it:
  the key/value traffic and their attention input grow by ``cp / gcd(kv_heads, cp)``. Contiguous sharding: every
  rank attends over the whole row, so causal work is balanced already.
* ``ring`` (K/V all-gathered; torch's "allgather" rotation, as torchtitan and Megatron offer): each rank keeps
  its queries and gathers every rank's keys and values, attending with the rows of the document mask its
  queries own. Rows are sharded head-tail (rank r holds chunks r and 2cp-1-r of 2cp equal chunks), so each rank
  has the same causal work. Runs with sdpa (a dense [Tq, T] mask per row) and flex (a block mask over the
  gathered keys); the varlen kernels take no per-query positions and are refused. The gathered keys and values
  of every layer are kept for backward ([T, kv_heads, head_dim] per row): cheap with GQA, the reason Ulysses is
  the default. torch's own ``context_parallel`` is not used: it has no document masks for sdpa and no CPU path.

RoPE positions are those of the unsharded row (taken from the microbatch, or by default the shard's own
positions ``0..T-1``); ``cu_seqlens`` is always the unsharded row's. Only the token mixers know about cp:
:func:`apply_context_parallel` swaps the model's attention backend for a :class:`ContextParallelAttention`, and
Gated DeltaNet (Qwen3.5's linear attention) takes the same object. Under Ulysses its projections run on the rank's
positions, then q/k/v (before the causal conv), the decay and the write strength move to whole rows of the rank's
key heads with their value heads, the conv and the recurrence run there (document boundaries from the unsharded
``cu_seqlens``), and the output moves back before the gated norm. Under ring it stays on the rank's two segments
and passes state instead (``models.gated_deltanet.ring_linear_attention``): each segment's conv reads the
all-gathered last tokens of the segment before it, and the recurrence runs per segment from a zero state keeping
the segment's affine state map; the maps are all-gathered and chained, so each segment starts from the state the
whole row would have there (the linear layers do about 1.5x the delta rule's work: d_k extra value columns).
Generation and other calls on rows that are not a training microbatch run under :func:`full_sequence`, where
every cp rank runs the whole row (the cp ranks hold the same data).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from titan_sft.models.attention import AttentionBackend, AttentionMask, additive_mask, segment_ids

CP_MODES = ("ulysses", "ring")


@dataclass(frozen=True)
class SequenceShard:
    """Which positions of every row of length L this cp rank holds (``index``), in the order it holds them."""

    rank: int
    size: int
    mode: str = "ulysses"

    def chunks(self) -> int:
        """Equal chunks a row is cut into: one per rank, or two (head and tail) per rank for ring."""
        return self.size * (2 if self.mode == "ring" else 1)

    def index(self, length: int, rank: int | None = None, device=None) -> torch.Tensor:
        """Positions [length / size] of a row held by ``rank`` (default: this one), ascending."""
        r = self.rank if rank is None else rank
        c = length // self.chunks()
        if self.mode == "ring":  # head-tail: equal causal work per rank
            return torch.cat([torch.arange(r * c, (r + 1) * c, device=device),
                              torch.arange((2 * self.size - 1 - r) * c, (2 * self.size - r) * c, device=device)])
        return torch.arange(r * c, (r + 1) * c, device=device)

    def gathered_index(self, length: int, device=None) -> torch.Tensor:
        """The row position of every slot of tensors all-gathered over the cp ranks (rank-major)."""
        return torch.cat([self.index(length, s, device) for s in range(self.size)])

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``x`` [P, L, ...] (per-position fields of a microbatch): [P, L / size, ...]."""
        return x.index_select(1, self.index(x.shape[1], device=x.device))

    def flat(self, flat: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """For positions ``flat`` (long [n], ``p * length + i`` in the unsharded [P, L] rows): which this rank
        holds (bool [n]) and their flat positions in its [P, L / size] part (long [n], valid where held)."""
        local = length // self.size
        where = torch.full((length,), -1, dtype=torch.long, device=flat.device)
        where[self.index(length, device=flat.device)] = torch.arange(local, device=flat.device)
        p, i = flat // length, flat % length
        held = where[i] >= 0
        return held, p * local + where[i]


class ContextParallelAttention:
    """An attention backend that runs ``inner`` across the cp ranks (see the module docstring).

    Called like :class:`AttentionBackend` on this rank's part of every row: ``prepare`` takes the local row length
    and the unsharded row's ``cu_seqlens``; q [B, H, Tl, D], k/v [B, Hkv, Tl, D] -> [B, H, Tl, D].
    """

    def __init__(self, inner: AttentionBackend, mesh: DeviceMesh, mode: str):
        self.inner, self.mode = inner, mode
        self.group = mesh.get_group()
        self.shard = SequenceShard(mesh.get_local_rank(), mesh.size(), mode)
        self.active = True  # False under full_sequence(): every rank runs whole rows with the inner backend

    @property
    def backend(self) -> str:
        return self.inner.backend

    @property
    def causal(self) -> bool:
        return self.inner.causal

    @causal.setter
    def causal(self, value: bool) -> None:
        self.inner.causal = value

    def row_length(self, seqlen: int) -> int:
        """The row length ``cu_seqlens`` covers: the unsharded row's (see ``AttentionBackend``)."""
        return seqlen * self.shard.size if self.active else seqlen

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def size(self) -> int:
        return self.shard.size

    def scatter_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Tl, H, D] (all heads, this rank's positions) -> [B, T, H / cp, D] (this rank's block of heads, whole
        rows): the exchange that moves a Gated DeltaNet layer to whole rows before its conv (Ulysses)."""
        return self._seq_to_heads(x.transpose(1, 2)).transpose(1, 2)

    def gather_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H / cp, D] -> [B, Tl, H, D]: the inverse of :meth:`scatter_heads`."""
        return self._heads_to_seq(x.transpose(1, 2)).transpose(1, 2)

    def segments(self) -> tuple[int, int]:
        """Ring: the places in the row (of its 2 cp equal segments) of this rank's head and tail segment."""
        return self.shard.rank, 2 * self.shard.size - 1 - self.shard.rank

    def gather_segments(self, x: torch.Tensor) -> torch.Tensor:
        """Ring: [B, 2, ...] (something per segment of this rank, head then tail) -> [B, 2 cp, ...], every rank's in
        row order; differentiable (the gradient is reduce-scattered back). Gated DeltaNet passes its conv's
        window and its recurrent state's affine maps this way."""
        from titan_sft.parallel.comm import all_gather_rows

        cp, b = self.shard.size, x.shape[0]
        out = all_gather_rows(x, self.group, what="context-parallel segment all-gather")  # [cp * B, 2, ...]
        out = out.view(cp, b, *x.shape[1:]).transpose(0, 1)  # [B, cp, 2, ...]
        return torch.cat([out[:, :, 0], out[:, :, 1].flip(1)], 1)  # rank r's tail is segment 2cp-1-r

    def default_positions(self, seqlen: int, device) -> torch.Tensor:
        """RoPE positions [1, Tl] of this rank's part of rows numbered 0..T-1."""
        if not self.active:
            return self.inner.default_positions(seqlen, device)
        return self.shard.index(seqlen * self.shard.size, device=device).unsqueeze(0)

    def prepare(self, batch: int, seqlen: int, device: torch.device, cu_seqlens: torch.Tensor | None,
                dtype: torch.dtype | None = None) -> AttentionMask:
        if not self.active:
            return self.inner.prepare(batch, seqlen, device, cu_seqlens, dtype)
        total = seqlen * self.shard.size
        if self.mode == "ulysses":  # after the exchange every rank holds whole rows: the unsharded masks
            return self.inner.prepare(batch, total, device, cu_seqlens, dtype)
        return self._ring_mask(batch, total, device, cu_seqlens, dtype)

    def _ring_mask(self, batch: int, total: int, device, cu_seqlens, dtype) -> AttentionMask:
        """Rows of the document mask for this rank's queries against the gathered keys (rank-major order)."""
        causal = self.causal
        if cu_seqlens is None:
            cu_seqlens = torch.arange(0, (batch + 1) * total, total, dtype=torch.int32, device=device)
        cu_seqlens = cu_seqlens.to(device=device, dtype=torch.int32)
        seg = segment_ids(cu_seqlens, batch * total).view(batch, total)
        q_pos = self.shard.index(total, device=device)
        k_pos = self.shard.gathered_index(total, device=device)
        if self.inner.backend == "sdpa":
            dense = seg[:, q_pos, None] == seg[:, None, k_pos]
            if causal:
                dense &= q_pos[:, None] >= k_pos[None, :]
            return AttentionMask(causal, cu_seqlens, dense=additive_mask(dense.unsqueeze(1), dtype))
        from titan_sft.models.attention import block_mask_fn

        def mask_mod(b, h, q_idx, kv_idx):
            q, k = q_pos[q_idx], k_pos[kv_idx]
            same = seg[b, q] == seg[b, k]
            return (same & (q >= k)) if causal else same

        block = block_mask_fn(device)(mask_mod, B=None if batch == 1 else batch, H=None, Q_LEN=len(q_pos),
                                      KV_LEN=total, device=device)
        return AttentionMask(causal, cu_seqlens, block_mask=block)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        if not self.active:
            return self.inner(q, k, v, mask)
        if self.mode == "ring":
            return self.inner(q, self._gather_kv(k), self._gather_kv(v), mask)
        cp = self.shard.size
        rep = cp // math.gcd(k.shape[1], cp)
        if rep > 1:  # fewer kv heads than cp (or not a multiple): each rank needs the ones its query heads use
            k, v = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        q, k, v = (self._seq_to_heads(x) for x in (q, k, v))
        return self._heads_to_seq(self.inner(q, k, v, mask))

    def _seq_to_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, Tl, D] (all heads, this rank's positions) -> [B, H / cp, T, D] (its heads, whole rows)."""
        from titan_sft.parallel.comm import all_to_all_rows

        cp = self.shard.size
        b, h, t, d = x.shape
        send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).reshape(cp * b, h // cp, t, d)
        recv = all_to_all_rows(send, [b] * cp, [b] * cp, self.group, what="context-parallel all-to-all")
        return recv.view(cp, b, h // cp, t, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d)

    def _heads_to_seq(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H / cp, T, D] -> [B, H, Tl, D]: the inverse of :meth:`_seq_to_heads`."""
        from titan_sft.parallel.comm import all_to_all_rows

        cp = self.shard.size
        b, hl, t, d = x.shape
        tl = t // cp
        send = x.view(b, hl, cp, tl, d).permute(2, 0, 1, 3, 4).reshape(cp * b, hl, tl, d)
        recv = all_to_all_rows(send, [b] * cp, [b] * cp, self.group, what="context-parallel all-to-all")
        return recv.view(cp, b, hl, tl, d).transpose(0, 1).reshape(b, cp * hl, tl, d)

    def _gather_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, Tl, D] -> [B, Hkv, T, D], keys in rank-major order (``SequenceShard.gathered_index``)."""
        from titan_sft.parallel.comm import all_gather_rows

        cp = self.shard.size
        b, h, t, d = x.shape
        out = all_gather_rows(x, self.group, what="context-parallel all-gather")  # [cp * B, ...]
        return out.view(cp, b, h, t, d).permute(1, 2, 0, 3, 4).reshape(b, h, cp * t, d)


def apply_context_parallel(model: nn.Module, cp_mesh: DeviceMesh, mode: str) -> SequenceShard:
    """Gives ``model`` (the shared decoder: ``model.backend`` and every attention module's ``backend``) one
    :class:`ContextParallelAttention` over ``cp_mesh``, and each Gated DeltaNet mixer the same object as its
    exchange (Ulysses: heads; ring: segment windows and states); returns this rank's
    :class:`SequenceShard`."""
    from titan_sft.models.gated_deltanet import GatedDeltaNet

    wrapper = ContextParallelAttention(model.backend, cp_mesh, mode)
    model.backend = wrapper
    for m in model.modules():
        if m is not model and isinstance(getattr(m, "backend", None), AttentionBackend):
            m.backend = wrapper
        if isinstance(m, GatedDeltaNet):
            m.cp = wrapper
    return wrapper.shard


def sequence_shard(model: nn.Module) -> SequenceShard | None:
    """The model's :class:`SequenceShard` under context parallel, else None."""
    backend = getattr(model, "backend", None)
    return backend.shard if isinstance(backend, ContextParallelAttention) else None


@contextmanager
def full_sequence(model: nn.Module):
    """Within the block the model runs whole rows on every cp rank (generation, scoring); a no-op without cp."""
    backend = getattr(model, "backend", None)
    if not isinstance(backend, ContextParallelAttention):
        yield
        return
    backend.active = False
    try:
        yield
    finally:
        backend.active = True
