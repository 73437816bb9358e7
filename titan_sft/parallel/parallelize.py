"""Applies parallelism and memory/speed features to a meta-device model, in torchtitan's order:
model converters (float8, ...) -> tensor/sequence parallel (the family's plan) -> expert parallel -> context
parallel (the attention exchange) -> activation checkpointing ->
per-block torch.compile -> FSDP2 fully_shard over the data-parallel ranks (HSDP when dp_replicate > 1).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_sft.compat import (FSDP_INTEGER_PARAMS, PER_PARAM_MESH, allow_unbacked_scalars, checkpoint_wrapper,
                              flex_attention_op, shard_on_mesh)
from titan_sft.config import JobConfig
from titan_sft.constants import DTYPES
from titan_sft.parallel.parallel_dims import moe_fsdp_meshes
from titan_sft.parallel.tensor_parallel import TPPlan, apply_tp, float8_tp_plan
from titan_sft.registry import get_converter


# Attention kernels as the AC policy sees them, per backend: sdpa's aten ops, torch's varlen custom op (and the
# aten kernels it calls), flash-attn's custom ops (registered by flash-attn >= 2.6 under its own namespace).
ATTENTION_SAVE_OPS = {
    "sdpa": ["aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default",
             "aten._scaled_dot_product_cudnn_attention.default",
             "aten._scaled_dot_product_attention_math.default",
             "aten._scaled_dot_product_flash_attention_for_cpu.default"],
    "varlen": ["torch_attn._varlen_attn.default", "aten._flash_attention_forward.default",
               "aten._cudnn_attention_forward.default"],
    "flash_varlen": ["flash_attn._flash_attn_varlen_forward.default", "flash_attn._flash_attn_forward.default"],
}


def _save_ops() -> set:
    """Ops whose outputs selective AC keeps: matmuls, attention kernels (every variant that exists in this
    torch build, and flash-attn's where installed), reductions feeding float8 scales, and reduce-scatters
    (recomputing them would communicate). Flex attention is a higher-order op, added as such."""
    import importlib.util

    # Custom ops exist only once their module has registered them.
    import torch.nn.attention.varlen  # noqa: F401

    if importlib.util.find_spec("flash_attn") is not None:
        import flash_attn  # noqa: F401
    names = ["aten.mm.default", "aten.linear.default", "aten.addmm.default", "aten.bmm.default",
             *(n for ops in ATTENTION_SAVE_OPS.values() for n in ops),
             "aten._scaled_mm.default", "aten.max.default",
             "_c10d_functional.reduce_scatter_tensor.default",
             # context parallel's exchanges around attention
             "_c10d_functional.all_to_all_single.default", "_c10d_functional.all_gather_into_tensor.default"]
    ops = set()
    for name in names:
        obj = torch.ops
        for part in name.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            ops.add(obj)
    ops.add(flex_attention_op())
    return ops


def selective_checkpoint_context():
    """torchtitan's op-level policy: keep the outputs of matmuls and attention (expensive to redo), recompute the
    rest in backward (norms, RoPE, activations, casts: cheap, and most of the activation memory)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    save = _save_ops()

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(model: nn.Module, mode: str, every_n: int = 2, preserve_rng: bool = False) -> None:
    """'full': recompute every block in backward; 'every_n': every n-th block (0, n, 2n, ...); 'selective':
    every block, recomputing all but the ops of :func:`_save_ops`. ``preserve_rng``: replay the forward's RNG
    state in the recompute (needed when a block draws random numbers, e.g. LoRA dropout)."""
    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if mode == "selective":
            wrapped = checkpoint_wrapper(block, context_fn=selective_checkpoint_context,
                                         preserve_rng_state=preserve_rng)
        elif mode == "full" or (mode == "every_n" and i % every_n == 0):
            wrapped = checkpoint_wrapper(block, preserve_rng_state=preserve_rng)
        else:
            continue
        model.layers.register_module(name, wrapped)


def apply_compile(model: nn.Module) -> None:
    """Compiles each block separately (identical blocks share one compiled graph, and compile time stays short),
    with ``fullgraph=True``: a graph break is a bug to fix, not a silent slowdown. The one planned exception: a
    Gated DeltaNet block (Qwen3.5) breaks around its delta rule, which runs eagerly (``gated_delta_rule``: fla's
    Triton kernels, or the torch path's chunk loop, which a graph would unroll); the projections, conv, norms and
    MLP around it compile.

    Routed experts have data-dependent sizes (rows per expert, the all-to-all's splits under expert parallel);
    ``capture_scalar_outputs`` lets them into the graph as unbacked symbols, so one graph serves every routing."""
    from titan_sft.models.gated_deltanet import GatedDeltaNet

    allow_unbacked_scalars()
    for name, block in list(model.layers.named_children()):
        linear = any(isinstance(m, GatedDeltaNet) for m in block.modules())
        model.layers.register_module(name, torch.compile(block, fullgraph=not linear))


def store_frozen_params(model: nn.Module, dtype: torch.dtype) -> int:
    """Stores the frozen floating-point parameters (LoRA's base model) in ``dtype``; returns how many elements.

    Called with the compute dtype: FSDP casts every parameter to it for forward anyway, so the numbers are the same
    as with fp32 storage, and a frozen parameter has no gradient or optimizer state that would want fp32. It halves
    the base model's memory (Qwen3-8B: 32.8 -> 16.4 GB across the FSDP ranks). FSDP only requires a uniform dtype
    among trainable parameters.
    """
    n = 0
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
            n += p.numel()
    return n


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               experts_mesh: DeviceMesh | None = None, moe_mesh: DeviceMesh | None = None) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, output head).

    The head stays in the root group. The root is not resharded after forward, so the objective, which applies
    the head to the hidden states after ``model(...)`` returns, and a tied embedding both see one unsharded
    tensor, and the head's gradient is reduced with the root's at the end of backward. Under expert parallel
    (``experts_mesh``: the ranks holding the same experts) each block's experts are sharded over that mesh instead:
    their gradients are summed over it, never across the ep ranks that hold other experts. They stay in their
    block's FSDP module (a second parameter group, FSDP2's per-parameter mesh, torch >= 2.13), so no FSDP hook sits
    inside the block and a compiled block has no graph break there; an older torch gets them as FSDP modules of
    their own on the same meshes (same shards and gradient sums; no compile then, ``check_expert_parallel``).
    Under tp (``moe_mesh``) the routers (and shared experts), and the experts
    without ep, are sharded over the data-parallel x tp ranks the same way: every tp rank trains them on its
    own tokens, and the reduce-scatter sums their gradients over tp.
    A pipeline stage is sharded the same way: keeping its blocks gathered between its microbatches' forwards and
    backwards (torchtitan's default under PP) would save their all-gathers but hold the stage's bf16 weights whole
    (Llama-70B's 21-layer pp rank: 36 GB).
    """
    from titan_sft.models.moe import GroupedExperts, Router, SharedExpert

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # integer parameters (NF4 codes) on a torch whose FSDP2 cannot shard them: whole on every rank
    ignored = None if FSDP_INTEGER_PARAMS else {p for p in model.parameters() if not p.is_floating_point()} or None
    experts_mesh = experts_mesh if experts_mesh is not None else moe_mesh
    # One placement (one FSDPMeshInfo) per mesh for every block: FSDP2 requires the same object for a group.
    on_mesh = {id(m): shard_on_mesh(m) for m in (moe_mesh, experts_mesh) if m is not None} if PER_PARAM_MESH else {}
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # The MoE's parameters on their own mesh: (module, mesh) for each router and expert group.
        own = [(m, moe_mesh) for m in block.modules() if isinstance(m, (Router, SharedExpert)) and moe_mesh is not None]
        own += [(m, experts_mesh) for m in block.modules() if isinstance(m, GroupedExperts) and experts_mesh is not None]
        # The last block's params are needed first in backward: keep them gathered after forward.
        reshard = i < n - 1
        placement = None
        if own and PER_PARAM_MESH:
            meshes = {p: on_mesh[id(m_mesh)] for m, m_mesh in own for p in m.parameters()}
            placement = lambda p, meshes=meshes: meshes.get(p)  # noqa: E731
        elif own:
            # torch < 2.13: each router and expert group is an FSDP module of its own on its mesh (torchtitan's
            # layout before per-parameter meshes). Same shards, same sums; the block's FSDP module holds the rest.
            for m, m_mesh in own:
                fully_shard(m, mesh=m_mesh, mp_policy=mp, reshard_after_forward=reshard, ignored_params=ignored)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard, shard_placement_fn=placement,
                    ignored_params=ignored)
    fully_shard(model, mesh=mesh, mp_policy=mp, ignored_params=ignored)
    # Sum, not average, across ranks: the loss is already normalised by global token counts (recipe item 10).
    # Both settings are per FSDP module.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def check_trainable_set(model: nn.Module, expected: set[str], converters: list[str]) -> None:
    """Stops the run when the converters together left another set of trainable parameters than LoRA alone would
    (a conversion that renamed, froze or unfroze one): the optimizer, checkpoints and adapters all key on it."""
    from titan_sft.config import ConfigError

    actual = {n for n, p in model.named_parameters() if p.requires_grad}
    if actual != expected:
        lost, extra = sorted(expected - actual), sorted(actual - expected)
        raise ConfigError(f"config key 'model.converters': {converters} change LoRA's trainable parameters: "
                          f"{len(lost)} missing (first: {lost[:1]}), {len(extra)} unexpected (first: {extra[:1]})")


def parallelize_transformer(model: nn.Module, mesh: DeviceMesh, cfg: JobConfig, device: torch.device,
                            tp_plan: TPPlan) -> nn.Module:
    """Applies the layout and features the config selects to ``model`` (in place).

    Args:
        mesh: the run's (pp, dp_replicate, dp_shard_mod_ep, cp, ep, tp) mesh (``ParallelDims.build_mesh``).
        tp_plan: the family's tensor-parallel plan, applied when the tp dimension is larger than 1.
    """
    t = cfg.training
    # Converters first (as torchtitan does): a converted linear (float8, LoRA) is still an nn.Linear, so the TP
    # styles shard it; converting after TP would drop the TP hooks with the replaced module.
    converters = (["float8"] if t.float8 else []) + list(cfg.model.converters)
    expected = None
    if "lora" in converters and len(converters) > 1:  # what LoRA alone leaves trainable (a meta copy: no memory)
        reference = copy.deepcopy(model)
        get_converter("lora")(reference, cfg, device)
        expected = {n for n, p in reference.named_parameters() if p.requires_grad}
    for name in converters:
        get_converter(name)(model, cfg, device)
    if expected is not None:
        check_trainable_set(model, expected, converters)
    if t.param_dtype == "bfloat16":
        store_frozen_params(model, torch.bfloat16)
    if mesh["tp"].size() > 1:
        if t.float8 and t.float8_backend == "torchao" and t.float8_recipe == "tensorwise" and device.type == "cuda":
            tp_plan = float8_tp_plan(tp_plan, next(iter(model.layers.values())))
        apply_tp(model, mesh["tp"], tp_plan)
    if mesh["ep"].size() > 1:
        from titan_sft.parallel.expert_parallel import apply_expert_parallel

        apply_expert_parallel(model, mesh["ep"])
    if mesh["cp"].size() > 1:
        from titan_sft.parallel.context_parallel import apply_context_parallel

        apply_context_parallel(model, mesh["cp"], cfg.parallelism.cp_mode)
    # Whole-block recompute (full, every_n) around a compiled block under tp: compiled the other way round, torch
    # 2.13's AOTAutograd tries to save the DTensors' DeviceMesh for backward and fails at step 1. The compiled
    # forward then runs again in backward, as eager full AC reruns the block. Selective AC needs the op-level
    # policy inside the compiled graph, and traces there.
    compile_first = t.compile and mesh["tp"].size() > 1 and t.activation_checkpoint in ("full", "every_n")
    if compile_first:
        apply_compile(model)
    if t.activation_checkpoint != "none":
        dropout = "lora" in cfg.model.converters and cfg.lora.dropout > 0
        apply_activation_checkpointing(model, t.activation_checkpoint, t.ac_every_n, preserve_rng=dropout)
    if t.compile and not compile_first:
        apply_compile(model)
    moe_mesh = experts_mesh = None
    if model.args.n_experts:
        moe_mesh, experts_mesh = moe_fsdp_meshes(mesh)
    apply_fsdp(model, mesh["dp_replicate", "dp_shard_cp"], DTYPES[t.param_dtype], DTYPES[t.reduce_dtype], experts_mesh,
               moe_mesh)
    if experts_mesh is not None and mesh["tp"].size() > 1:  # each tp rank's experts saw its own tokens
        from titan_sft.models.moe import GroupedExperts

        model.tp_summed_params = ([p for m in model.modules() if isinstance(m, GroupedExperts)
                                   for p in m.parameters() if p.requires_grad], mesh["tp"].get_group())
    return model
