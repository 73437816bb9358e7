"""Mixture-of-experts feed-forward: a softmax top-k router over SwiGLU experts stored stacked.

Shared by every family with routed experts (Qwen3-MoE first). The semantics are transformers'
``Qwen3MoeSparseMoeBlock``: router logits ``x @ gate.T``, probabilities softmax(logits) in fp32, the top k of them
(renormalised to sum 1 with ``norm_topk_prob``) cast back to the compute dtype weight each chosen expert's
output. Dropless: every token reaches its k experts, there is no capacity factor.

Tokens are permuted, not dispatched through a dense [tokens, n_experts] tensor: the (token, slot) pairs are
sorted by expert, each expert's rows are contiguous, and the outputs are scattered back with ``index_add_``.
The experts run as one grouped GEMM (``torch._grouped_mm``, CUDA bf16 and, in torch >= 2.9, CPU bf16/fp32)
or as a loop over experts (the reference implementation, and the fallback where grouped GEMM is unavailable).

Each forward returns its router statistics (:class:`RouterStats`) beside its output, so a training objective can add the load-balancing
loss (:func:`load_balancing_loss`, HF's ``load_balancing_loss_func``) without the model knowing of losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_sft.compat import grouped_mm, has_grouped_mm


@dataclass
class RouterStats:
    """What one MoE layer's router did in a forward: top-k selections per expert (float [E], no grad), the sum of
    the router probabilities per expert over the tokens (fp32 [E], differentiable), the sum over tokens of the
    squared log-partition of the router logits (for the z-loss; fp32 scalar, differentiable) and the token count."""

    counts: torch.Tensor
    prob_sum: torch.Tensor
    z_sum: torch.Tensor
    n_tokens: int


def load_balancing_loss(stats: list[RouterStats], n_experts: int) -> torch.Tensor:
    """The Switch-Transformer auxiliary loss as transformers computes it over all MoE layers of a forward:
    ``n_experts * sum_e (selections_e / rows) * (prob_sum_e / rows)``, with selections, probabilities and rows
    summed over the layers (HF concatenates the layers' router logits)."""
    counts = torch.stack([s.counts for s in stats]).sum(0)
    probs = torch.stack([s.prob_sum for s in stats]).sum(0)
    rows = sum(s.n_tokens for s in stats)
    return n_experts * torch.sum(counts / rows * (probs / rows))


def router_z_loss(stats: list[RouterStats]) -> torch.Tensor:
    """ST-MoE's router z-loss: per MoE layer the mean over tokens of logsumexp(router logits)^2, summed over the
    layers (it keeps router logits small, so their softmax stays stable in low precision)."""
    return sum(s.z_sum / s.n_tokens for s in stats)


def routing_bias_update(counts: torch.Tensor, rate: float) -> torch.Tensor:
    """The auxiliary-loss-free balancing step of one MoE layer from its step's selections per expert ``counts``
    [E] (all ranks' and microbatches'): ``rate`` towards every expert below the mean load, away from every one
    above (``rate * sign(mean - count)``), centred to sum 0 (torchtitan's form of DeepSeek-V3's rule; only
    differences between biases change the top k)."""
    delta = rate * torch.sign(counts.mean() - counts)
    return delta - delta.mean()


def grouped_mm_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs for these operands (CPU: bf16/fp32; CUDA: bf16 on SM >= 9.0).

    Under torch.compile only bf16 does: the op's fake-tensor kernel, which tracing runs, accepts nothing else (it
    mirrors the CUDA kernel's checks), so a compiled fp32 block runs the experts as the loop."""
    if not has_grouped_mm():
        return False
    if device.type == "cuda":
        return dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] >= 9
    if torch.compiler.is_compiling():
        return device.type == "cpu" and dtype == torch.bfloat16
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float32)


class Router(nn.Module):
    """``gate`` (the router's linear) and, with ``bias``, the auxiliary-loss-free balancing bias ``expert_bias``
    (fp32 [E], a buffer: no gradient trains it, the objective moves it after every step towards the under-loaded
    experts; DeepSeek-V3's scheme as torchtitan runs it on softmax routers). The bias only decides which experts a
    token goes to (the top k of probabilities + bias); the chosen experts are weighted by their probabilities."""

    def __init__(self, dim: int, n_experts: int, top_k: int, norm_topk_prob: bool, frozen: bool = False,
                 bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.gate.weight.requires_grad_(not frozen)  # a frozen router keeps the base model's routing
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.register_buffer("expert_bias", torch.zeros(n_experts) if bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (probabilities fp32 [N, E], top-k weights [N, k] in x's dtype, top-k experts [N, k],
        sum over tokens of logsumexp(logits)^2 in fp32)."""
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        if self.expert_bias is None:
            top_p, top_i = torch.topk(probs, self.top_k, dim=-1)
        else:
            top_i = torch.topk(probs + self.expert_bias.float(), self.top_k, dim=-1).indices
            top_p = probs.gather(-1, top_i)
        if self.norm_topk_prob:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        z_sum = torch.logsumexp(logits.float(), dim=-1).square().sum()
        return probs, top_p.to(logits.dtype), top_i, z_sum


def local(w: torch.Tensor) -> torch.Tensor:
    """This rank's part of a weight (the experts it holds under expert parallel)."""
    return w.to_local() if isinstance(w, DTensor) else w


def expert_matmul(counts: torch.Tensor, impl: str):
    """``mm(x, w)``: rows of x grouped by expert (``counts`` per expert, in order) times w[e] transposed, w
    [E, out, in]; as one grouped GEMM, or one expert at a time (the reference; it syncs ``counts`` to the host)."""
    if impl == "grouped":
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        return lambda a, w: grouped_mm(a, w.transpose(-2, -1), offs)
    sizes = counts.tolist()

    def loop(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.cat([F.linear(xe, w[e]) for e, xe in enumerate(torch.split(a, sizes))])
    return loop


def pad_groups(x: torch.Tensor, counts: torch.Tensor, align: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of ``x`` grouped by expert (``counts`` per expert, in order) moved so that every group starts and ends
    at a multiple of ``align`` rows, zero rows between: (padded rows, padded counts, where each row of ``x`` went).
    The padded size is static, ``x``'s rows plus ``E * (align - 1)`` rounded up to ``align`` (the last group takes
    the slack), so a compiled graph has no new data-dependent shape. float8 grouped GEMMs need aligned groups."""
    m, e = x.shape[0], counts.shape[0]
    total = -(-(m + e * (align - 1)) // align) * align
    padded = (counts + align - 1) // align * align
    padded = torch.cat([padded[:-1], padded[-1:] + (total - padded.sum())])
    start, src_start = torch.cumsum(padded, 0) - padded, torch.cumsum(counts, 0) - counts
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=m)
    rows = torch.arange(m, device=x.device) - src_start[expert] + start[expert]
    return x.new_zeros(total, x.shape[1]).index_copy(0, rows, x), padded, rows


class GroupedExperts(nn.Module):
    """n_experts SwiGLU experts, weights stacked [E, out, in] as nn.Linear stores each (w1 gate, w3 up, w2 down).

    ``row_align``: the grouped GEMM's rows per expert are padded to a multiple of it (1: none; float8's grouped
    GEMM sets 16, :func:`pad_groups`)."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int):
        super().__init__()
        self.n_experts = n_experts
        self.row_align = 1
        self.w1 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, ffn_dim, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
        """x [M, dim] with each expert's rows contiguous, in expert order; counts long [E_here] (rows per expert).

        Under expert parallel the weights are sharded by expert (DTensors): this rank computes with its own
        ``E / ep`` experts, and ``counts`` are theirs."""
        rows = None
        if impl == "grouped" and self.row_align > 1:
            x, counts, rows = pad_groups(x, counts, self.row_align)
        mm = expert_matmul(counts, impl)
        y = self.project(F.silu(self.project(x, "w1", mm)) * self.project(x, "w3", mm), "w2", mm)
        return y if rows is None else y[rows]

    def project(self, x: torch.Tensor, name: str, mm) -> torch.Tensor:
        """Each expert's rows of ``x`` times that expert's ``name`` weight (transposed); a converter (LoRA on
        the experts) extends this."""
        return mm(x, self.weight(name))

    def weight(self, name: str) -> torch.Tensor:
        """The stacked weight ``name`` as this rank computes with it (a converter may wrap it: float8)."""
        return local(getattr(self, name))

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.w1, std=std, a=-3 * std, b=3 * std)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, std=out_std, a=-3 * out_std, b=3 * out_std)


class SharedExpert(nn.Module):
    """Qwen3.5-MoE's shared expert: a SwiGLU MLP every token passes, scaled by sigmoid(gate(x)) (transformers'
    ``shared_expert`` and ``shared_expert_gate``)."""

    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn_dim, bias=False)  # gate_proj
        self.w2 = nn.Linear(ffn_dim, dim, bias=False)  # down_proj
        self.w3 = nn.Linear(dim, ffn_dim, bias=False)  # up_proj
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.gate(x)) * self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        for lin, s in ((self.w1, std), (self.gate, std), (self.w2, out_std), (self.w3, out_std)):
            nn.init.trunc_normal_(lin.weight, std=s, a=-3 * s, b=3 * s)


class MoE(nn.Module):
    """Router + experts (+ a shared expert where ``shared_ffn_dim``); ``forward(x [B, T, dim]) -> (out [B, T, dim],
    selections per expert [E], router probability sums [E], z-loss sum)``: plain tensors, so a compiled block
    returns them (:class:`RouterStats` is built by the caller)."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int, norm_topk_prob: bool,
                 impl: str = "auto", freeze_router: bool = False, router_bias: bool = False, shared_ffn_dim: int = 0):
        super().__init__()
        self.router = Router(dim, n_experts, top_k, norm_topk_prob, freeze_router, router_bias)
        self.experts = GroupedExperts(dim, ffn_dim, n_experts)
        self.shared_expert = SharedExpert(dim, shared_ffn_dim) if shared_ffn_dim else None
        self.n_experts, self.top_k, self.impl = n_experts, top_k, impl
        # Expert parallel replaces this (parallel.expert_parallel): (experts, rows sorted by expert, rows per
        # expert [E], impl) -> expert outputs in the same order, computed wherever the experts live.
        self.dispatch = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, top_p, top_i, z_sum = self.router(flat)
        expert_of = top_i.reshape(-1)  # [N * k]: the expert of each (token, slot) pair
        order = torch.argsort(expert_of, stable=True)
        token_of = order // self.top_k
        # A fixed-size histogram (bincount's length depends on the data, which a compiled graph cannot have).
        counts = torch.zeros(self.n_experts, dtype=torch.long, device=x.device).scatter_add_(
            0, expert_of, torch.ones_like(expert_of))
        impl = self.impl
        if impl == "auto":
            impl = "grouped" if grouped_mm_available(x.dtype, x.device) else "loop"
        run = self.dispatch or (lambda experts, rows, n, how: experts(rows, n, how))
        y = run(self.experts, flat[token_of], counts, impl) * top_p.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, token_of, y.to(flat.dtype)).reshape(shape)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out, counts.detach().float(), probs.sum(0), z_sum

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.gate.weight, std=std, a=-3 * std, b=3 * std)
        if self.router.expert_bias is not None:
            self.router.expert_bias.zero_()
        self.experts.init_weights(std, out_std)
        if self.shared_expert is not None:
            self.shared_expert.init_weights(std, out_std)


def moe_layer_ids(n_layers: int, n_experts: int, decoder_sparse_step: int, mlp_only_layers) -> list[int]:
    """The layers with experts, by transformers' rule: every ``decoder_sparse_step``-th layer, except those in
    ``mlp_only_layers`` (which keep a dense SwiGLU MLP)."""
    if n_experts <= 0:
        return []
    return [i for i in range(n_layers) if i not in set(mlp_only_layers) and (i + 1) % decoder_sparse_step == 0]

