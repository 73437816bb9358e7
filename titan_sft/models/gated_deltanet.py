"""Gated DeltaNet: the linear-attention token mixer of Qwen3.5's hybrid decoder, in plain PyTorch.

Per value head the layer keeps a state ``S`` of shape ``[d_k, d_v]`` and, token by token (the gated delta rule),

    S_t = exp(g_t) * S_{t-1} + beta_t * k_t (v_t - exp(g_t) * S_{t-1}^T k_t)^T,        o_t = S_t^T q_t / sqrt(d_k)

with ``k``, ``q`` L2-normalised, ``beta = sigmoid(b)`` the write strength and ``g = -exp(A_log) * softplus(a +
dt_bias)`` the log decay. q, k and v come out of a depthwise causal convolution (kernel 4, SiLU) over their
projections; each key head serves ``n_v_heads / n_k_heads`` consecutive value heads; the output passes a gated
RMSNorm (gate ``z``) and ``out_proj``. transformers' ``Qwen3_5GatedDeltaNet`` defines the numbers this module
reproduces (its fused ``in_proj_qkv`` and ``conv1d`` are split here into q, k and v parts, so that tensor parallel
can shard heads; ``models.hf_adapter`` joins them on export).

Packed rows: a document boundary restarts both the recurrent state and the convolution's window (a token never
reads the previous document's last ``kernel - 1`` tokens). The torch path lays documents out chunk-aligned and
clears the state at each document's first chunk; on CUDA with flash-linear-attention (``fla-core``) installed,
its chunked kernel takes the same boundaries as ``cu_seqlens``.

:func:`chunk_gated_delta_rule` is the reference (fp32, chunks of 64 tokens, runs everywhere);
:func:`gated_delta_rule_flops` counts its work for MFU.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F
from torch import nn

CHUNK = 64  # tokens per chunk of the torch delta rule (and of fla's kernel)


def _local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a parameter sharded by tensor parallel (a DTensor); the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension (the eps placement transformers and fla use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           reset: torch.Tensor | None = None, chunk: int = CHUNK,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False):
    """The gated delta rule over whole rows, computed chunk by chunk (the WY/UT form), in fp32 (or fp64).

    Args:
        q, k: [B, T, H, d_k], already L2-normalised and with one head per value head.
        v: [B, T, H, d_v].
        g: [B, T, H] log decay (<= 0); beta: [B, T, H] write strength.
        reset: optional bool [B, T / chunk]: clear the state before that chunk (a document starts there). T must
            then be a multiple of ``chunk``.
        initial_state: optional [B, H, d_k, d_v], the state before the first token (zeros by default).
        output_final_state: also return the state after the last token ([B, H, d_k, d_v], fp32 at least).
    Returns:
        [B, T, H, d_v] in q's dtype (and the final state when asked).
    """
    dtype = q.dtype
    b, t, h, dk = k.shape
    pad = (-t) % chunk
    ctype = torch.promote_types(q.dtype, torch.float32)  # fp32 at least (fp64 for reference checks)
    q, k, v, g, beta = (x.transpose(1, 2).to(ctype) for x in (q, k, v, g, beta))  # heads before time
    q = q * dk**-0.5
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (t + pad) // chunk
    q, k, v = (x.reshape(b, h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    decay = g.cumsum(-1)  # log of the decay from the chunk's start to each position
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # decay from position j to position i of a chunk, zero above the diagonal (j after i)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    # Within a chunk the delta rule's writes depend on each other through a unit lower-triangular system
    # (I + strict_lower(beta K K^T * pair)); solving it once turns the chunk's writes into two matmuls.
    system = (kb @ k.transpose(-1, -2)) * pair
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, kb * decay.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * pair  # intra-chunk attention, causal with decay
    q_dec = q * decay.exp()[..., None]  # queries reading the state carried into the chunk
    k_dec = k * (decay[..., -1:] - decay).exp()[..., None]  # keys as they enter the state at the chunk's end
    chunk_decay = decay[..., -1].exp()[..., None, None]
    keep = None if reset is None else (~reset).to(q.dtype).view(b, 1, n, 1, 1)
    state = q.new_zeros(b, h, dk, v.shape[-1]) if initial_state is None else initial_state.to(ctype)
    out = []
    for i in range(n):
        if keep is not None:
            state = state * keep[:, :, i]
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_dec[:, :, i] @ state + scores[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k_dec[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, h, n * chunk, -1)[:, :, :t].transpose(1, 2).to(dtype)
    return (o, state) if output_final_state else o


def document_layout(cu_seqlens: torch.Tensor, total: int, chunk: int = CHUNK):
    """Where each of ``total`` packed tokens goes when every document starts on a chunk boundary.

    Returns (dest [total] long: the token's slot, length: slots in all, reset [length / chunk] bool: chunks where a
    document starts).
    """
    cu = cu_seqlens.long()
    lengths = cu[1:] - cu[:-1]
    slots = (lengths + chunk - 1) // chunk * chunk
    start = torch.cumsum(slots, 0) - slots
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=cu.device), lengths, output_size=total)
    position = torch.arange(total, device=cu.device) - cu[:-1][doc]
    dest = start[doc] + position
    length = int(slots.sum())
    reset = torch.zeros(length // chunk, dtype=torch.bool, device=cu.device)
    reset[(start[lengths > 0] // chunk)] = True
    return dest, length, reset


def packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """The torch delta rule over packed rows [B, T, ...] whose documents ``cu_seqlens`` marks (over B * T): each
    document is computed as if alone (the state restarts at its first token)."""
    b, t = q.shape[:2]
    dest, length, reset = document_layout(cu_seqlens, b * t)

    def spread(x):  # [B, T, ...] -> [1, length, ...], each document from a chunk start, zeros between
        flat = x.reshape(b * t, *x.shape[2:])
        return flat.new_zeros(length, *x.shape[2:]).index_copy(0, dest, flat).unsqueeze(0)

    out = chunk_gated_delta_rule(*(spread(x) for x in (q, k, v, g, beta)), reset=reset.unsqueeze(0))
    return out[0].index_select(0, dest).reshape(b, t, *out.shape[2:])


_FLA_NOTICE = False


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens):
    """flash-linear-attention's chunked kernel (CUDA): rows flattened into one sequence with ``cu_seqlens``."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    b, t = q.shape[:2]
    if cu_seqlens is None:
        cu_seqlens = torch.arange(0, (b + 1) * t, t, dtype=torch.int32, device=q.device)
    flat = [x.reshape(1, b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    out, _ = fla_chunk(*flat, cu_seqlens=cu_seqlens.long(), use_qk_l2norm_in_kernel=False)
    return out.reshape(b, t, *out.shape[2:])


@torch.compiler.disable  # eager under per-block compile: the torch path's chunk loop would be unrolled into the
# graph (and its packed layout is data-dependent); fla's kernels are Triton already
def gated_delta_rule(q, k, v, g, beta, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
    """Dispatch: fla's kernel on CUDA where installed (one notice where not), else the torch reference."""
    global _FLA_NOTICE
    if q.is_cuda:
        if fla_available():
            return _fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens)
        if not _FLA_NOTICE:
            _FLA_NOTICE = True
            import logging

            logging.getLogger("titan_sft").warning(
                "[init] Gated DeltaNet runs torch's chunked delta rule: install fla-core (pip install "
                "'titan_sft[gpu]') for flash-linear-attention's kernels")
    if cu_seqlens is None:
        return chunk_gated_delta_rule(q, k, v, g, beta)
    return packed_gated_delta_rule(q, k, v, g, beta, cu_seqlens)


def segment_gated_delta_rule(q, k, v, g, beta, position: torch.Tensor):
    """The delta rule over segments [N, c, ...] of longer rows, for state passing (ring context parallel).

    ``position`` [N, c] is each token's index within its document; a segment whose first position is not 0 continues
    a document from the segment before it. The state after a segment is affine in the state before it,
    ``S_out = P S_in + Q``, and every output is ``o = o_0 + r S_in``: one pass with the values extended by d_k zero
    columns and the initial state ``[0 | I]`` gives all four (the recurrence acts on the state's columns
    independently, the identity columns carry ``P`` and ``r``). A document starting inside the segment clears the
    state there, so it contributes neither to ``P`` nor, after its start, to ``r``.

    Returns (o_0 [N, c, H, d_v], r [N, c, H, d_k], P [N, H, d_k, d_k], Q [N, H, d_k, d_v]), the states fp32."""
    n, c, h, dk = q.shape
    dv = v.shape[-1]
    v_ext = torch.cat([v, v.new_zeros(n, c, h, dk)], -1)
    initial = torch.zeros(n, h, dk, dv + dk, dtype=torch.float32, device=q.device)
    initial[..., dv:] = torch.eye(dk, device=q.device)
    starts = position == 0
    starts[:, 0] = True  # every segment begins a piece; it continues a document unless its position is 0
    if q.is_cuda and fla_available():
        o, final = _fla_segments(q, k, v_ext, g, beta, starts, position[:, 0] > 0, initial)
    else:
        o, final = _torch_segments(q, k, v_ext, g, beta, starts, position[:, 0] > 0, initial)
    return o[..., :dv], o[..., dv:], final[..., dv:], final[..., :dv]


def _torch_segments(q, k, v, g, beta, starts, continues, initial):
    """The torch delta rule per segment (batched): each segment's pieces laid out from chunk starts, the state
    cleared where a document starts (at the segment's first chunk only if it does not continue one)."""
    n, c = starts.shape
    layouts = []
    for i in range(n):
        cu = torch.cat([starts[i].nonzero().flatten(), starts.new_tensor([c], dtype=torch.long)])
        dest, length, reset = document_layout(cu, c)
        reset[0] = not bool(continues[i])
        layouts.append((dest, length, reset))
    width = max(x[1] for x in layouts)
    dest = torch.cat([d + i * width for i, (d, _, _) in enumerate(layouts)])
    reset = torch.zeros(n, width // CHUNK, dtype=torch.bool, device=q.device)
    for i, (_, length, r) in enumerate(layouts):
        reset[i, : length // CHUNK] = r

    def spread(x):  # [N, c, ...] -> [N, width, ...]
        flat = x.reshape(n * c, *x.shape[2:])
        return flat.new_zeros(n * width, *x.shape[2:]).index_copy(0, dest, flat).view(n, width, *x.shape[2:])

    o, final = chunk_gated_delta_rule(*(spread(x) for x in (q, k, v, g, beta)), reset=reset, initial_state=initial,
                                      output_final_state=True)
    return o.reshape(n * width, *o.shape[2:]).index_select(0, dest).view(n, c, *o.shape[2:]), final


def _fla_segments(q, k, v, g, beta, starts, continues, initial):
    """flash-linear-attention's kernel over the segments' pieces as sequences: the first piece of a segment starts
    from ``initial`` (its identity columns only where it continues a document), the others from zeros; each
    segment's final state is its last piece's."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk

    n, c = starts.shape
    flat_starts = starts.flatten().nonzero().flatten()
    cu = torch.cat([flat_starts, flat_starts.new_tensor([n * c])])
    first = (flat_starts % c == 0).nonzero().flatten()  # each segment's first piece (one per segment, in order)
    init = initial.new_zeros(len(flat_starts), *initial.shape[1:])
    init[first] = initial * continues.view(n, 1, 1, 1).to(initial.dtype)
    flat = [x.reshape(1, n * c, *x.shape[2:]) for x in (q, k, v, g, beta)]
    o, final = fla_chunk(*flat, initial_state=init, output_final_state=True, cu_seqlens=cu,
                         use_qk_l2norm_in_kernel=False)
    last = torch.cat([first[1:], first.new_tensor([len(flat_starts)])]) - 1
    return o.view(n, c, *o.shape[2:]), final[last].float()


def chain_states(carry: torch.Tensor, upto: int) -> list[torch.Tensor]:
    """States before segments 0..upto of rows cut into consecutive segments: ``carry`` [B, S, H, d_k, d_k + d_v]
    holds each segment's (P | Q) from :func:`segment_gated_delta_rule`; the first segment starts from zeros."""
    dk = carry.shape[3]
    state = carry.new_zeros(*carry.shape[:1], *carry.shape[2:4], carry.shape[-1] - dk)
    states = []
    for j in range(upto + 1):
        states.append(state)
        state = carry[:, j, ..., :dk] @ state + carry[:, j, ..., dk:]
    return states


@torch.compiler.disable  # eager under per-block compile, like gated_delta_rule (data-dependent layouts)
def ring_linear_attention(q, k, v, g, beta, convs, position, cp, repeat: int):
    """Gated DeltaNet's conv and recurrence on this rank's two segments of every row under ring context parallel
    (rows cut into 2 cp segments; this rank holds segments ``cp.segments()``), without moving whole rows.

    The conv reads the last ``kernel - 1`` tokens of the segment before each of its segments (all-gathered; zeros
    before the row's start, masked by ``position`` across document starts). The recurrence runs on each segment
    from a zero state, keeping the affine map from the state before the segment to the state after it
    (:func:`segment_gated_delta_rule`); the maps of all segments are all-gathered, every rank chains them up to
    its own segments and adds what its incoming state reads. Gradients flow back through both gathers.

    q, k [B, Tl, Hk, d_k] and v [B, Tl, Hv, d_v] before the conv; g, beta [B, Tl, Hv]; ``position`` [B, Tl] the
    local tokens' indices within their documents; ``repeat`` value heads per key head. Returns o [B, Tl, Hv, d_v].
    """
    b, t = q.shape[:2]
    c, halo = t // 2, convs[0].shape[-1] - 1
    seg_pos = position.reshape(b * 2, c)
    mine = list(cp.segments())

    def conv(y, w):  # [B, Tl, C] -> the same, each segment read after its predecessor's last `halo` tokens
        y = y.reshape(b, 2, c, -1)
        tails = cp.gather_segments(y[:, :, c - halo:])  # [B, 2cp, halo, C] in row order
        before = torch.cat([torch.zeros_like(tails[:, :1]), tails[:, :-1]], 1)[:, mine]
        ext = torch.cat([before, y], 2).reshape(b * 2, halo + c, -1)
        ext_pos = torch.cat([seg_pos.new_zeros(b * 2, halo), seg_pos], 1)
        return causal_depthwise_conv(ext, w, ext_pos)[:, halo:].reshape(b, t, -1)

    q, k, v = (conv(y.flatten(2), w).reshape(y.shape) for y, w in zip((q, k, v), convs))
    q, k = l2_normalize(q.float()), l2_normalize(k.float())
    if repeat > 1:
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    h, dk, dv = v.shape[2], q.shape[-1], v.shape[-1]
    o0, r, P, Q = segment_gated_delta_rule(*(x.reshape(b * 2, c, *x.shape[2:]) for x in (q, k, v, g, beta)), seg_pos)
    carry = cp.gather_segments(torch.cat([P, Q], -1).view(b, 2, h, dk, dk + dv))
    states = chain_states(carry, max(mine))
    incoming = torch.stack([states[j] for j in mine], 1)  # [B, 2, H, d_k, d_v]
    o = o0.view(b, 2, c, h, dv).float() + torch.einsum("bschk,bshkv->bschv", r.view(b, 2, c, h, dk).float(), incoming)
    return o.reshape(b, t, h, dv)


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor, position: torch.Tensor | None) -> torch.Tensor:
    """SiLU(causal depthwise conv1d) over time. x: [B, T, C]; weight: [C, 1, K]; ``position`` [B, T] (each
    token's index within its document, None: one document per row) keeps the window inside the document."""
    ksize, t = weight.shape[-1], x.shape[1]
    if position is None:  # whole rows: conv1d itself (the same arithmetic as transformers' reference path)
        out = F.conv1d(x.transpose(1, 2), weight.to(x.dtype), padding=ksize - 1, groups=x.shape[-1])[..., :t]
        return F.silu(out.transpose(1, 2))
    w = weight.squeeze(1).to(x.dtype)
    xp = F.pad(x, (0, 0, ksize - 1, 0))
    out = None
    for lag in range(ksize):  # tap ksize-1-lag reads the token `lag` steps back
        term = xp[:, ksize - 1 - lag: ksize - 1 - lag + t] * w[:, ksize - 1 - lag]
        if position is not None and lag:
            term = term * (position >= lag).unsqueeze(-1).to(x.dtype)
        out = term if out is None else out + term
    return F.silu(out)


class GatedRMSNorm(nn.Module):
    """RMSNorm over each value head, then times SiLU(z): weight * norm(x) in x's dtype, the gate in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(x.dtype)
        return (h * F.silu(z.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer. Parameter names follow transformers' except the split q/k/v parts."""

    def __init__(self, dim: int, n_k_heads: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                 conv_kernel: int, eps: float):
        super().__init__()
        if n_v_heads % n_k_heads:
            raise ValueError(f"linear attention: {n_v_heads} value heads are not a multiple of {n_k_heads} key heads")
        self.n_k_heads, self.n_v_heads = n_k_heads, n_v_heads
        self.k_head_dim, self.v_head_dim = k_head_dim, v_head_dim
        key_dim, value_dim = n_k_heads * k_head_dim, n_v_heads * v_head_dim
        self.in_proj_q = nn.Linear(dim, key_dim, bias=False)
        self.in_proj_k = nn.Linear(dim, key_dim, bias=False)
        self.in_proj_v = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_z = nn.Linear(dim, value_dim, bias=False)
        self.in_proj_b = nn.Linear(dim, n_v_heads, bias=False)
        self.in_proj_a = nn.Linear(dim, n_v_heads, bias=False)
        # depthwise conv weights [channels, 1, kernel], as nn.Conv1d keeps them
        self.conv_q = nn.Parameter(torch.empty(key_dim, 1, conv_kernel))
        self.conv_k = nn.Parameter(torch.empty(key_dim, 1, conv_kernel))
        self.conv_v = nn.Parameter(torch.empty(value_dim, 1, conv_kernel))
        self.dt_bias = nn.Parameter(torch.ones(n_v_heads))
        self.A_log = nn.Parameter(torch.empty(n_v_heads))
        self.norm = GatedRMSNorm(v_head_dim, eps)
        self.out_proj = nn.Linear(value_dim, dim, bias=False)
        # Context parallel (Ulysses) sets the exchange: ``scatter_heads`` [B, Tl, H, D] -> [B, T, H / cp, D] (whole
        # rows of this rank's heads), ``gather_heads`` its inverse, ``rank``/``size``, ``active``.
        self.cp = None

    def forward(self, x: torch.Tensor, position: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        """x: [B, T, dim] -> [B, T, dim]. ``position`` [B, T]: index within the document (None: whole rows);
        ``cu_seqlens``: the documents over the flattened rows (None: one per row). Under tensor parallel the
        projections give this rank's heads, and every per-head parameter is its local part."""
        b, t, _ = x.shape
        q = self.in_proj_q(x).view(b, t, -1, self.k_head_dim)
        k = self.in_proj_k(x).view(b, t, -1, self.k_head_dim)
        v = self.in_proj_v(x).view(b, t, -1, self.v_head_dim)
        beta = self.in_proj_b(x).sigmoid()
        g = -_local(self.A_log).float().exp() * F.softplus(self.in_proj_a(x).float() + _local(self.dt_bias))
        convs = [_local(w) for w in (self.conv_q, self.conv_k, self.conv_v)]
        cp = self.cp if self.cp is not None and self.cp.active else None
        if cp is not None and cp.mode == "ring":  # this rank's two segments of each row, the state passed along
            local = position.index_select(1, cp.shard.index(position.shape[1], device=position.device))
            o = ring_linear_attention(q, k, v, g, beta, convs, local, cp, v.shape[2] // q.shape[2]).to(x.dtype)
            z = self.in_proj_z(x).view(b, t, -1, self.v_head_dim)
            return self.out_proj(self.norm(o, z).reshape(b, t, -1))
        if cp is not None:
            # Ulysses: whole rows of this rank's key heads with their value heads (the next cp rank's heads are the
            # next block), before the conv, so the conv window and the recurrence see the whole row; ``position``
            # and ``cu_seqlens`` are the unsharded rows'. g and beta travel with their value heads.
            q, k, v = (cp.scatter_heads(y) for y in (q, k, v))
            g, beta = (cp.scatter_heads(y.unsqueeze(-1)).squeeze(-1) for y in (g, beta))
            convs = [w.chunk(cp.size)[cp.rank] for w in convs]  # the channels of this rank's heads
        q, k, v = (causal_depthwise_conv(y.flatten(2), w, position).reshape(y.shape) for y, w in zip((q, k, v), convs))
        q, k = l2_normalize(q.float()), l2_normalize(k.float())
        group = v.shape[2] // q.shape[2]  # value heads per key head (consecutive)
        if group > 1:
            q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
        o = gated_delta_rule(q, k, v, g, beta, cu_seqlens).to(x.dtype)
        if cp is not None:
            o = cp.gather_heads(o)
        z = self.in_proj_z(x).view(b, t, -1, self.v_head_dim)
        o = self.norm(o, z)
        return self.out_proj(o.reshape(b, t, -1))

    def init_weights(self, std: float, out_std: float) -> None:
        for lin in (self.in_proj_q, self.in_proj_k, self.in_proj_v, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.out_proj.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        bound = 1 / math.sqrt(self.conv_q.shape[-1])  # nn.Conv1d's default for a depthwise kernel
        for w in (self.conv_q, self.conv_k, self.conv_v):
            nn.init.uniform_(w, -bound, bound)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():  # decay rates A in [0.01, 16], as transformers initialises them
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(0.01, 16).log())
        self.norm.reset_parameters()


def gated_delta_rule_flops(seq_len: int, n_v_heads: int, k_head_dim: int, v_head_dim: int,
                           chunk: int = CHUNK) -> float:
    """Forward FLOPs per token of the chunked delta rule (matmuls only, 2 per multiply-add), per layer.

    Per chunk of C tokens and head: K K^T and Q K^T (2 * C^2 d_k each), the two triangular solves (C^2 (d_v + d_k)),
    the intra-chunk output (2 * C^2 d_v), and the state's read, correction and write (3 * 2 * C d_k d_v).
    """
    c = min(chunk, max(seq_len, 1))
    per_chunk = 4 * c * c * k_head_dim + c * c * (v_head_dim + k_head_dim) + 2 * c * c * v_head_dim
    per_chunk += 6 * c * k_head_dim * v_head_dim
    return n_v_heads * per_chunk / c
