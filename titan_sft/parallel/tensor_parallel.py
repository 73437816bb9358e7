"""Tensor + sequence parallel for the shared decoder (Megatron-style, as torchtitan does it).

Between blocks the residual stream is split along the sequence (sequence parallel): every norm runs on its
slice of the tokens. Entering attention or the MLP the slices are all-gathered; q/k/v and gate/up are split by
output (column-wise: each rank computes its own heads), o and down by input (row-wise), whose partial sums are
reduce-scattered back to sequence slices. The embedding and the output head are split along the vocabulary; the
loss then runs on vocab slices (``titan_sft.loss.vocab_parallel_cross_entropy_sum``). Qwen3's per-head q/k norms
keep a replicated weight and see the local heads (sharded on the head dimension); their weight gradients are
partial sums, reduced across the tp ranks.

A routed mixture of experts (``models.moe.MoE``) works token by token, so under tp it runs on this rank's
sequence slice as it stands: no all-gather on entry, no slicing on exit, and no expert FLOP repeated over the tp
ranks (torchtitan's etp = 1 splits the tokens over tp the same way). Its router and experts are plain tensors,
equal on the tp ranks; each rank's gradients are those of its own tokens, and FSDP sums them over the tp ranks
too (parallelize.apply_fsdp shards the MoE's parameters over the data-parallel x tp ranks), as over cp ranks. The
load-balancing loss needs the whole rows' router statistics: the objective sums them over the tp ranks
(``Objective.split_router_tokens``). The experts are split across ranks by expert parallel
(``parallel.expert_parallel``); each tp rank sends its own tokens to its ep peers.

Gated DeltaNet blocks (Qwen3.5's linear attention) shard heads the same way: the q, k, v, z, b and a
projections column-wise, each rank's depthwise conv channels, decay rates and biases are the matching rows
(``LinearAttentionInput``), the per-head gated norm keeps a replicated weight (``HeadShardedNorm``), and
``out_proj`` is row-wise. Key heads are split contiguously and each serves consecutive value heads, so a key head
and its value heads stay on one rank when tp divides the key heads.

A family's plan is ``(root_plan, block_plan)``: ``{submodule FQN: ParallelStyle}`` for the model and for every
transformer block; ``families/<name>.py`` builds its own from :func:`decoder_tp_plan`.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

TPPlan = tuple[dict, dict]


class VocabParallelEmbedding(RowwiseParallel):
    """The embedding split along the vocabulary, its output reduce-scattered to sequence slices and handed on as a
    copy of the local slice, not the view ``to_local()`` returns.

    Why the copy: in torch 2.13 a compiled block whose input is such a view gets a wrong input gradient
    (AOTAutograd treats the input as a view of the DTensor's storage, and the gradient skips the reduce-scatter's
    backward). Measured on the llama3 debug model at tp 2 with compiled blocks: the embedding's gradient off by
    more than its own size, the grad norm 41.1 against 43.7. The copy is one [B, T/tp, dim] tensor per forward."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        return out.clone() if use_local_output else out


def decoder_tp_plan(qk_norm: bool) -> TPPlan:
    """The plan of the shared decoder; ``qk_norm`` adds Qwen3's per-head norms."""
    root = {
        "tok_embeddings": VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        # Only the plain call form applies the head as a module (logits gathered); training takes its weight.
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    block = {
        "attention_norm": SequenceParallel(),
        "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "ffn_norm": SequenceParallel(),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if qk_norm:  # [b, t, local heads, head_dim]: sharded on dim 2, weight replicated
        block["attention.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        block["attention.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return root, block


def token_parallel_moe_style() -> PrepareModuleInput:
    """The style of a routed-experts MLP under tp (see the module docstring): this rank's sequence slice goes in
    as a plain tensor; the output (the MoE's hidden states, then its router statistics) is this slice's."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True)


class LinearAttentionInput(PrepareModuleInput):
    """A Gated DeltaNet mixer's entry: the sequence slices are all-gathered (as for attention), and the mixer's own
    per-channel and per-head parameters (conv weights, ``A_log``, ``dt_bias``) become DTensors sharded on their
    first dimension, so each rank holds the rows of its heads (the mixer computes with their local parts)."""

    def __init__(self):
        super().__init__(input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"):
            param = getattr(module, name)
            local = param.chunk(device_mesh.size(), dim=0)[device_mesh.get_local_rank()]
            module.register_parameter(name, nn.Parameter(
                DTensor.from_local(local, device_mesh, [Shard(0)], run_check=False), param.requires_grad))
        return super()._apply(module, device_mesh)


class HeadShardedNorm(SequenceParallel):
    """A norm over each of this rank's heads with a replicated weight, taking several inputs (the gated norm's x
    and z, heads on dim 2): all enter as DTensors sharded on the head dimension, so the weight's gradient, a
    partial sum over the local heads, is all-reduced across the tp ranks."""

    def __init__(self):
        super().__init__(sequence_dim=2, use_local_output=True)

    @staticmethod
    def _prepare_inputs_fn(sharding, mod, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, sharding, run_check=False) for x in inputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._replicate_module_fn,
            lambda mod, inputs, mesh: self._prepare_inputs_fn(self.sequence_sharding, mod, inputs, mesh),
            lambda mod, outputs, mesh: outputs.to_local())


def linear_attention_plan() -> dict:
    """The tp plan of a Gated DeltaNet block's mixer (the rest of the block follows the decoder's plan)."""
    plan = {"attention": LinearAttentionInput(), "attention.norm": HeadShardedNorm(),
            "attention.out_proj": RowwiseParallel(output_layouts=Shard(1))}
    plan.update({f"attention.in_proj_{p}": ColwiseParallel() for p in "qkvzba"})
    return plan


def block_plan_for(block: nn.Module, block_plan: dict) -> dict:
    """``block_plan`` for this block: a block whose MLP is a routed mixture of experts gets
    :func:`token_parallel_moe_style` in place of the dense MLP's entries; a Gated DeltaNet block gets
    :func:`linear_attention_plan` in place of attention's; a shared expert (Qwen3.5-MoE) runs, like the routed
    ones, on this rank's sequence slice."""
    from titan_sft.models.moe import MoE

    plan = dict(block_plan)
    if getattr(block, "linear", False):
        plan = {k: v for k, v in plan.items() if k != "attention" and not k.startswith("attention.")}
        plan.update(linear_attention_plan())
    if not isinstance(getattr(block, "feed_forward", None), MoE):
        return plan
    plan = {k: v for k, v in plan.items() if k != "feed_forward" and not k.startswith("feed_forward.")}
    plan["feed_forward"] = token_parallel_moe_style()
    return plan


def float8_tp_plan(plan: TPPlan, block: nn.Module) -> TPPlan:
    """``plan`` with torchao's float8 styles for the block linears that were converted to float8 (tensorwise).

    The column-wise projections then receive their input cast to float8 before the sequence all-gather (half the
    bytes of bf16, one cast instead of one per projection), and the gradients flowing back through the row-wise
    projections are cast before their collectives. Only tensor-wise scaling allows it (one scale per tensor
    survives a gather); NCCL only (gloo cannot all-gather float8). ``block`` is a converted transformer block: a
    projection left in high precision (dims not multiples of 16) keeps its plain style, and an input preparation
    turns float8 only when every column-wise projection it feeds is float8.
    """
    import torch
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    root, block_plan = plan

    def is_f8(fqn: str) -> bool:
        return isinstance(block.get_submodule(fqn), Float8Linear)

    out = {}
    for fqn, style in block_plan.items():
        if isinstance(style, ColwiseParallel) and is_f8(fqn):
            out[fqn] = Float8ColwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                             use_local_output=style.use_local_output)
        elif isinstance(style, RowwiseParallel) and is_f8(fqn):
            out[fqn] = Float8RowwiseParallel(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
                                             use_local_output=style.use_local_output)
        elif isinstance(style, PrepareModuleInput):
            fed = [n for n, st in block_plan.items() if n.startswith(fqn + ".") and isinstance(st, ColwiseParallel)]
            if fed and all(is_f8(n) for n in fed):
                out[fqn] = PrepareFloat8ModuleInput(
                    input_layouts=style.input_layouts, desired_input_layouts=style.desired_input_layouts,
                    use_local_output=style.use_local_output, float8_dtype=torch.float8_e4m3fn,
                    fwd_config_submodule_fqn=fed[0][len(fqn) + 1:])
            else:
                out[fqn] = style
        else:
            out[fqn] = style
    return root, out


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: TPPlan) -> None:
    """Applies ``plan`` to ``model`` (on the meta device) and re-ties a shared embedding/head."""
    root_plan, block_plan = plan
    # a pipeline stage holds some of the root's parts (the others are None)
    parallelize_module(model, tp_mesh, {k: v for k, v in root_plan.items() if getattr(model, k) is not None})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan_for(block, block_plan))
    if model.args.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # both are Shard(0) on the vocabulary: one tensor again
        model.output.weight = model.tok_embeddings.weight


def describe_style(fqn: str, style, moe: bool = False) -> str:
    """A short human description of a ParallelStyle for the dry run (``moe``: the style of a routed-experts MLP)."""
    if fqn == "tok_embeddings":
        return "vocab-parallel embedding, output reduce-scattered to sequence slices"
    if fqn == "output":
        return "vocab-parallel head (the loss runs on vocab slices: loss parallel)"
    f8 = " (float8 all-gather)" if type(style).__name__.startswith(("Float8", "PrepareFloat8")) else ""
    if isinstance(style, ColwiseParallel):
        return "column-wise (each rank its own output features / heads)" + f8
    if isinstance(style, RowwiseParallel):
        return "row-wise, partial sums reduce-scattered to sequence slices" + f8
    if isinstance(style, SequenceParallel):
        return "sequence parallel" if style.sequence_sharding[0].dim == 1 else "replicated weight on the local heads"
    if moe:
        return ("routed experts on this rank's sequence slice (tokens split over tp, no expert FLOP repeated; "
                "their gradients summed over tp by FSDP)")
    if isinstance(style, PrepareModuleInput):
        return "all-gathers the sequence slices on entry" + f8
    return type(style).__name__


def describe_plan(plan: TPPlan, moe_layers: list[int] = ()) -> list[str]:
    """One line per planned submodule; ``moe_layers``: the layers whose MLP is routed experts."""
    root, block = plan
    lines = [f"  {fqn}: {describe_style(fqn, s)}" for fqn, s in root.items()]
    lines += [f"  layers.*.{fqn}: {describe_style(fqn, s)}" for fqn, s in block.items()]
    if moe_layers:
        lines.append(f"  layers.*.feed_forward of the {len(moe_layers)} MoE layers (the entries above are the dense "
                     f"layers'): {describe_style('feed_forward', token_parallel_moe_style(), moe=True)}")
    return lines
