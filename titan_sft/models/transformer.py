"""The decoder shared by Qwen3 and Llama 3, in plain PyTorch.

The two families differ only in numbers and two switches: Qwen3 normalises queries and keys per head
(``qk_norm``) before RoPE; Llama 3.1 scales RoPE frequencies (``rope_scaling``; Qwen3's YaRN context extension is
the same switch). Everything else (pre-norm
blocks, GQA attention, SwiGLU MLP, no biases, RMSNorm computed in fp32) is the same, so one file serves both and
reads in one pass. With ``n_experts > 0`` (Qwen3-MoE) the MLP of the layers ``moe_layer_ids`` picks is a routed
mixture of experts (``models.moe``); such a block returns its router statistics beside the hidden states, and
the model keeps the forward's in ``router_stats`` for the objective's load-balancing loss. Parameter names follow torchtitan; ``hf_adapter`` maps them to HF names.

Build on the meta device, then ``to_empty`` and :meth:`Transformer.init_weights` (or load weights), so large
flavors never materialise whole on one host.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from titan_sft.models.attention import AttentionBackend, AttentionMask, segment_ids
from titan_sft.models.gated_deltanet import GatedDeltaNet
from titan_sft.models.moe import MoE, Router, RouterStats, moe_layer_ids


@dataclass
class RopeScaling:
    """RoPE frequency scaling as HF configs write it: Llama 3.1's ("llama3") or YaRN ("yarn": Qwen3's context
    extension, e.g. factor 4 over 32768 original positions for 131072)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    beta_fast: float = 32.0  # yarn: rotations above which frequencies are kept (extrapolated)
    beta_slow: float = 1.0  # yarn: rotations below which frequencies are divided by factor (interpolated)
    attention_factor: float | None = None  # yarn: cos/sin scale; None: from factor (and mscale, mscale_all_dim)
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(args: "TransformerArgs") -> float:
    """The factor YaRN scales cos and sin by (1.0 for every other RoPE), as transformers computes it."""
    s = args.rope_scaling
    if s is None or s.rope_type != "yarn":
        return 1.0
    if s.attention_factor is not None:
        return s.attention_factor
    if s.mscale and s.mscale_all_dim:
        return float(_yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim))
    return _yarn_mscale(s.factor)


@dataclass
class TransformerArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 40960
    # Mixture of experts (Qwen3-MoE); n_experts = 0 is a dense model.
    n_experts: int = 0
    n_experts_per_tok: int = 0  # top k
    moe_ffn_dim: int = 0  # each expert's hidden size (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum 1
    decoder_sparse_step: int = 1  # every n-th layer has experts
    mlp_only_layers: list[int] = field(default_factory=list)  # layers that keep a dense MLP of ffn_dim
    router_aux_loss_coef: float = 0.0  # the HF config's load-balancing coefficient (the objective applies it)
    shared_expert_ffn_dim: int = 0  # Qwen3.5-MoE: a shared SwiGLU expert of this size beside the routed ones, sigmoid-gated
    # Qwen3.5's hybrid decoder: layer_types[i] is "full_attention" or "linear_attention" (Gated DeltaNet); empty:
    # every layer is full attention.
    layer_types: list[str] = field(default_factory=list)
    attn_output_gate: bool = False  # full attention's output times sigmoid(gate), the gate from the q projection
    partial_rotary_factor: float = 1.0  # RoPE rotates the first head_dim * factor dimensions of q and k
    norm_offset: bool = False  # RMSNorms scale by (1 + weight), weights start at 0 (Qwen3.5)
    linear_n_k_heads: int = 0  # Gated DeltaNet: key (and query) heads
    linear_n_v_heads: int = 0  # Gated DeltaNet: value heads (a multiple of the key heads)
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_conv_kernel: int = 4  # depthwise causal conv over q, k and v
    # Runtime choices, not architecture: set from [model] config.
    attention: str = "sdpa"
    causal: bool = True
    moe_impl: str = "auto"  # experts as one grouped GEMM ("grouped"), a loop ("loop"), or grouped where it runs
    freeze_router: bool = False  # routers' weights do not train
    router_bias: bool = False  # a routing bias per MoE layer (aux-loss-free balancing): picks experts, weights none
    extra: dict = field(default_factory=dict)  # HF config fields we carry through export untouched

    def moe_layers(self) -> list[int]:
        return moe_layer_ids(self.n_layers, self.n_experts, self.decoder_sparse_step, self.mlp_only_layers)

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full_attention"

    def linear_layers(self) -> list[int]:
        """Indices of the Gated DeltaNet layers."""
        return [i for i in range(self.n_layers) if self.layer_type(i) == "linear_attention"]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_params(self, active: bool = False) -> int:
        """Parameter count, counting a tied embedding once; ``active``: only the k experts a token uses."""
        q_out = self.n_heads * self.head_dim * (2 if self.attn_output_gate else 1)
        attn = self.dim * (q_out + self.head_dim * (self.n_heads + 2 * self.n_kv_heads))
        attn += 2 * self.head_dim if self.qk_norm else 0
        key, value = self.linear_n_k_heads * self.linear_k_head_dim, self.linear_n_v_heads * self.linear_v_head_dim
        linear = (self.dim * (2 * key + 2 * value + 2 * self.linear_n_v_heads) + value * self.dim
                  + (2 * key + value) * self.linear_conv_kernel + 2 * self.linear_n_v_heads + self.linear_v_head_dim)
        n_linear = len(self.linear_layers())
        mixers = (self.n_layers - n_linear) * attn + n_linear * linear
        n_moe = len(self.moe_layers())
        experts = self.n_experts_per_tok if active else self.n_experts
        moe = self.dim * self.n_experts + 3 * self.dim * self.moe_ffn_dim * experts
        if self.shared_expert_ffn_dim:
            moe += 3 * self.dim * self.shared_expert_ffn_dim + self.dim
        mlp = (self.n_layers - n_moe) * 3 * self.dim * self.ffn_dim + n_moe * moe
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return self.vocab_size * self.dim + mixers + self.n_layers * 2 * self.dim + mlp + self.dim + head


def rope_inv_freq(args: TransformerArgs, device: torch.device | None = None) -> torch.Tensor:
    """Inverse RoPE frequencies [head_dim / 2] in fp32, computed exactly as HF does (with llama3 or yarn scaling)."""
    dim = args.rotary_dim
    exps = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
    inv_freq = 1.0 / (args.rope_theta**exps)
    s = args.rope_scaling
    if s is None:
        return inv_freq
    if s.rope_type == "yarn":
        return _yarn_inv_freq(args, device)
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(args: "TransformerArgs", device) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the original context are
    divided by ``factor``, those above ``beta_fast`` kept, with a linear ramp over the dimensions in between."""
    s, dim, base = args.rope_scaling, args.head_dim, args.rope_theta

    def correction_dim(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (unchanged frequency), 0: interpolate (divided by factor)
    return (1.0 / (s.factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 scale: float = 1.0) -> tuple[torch.Tensor, ...]:
    """cos, sin [B, 1, T, head_dim] for integer positions [B, T] (fp32 math, times YaRN's ``scale``, cast like HF)."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype).unsqueeze(1), sin.to(dtype).unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates halves (the HF layout, so checkpoints need no permutation). x: [B, H, T, D]; a cos/sin narrower
    than D (partial RoPE) rotates the first dimensions and passes the rest through."""
    if cos.shape[-1] < x.shape[-1]:
        rot, rest = x.split([cos.shape[-1], x.shape[-1] - cos.shape[-1]], dim=-1)
        return torch.cat((apply_rope(rot, cos, sin), rest), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class RMSNorm(nn.Module):
    """RMSNorm in fp32, cast back before the weight (as HF does, so bf16 runs round identically).

    ``offset`` (Qwen3.5): the scale is ``1 + weight``, weights start at 0, and the product is taken in fp32 before
    the cast, as transformers' zero-centred norm does."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def reset_parameters(self) -> None:
        (nn.init.zeros_ if self.offset else nn.init.ones_)(self.weight)


class SelfAttention(nn.Module):
    def __init__(self, args: TransformerArgs, backend: AttentionBackend):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.output_gate = args.attn_output_gate
        # With an output gate each head's rows are [query | gate] (transformers' layout), so a column shard of wq
        # holds whole heads.
        self.wq = nn.Linear(args.dim, args.n_heads * args.head_dim * (2 if self.output_gate else 1), bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.norm_eps, args.norm_offset) if args.qk_norm else None
        self.backend = backend

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim * (2 if self.output_gate else 1))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.backend(q, k, v, mask).transpose(1, 2).reshape(b, t, -1)
        if self.output_gate:
            out = out * torch.sigmoid(gate.reshape(b, t, -1))
        return self.wo(out)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate_proj
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down_proj
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: a token mixer (full attention, or Gated DeltaNet where ``args.layer_types`` says
    ``linear_attention``) and an MLP (dense SwiGLU, or routed experts, with a sigmoid-gated shared expert where
    ``args.shared_expert_ffn_dim`` is set: ``models.moe``)."""

    def __init__(self, layer_id: int, args: TransformerArgs, backend: AttentionBackend):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.linear = args.layer_type(layer_id) == "linear_attention"
        self.attention = (GatedDeltaNet(args.dim, args.linear_n_k_heads, args.linear_n_v_heads, args.linear_k_head_dim,
                                        args.linear_v_head_dim, args.linear_conv_kernel, args.norm_eps)
                          if self.linear else SelfAttention(args, backend))
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.moe = layer_id in args.moe_layers()
        self.feed_forward = (MoE(args.dim, args.moe_ffn_dim, args.n_experts, args.n_experts_per_tok,
                                 args.norm_topk_prob, args.moe_impl, args.freeze_router, args.router_bias,
                                 args.shared_expert_ffn_dim)
                             if self.moe else FeedForward(args.dim, args.ffn_dim))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: AttentionMask) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The new hidden states; an MoE block also returns its router's statistics (selections, probability
        sums, z-loss sum)."""
        if self.linear:
            h = x + self.attention(self.attention_norm(x), mask.doc_position, mask.cu_seqlens)
        else:
            h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        if self.moe:
            out, *stats = self.feed_forward(self.ffn_norm(h))
            return h + out, *stats
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self, std: float) -> None:
        # Output projections get a depth-scaled std so the residual stream does not grow with depth.
        out_std = std / math.sqrt(2 * (self.layer_id + 1))
        ff, attn = self.feed_forward, self.attention
        # The order of the draws is fixed (a seed fixes the weights of every existing flavor).
        first = (attn.wq, attn.wk, attn.wv) if not self.linear else ()
        for lin in first + (() if self.moe else (ff.w1,)):
            nn.init.trunc_normal_(lin.weight, std=std, a=-3 * std, b=3 * std)
        for lin in ((attn.wo,) if not self.linear else ()) + (() if self.moe else (ff.w2, ff.w3)):
            nn.init.trunc_normal_(lin.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        if self.moe:
            ff.init_weights(std, out_std)
        if self.linear:
            attn.init_weights(std, out_std)
        norms = [self.attention_norm, self.ffn_norm]
        norms += [] if self.linear else [attn.q_norm, attn.k_norm]
        for norm in norms:
            if norm is not None:
                norm.reset_parameters()


class Transformer(nn.Module):
    """Decoder-only LM (Qwen3 / Llama 3).

    Call forms (all take ``input_ids`` LongTensor [B, T]):

    * ``model(input_ids)`` -> logits [B, T, vocab], ordinary causal attention, positions 0..T-1.
    * ``model(input_ids, cu_seqlens=cu)``: B packed rows of documents whose boundaries in the flattened B * T
      tokens are ``cu`` (int32 [n_docs + 1], 0 ... B * T; every row boundary is a document boundary). Documents
      never attend to each other. Positions default to 0..T-1 in each row (the recipe); pass ``positions``
      [B, T] to reset them per document.
    * ``model(..., hidden_only=True)`` -> final-normed hidden states [B, T, dim], without the output head. This
      is how training calls it: the objective applies ``model.output`` itself (chunk by chunk, or only at the
      positions that carry loss), so [tokens, vocab] logits never exist at once.
    * A pipeline stage (``parallel.pipeline_parallel``) is this model with some parts set to None: without
      ``tok_embeddings`` it takes the previous stage's hidden states [B, T, dim] in place of ``input_ids`` (and
      ``positions``, which give the row length); without ``norm`` it returns its last layer's hidden states.

    Attention is causal, or bidirectional within each document when ``args.causal`` is False.
    """

    def __init__(self, args: TransformerArgs):
        super().__init__()
        self.args = args
        self.backend = AttentionBackend(args.attention, causal=args.causal)
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer index keeps FQNs stable when layers are wrapped (AC, compile, FSDP).
        self.layers = nn.ModuleDict({str(i): TransformerBlock(i, args, self.backend) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps, args.norm_offset)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.has_linear = bool(args.linear_layers())
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.router_stats: list[RouterStats] = []  # the last forward's, one per MoE layer

    def to_empty(self, *, device, recurse: bool = True) -> "Transformer":
        super().to_empty(device=device, recurse=recurse)
        # to_empty gives every parameter slot fresh storage, which unties a shared head; tie it again.
        if self.args.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight
        # The routing biases are state without a random init (the seeded init only fills parameters): zero here,
        # on every rank, until a checkpoint or HF directory overwrites them.
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, Router) and m.expert_bias is not None:
                    m.expert_bias.zero_()
        return self

    def init_parts(self, std: float = 0.02) -> list[tuple[str, Callable[[nn.Module], None]]]:
        """The seeded init as (submodule name, init function of that submodule), in the order the random numbers are
        drawn: running them in turn on one generator is :meth:`init_weights`, and lets a caller materialise one
        submodule at a time (the trainer's sharded init never holds the whole model)."""
        final_std = self.args.dim**-0.5
        parts: list[tuple[str, Callable[[nn.Module], None]]] = [
            ("tok_embeddings", lambda m: nn.init.normal_(m.weight, std=std))]
        parts += [(f"layers.{i}", lambda m: m.init_weights(std)) for i in self.layers]
        parts.append(("norm", lambda m: m.reset_parameters()))
        if not self.args.tie_embeddings:
            parts.append(("output", lambda m: nn.init.trunc_normal_(m.weight, std=final_std, a=-3 * final_std,
                                                                    b=3 * final_std)))
        return parts

    def init_weights(self, std: float = 0.02) -> None:
        """Seeded random init (call after ``to_empty``); the RNG order is fixed, so a seed fixes the weights."""
        for name, init in self.init_parts(std):
            init(self.get_submodule(name))

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cu_seqlens: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        hidden_only: bool = False,
    ) -> torch.Tensor:
        if self.tok_embeddings is not None:
            b, t = input_ids.shape
            h = self.tok_embeddings(input_ids)
        else:  # a later pipeline stage: the input is the previous stage's hidden states, the row's length is positions'
            h, (b, t) = input_ids, (input_ids.shape[0], positions.shape[-1])
        if positions is None:
            positions = self.backend.default_positions(t, input_ids.device)  # 0..T-1 of the (unsharded) row
        cos, sin = rope_cos_sin(positions, rope_inv_freq(self.args, input_ids.device), h.dtype,
                                rope_attention_factor(self.args))
        mask = self.backend.prepare(b, t, input_ids.device, cu_seqlens, h.dtype)
        if self.has_linear and mask.cu_seqlens is not None:  # Gated DeltaNet: where each document starts
            cu, n = mask.cu_seqlens.long(), b * self.backend.row_length(t)
            mask.doc_position = (torch.arange(n, device=cu.device) - cu[:-1][segment_ids(cu, n)]).view(b, -1)
        stats = []
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
            if isinstance(h, tuple):  # an MoE block: (hidden, router statistics)
                h, counts, prob_sum, z_sum = h
                stats.append(RouterStats(counts, prob_sum, z_sum, b * t))
        self.router_stats = stats
        if self.norm is None:  # not the last pipeline stage
            return h
        h = self.norm(h)
        return h if hidden_only else self.output(h)
