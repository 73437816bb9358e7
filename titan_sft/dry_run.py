"""``python -m titan_sft.train --dry-run``: the plan of a run (recipe item 12), without a GPU, the network or
real weights: batch, tokens per step, steps and epochs, LR at key steps, decay mask, checkpoint/export cadence,
the mesh, the tensor-parallel plan and the memory each rank holds for parameters, gradients and optimizer state.

The layout is planned for ``WORLD_SIZE`` ranks (set by torchrun; set it yourself to plan another size), or for
the ranks ``[parallelism]`` names when dp_shard is not -1.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from titan_sft.checkpoint import hook_fires, label
from titan_sft.config import (JobConfig, check_context_parallel, check_expert_parallel, check_layout,
                              check_tensor_parallel, require_data_path)
from titan_sft.hf_io import model_args
from titan_sft.models.attention import resolve_backend
from titan_sft.lr_schedule import Schedule, lr_multiplier, total_steps
from titan_sft.parallel.tensor_parallel import describe_plan
from titan_sft.registry import get_objective, get_train_spec

GIB = 2**30


def planned_world_size(cfg: JobConfig) -> int:
    p = cfg.parallelism
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return p.dp_replicate * max(p.dp_shard, 1) * p.cp * p.tp * p.pp


def linear_attention_bytes(args, dtype_bytes: int, widen_values: bool = False) -> float:
    """Bytes per token that one Gated DeltaNet layer's mixer (Qwen3.5) keeps for backward on the torch delta rule,
    its input excluded: per value head about five fp32 [chunk]-long rows of the chunk's matrices (decay pairs, the
    triangular system, scores), twelve fp32 vectors of d_k and of d_v (q/k/v before and after the conv, their
    normalised and repeated copies, the solved writes, the output, the gated norm), the state carried into each
    chunk (d_k x d_v per 64 tokens); per key head its projections. The coefficients were fitted to autograd's saved
    bytes of the layer (fp32 and bf16, 1-4 key heads, 1-3 value heads per key head, head dims 16-64, packed rows):
    within 0.2% with two or more value heads. ``widen_values``: ring context parallel's pass carries d_k more value
    columns. flash-linear-attention's kernel keeps less (it recomputes the chunk states in backward)."""
    from titan_sft.models.gated_deltanet import CHUNK

    hk, hv = args.linear_n_k_heads, args.linear_n_v_heads
    dk, dv = args.linear_k_head_dim, args.linear_v_head_dim
    dv_kernel = dv + dk if widen_values else dv
    return (hv * (21 * CHUNK + 48 * dk + (24 + 6 * dtype_bytes) * dv + 4 * dk * dv_kernel / CHUNK)
            + hk * dk * (8 + 4 * dtype_bytes))


def activation_memory_per_rank(args, seq_len: int, rows: int, cp: int, tp: int, ac: str, every_n: int = 2,
                               dtype_bytes: int = 2, loss_chunk: int = 4096, cp_mode: str = "ulysses"
                               ) -> dict[str, float]:
    """Estimated bytes per rank of what one microbatch's forward keeps for backward (``rows`` packed rows of
    ``seq_len`` tokens), from the shapes of the decoder's saved tensors, layer by layer. Per token, in the compute
    dtype: the block input, the normed inputs of the mixer and the MLP, the mixer's output, and the two RMSNorms'
    fp32 internals (``3h`` + ``4h`` fp32); a full-attention layer's q/k/v before and after RoPE (``3(q + kv)``,
    and ``2q`` more for Qwen3.5's output gate); a Gated DeltaNet layer's mixer (:func:`linear_attention_bytes`);
    the MLP's gate, up, activation and product (``4f``: the dense ``ffn_dim``, or an MoE layer's top-k experts plus
    its shared expert; an MoE layer also keeps its tokens' k dispatched copies, ``3kh``, and the fp32 router). No [T, T] scores (the GPU kernels keep none). Context parallel divides the tokens by cp;
    tensor parallel divides every part by tp (sequence parallel outside the mixer and the MLP, heads and columns
    inside). AC 'full' keeps only each block's input (plus one block's activations while it is recomputed);
    'selective' keeps the matmul and attention outputs (a linear-attention layer's mixer counted whole);
    'every_n' checkpoints every n-th block. The loss adds one chunk of fp32 logits [loss_chunk, vocab / tp] and
    the final hidden states.

    Checked on CPU: for the 2-layer debug model on a 4096-token fp32 row within 10% of the bytes autograd saves
    (tests/test_context_parallel.py); for Qwen3.5's debug models (dense and MoE, fp32 and bf16) within 10%
    (tests/test_qwen3_5.py).
    """
    from titan_sft.models.moe import moe_layer_ids

    tokens = rows * seq_len / cp
    h, kv = args.dim, args.n_kv_heads * args.head_dim
    q = args.n_heads * args.head_dim
    routed = set(moe_layer_ids(args.n_layers, args.n_experts, args.decoder_sparse_step, args.mlp_only_layers))
    linear = set(args.linear_layers())
    gdn = linear_attention_bytes(args, dtype_bytes, cp_mode == "ring" and cp > 1) if linear else 0.0
    full, selective = [], []
    for i in range(args.n_layers):
        f = (args.moe_ffn_dim * args.n_experts_per_tok + args.shared_expert_ffn_dim) if i in routed else args.ffn_dim
        common = dtype_bytes * (3 * h + 4 * f) + 4 * 4 * h
        if i in routed:  # each token's k copies dispatched to its experts and back, the fp32 router
            common += dtype_bytes * 3 * args.n_experts_per_tok * h + 4 * (h + 4 * args.n_experts)
        if i in linear:
            full.append((common + gdn) / tp)
            selective.append((dtype_bytes * (3 * h + 2 * f) + gdn) / tp)
        else:
            gate = 2 * q if args.attn_output_gate else 0
            full.append((common + dtype_bytes * (3 * q + 3 * kv + gate)) / tp)
            selective.append(dtype_bytes * (2 * q + 2 * kv + gate + 3 * h + 2 * f) / tp)
    kept = h * dtype_bytes / tp
    if ac == "every_n":
        per_layer = [kept if i % every_n == 0 else full[i] for i in range(args.n_layers)]
    else:
        per_layer = {"none": full, "full": [kept] * args.n_layers, "selective": selective}[ac]
    blocks = tokens * sum(per_layer)
    recompute = tokens * max(full) if ac in ("full", "every_n") else 0.0
    loss = min(loss_chunk, tokens) * args.vocab_size / tp * 4 + tokens * h * dtype_bytes / tp
    return {"blocks": blocks, "recompute": recompute, "loss": loss, "total": blocks + recompute + loss,
            "tokens": tokens}


def _mixture_lines(cfg: JobConfig) -> tuple[int | None, int, list[str]]:
    """(row length, steps, lines) of a ``[[data.sources]]`` mixture: per source its weight, packs and tokens, and
    what the run draws of it (packs, tokens, epochs)."""
    from titan_sft.data.mixture import MixtureDataset, MixtureSampler

    missing = [x for x in cfg.data.sources if not Path(x.path).exists()]
    B = cfg.training.global_batch_size
    if missing:
        T = cfg.training.steps
        return None, T, [f"data: mixture of {len(cfg.data.sources)} sources; not prepared yet: "
                         + ", ".join(f"{x.name} ({x.path})" for x in missing),
                         f"steps: {T} (explicit)" if T else "steps: known once every source is prepared"]
    ds = MixtureDataset([(x.name, x.path) for x in cfg.data.sources])
    sampler = MixtureSampler(ds, [x.weight for x in cfg.data.sources], [x.max_epochs for x in cfg.data.sources], B,
                             offset=cfg.data.skip_examples)
    T = total_steps(cfg, len(ds), sampler.available)
    drawn = [b - a for a, b in zip(sampler.schedule.draws_before(cfg.data.skip_examples),
                                   sampler.schedule.draws_before(cfg.data.skip_examples + T * B))]
    total_w = sum(x.weight for x in cfg.data.sources)
    lines = [f"data: mixture of {len(ds.names)} sources, {len(ds):,} packed examples of {ds.seq_len:,} tokens; a "
             "weight counts packs (so roughly tokens); per source: weight, packs, tokens -> drawn over the run"]
    for x, sub, n in zip(cfg.data.sources, ds.datasets, drawn):
        tokens = int(sub.used.sum())
        cap = f", capped at {x.max_epochs:g} epochs" if x.max_epochs else ""
        lines.append(f"  {x.name}: weight {x.weight / total_w:.3f}{cap}; {len(sub):,} packs, {tokens:,} tokens -> "
                     f"{n:,} packs (~{n / len(sub) * tokens:,.0f} tokens) = {n / len(sub):.2f} epochs")
    lines += [f"global batch: {B} packed examples = {B * ds.seq_len:,} tokens per step; per device "
              f"{cfg.training.per_device_batch}",
              f"steps: {T} ({f'{cfg.training.epochs} epochs of all sources together' if cfg.training.steps == 0 else 'explicit'})"]
    return ds.seq_len, T, lines


def checkpoint_bytes(model: torch.nn.Module, frozen_bytes: int, frozen_base: str) -> dict[str, float]:
    """Bytes of one DCP checkpoint of ``model`` (all ranks together): trainable parameters and their AdamW state
    in fp32 (12 bytes each), and the frozen parameters (``frozen_bytes`` each) unless ``frozen_base`` is
    "identity" (then only their fingerprint, a few numbers per tensor, is stored). Metadata not counted."""
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    base = sum(frozen_param_bytes(p, frozen_bytes) for p in model.parameters() if not p.requires_grad)
    return {"total": 12 * trained + (0 if frozen and frozen_base == "identity" else base), "base": base,
            "frozen": frozen}


def frozen_param_bytes(p: torch.Tensor, frozen_bytes: int) -> float:
    """Bytes of a frozen parameter: ``frozen_bytes`` per element for floating ones (stored in the compute dtype),
    the integer codes of an NF4 weight (QLoRA) at their own width."""
    return p.numel() * (frozen_bytes if p.is_floating_point() else p.element_size())


def nf4_transient(model: torch.nn.Module, frozen_bytes: int) -> float:
    """Bytes of dequantized NF4 weights (QLoRA) alive at once: a linear's weight is dequantized for its matmul
    and again in backward (one at a time); a routed-experts layer's stacked weights stay dequantized until that
    layer's backward (under activation checkpointing: one block's at a time)."""
    from titan_sft import nf4

    per_module: dict[int, float] = {}
    for m, name in nf4.quantized_weights(model).values():
        per_module[id(m)] = per_module.get(id(m), 0) + frozen_bytes * math.prod(nf4.full_shape(m, name))
    return max(per_module.values(), default=0.0)


def nf4_line(model: torch.nn.Module, frozen_bytes: int, dp_shard: int) -> str | None:
    """What the NF4 base (QLoRA) costs per rank, and the dequantized weights a step holds at once."""
    from titan_sft import nf4
    from titan_sft.compat import FSDP_INTEGER_PARAMS

    quantized = nf4.quantized_weights(model)
    if not quantized:
        return None
    stored = sum(frozen_param_bytes(p, frozen_bytes) for n, p in model.named_parameters() if nf4.is_nf4_key(n))
    n = sum(math.prod(nf4.full_shape(*v)) for v in quantized.values())
    return (f"NF4 base (lora.base_quant): {len(quantized)} weights, {n / 1e9:.2f}B parameters in "
            f"{stored / GIB:.2f} GiB ({stored / n:.3f} bytes each; {frozen_bytes * n / GIB:.2f} GiB unquantized), "
            f"{(stored / dp_shard if FSDP_INTEGER_PARAMS else stored) / GIB:.2f} GiB per rank (in the parameters "
            f"above{'' if FSDP_INTEGER_PARAMS else '; whole on every rank: FSDP2 shards integer codes from torch 2.13'}); "
            f"dequantized weights alive at "
            f"once: {nf4_transient(model, frozen_bytes) / GIB:.2f} GiB")


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters of ``model``, an NF4 weight counted as the elements it stands for."""
    from titan_sft import nf4

    quantized = nf4.quantized_weights(model)
    return (sum(p.numel() for n, p in model.named_parameters() if not nf4.is_nf4_key(n))
            + sum(math.prod(nf4.full_shape(*v)) for v in quantized.values()))


def size_line(size: dict[str, float], frozen_base: str) -> str:
    if not size["frozen"]:
        return f"checkpoint size: {size['total'] / GIB:.2f} GiB (parameters and AdamW state, fp32)"
    if frozen_base == "identity":
        return (f"checkpoint size: {size['total'] / GIB:.3f} GiB (trainable parameters and their AdamW state; the "
                f"frozen base's {size['base'] / GIB:.2f} GiB is not stored, only its source and fingerprint)")
    return (f"checkpoint size: {size['total'] / GIB:.2f} GiB (the frozen base's {size['base'] / GIB:.2f} GiB "
            "included: checkpoint.frozen_base = stored)")


def memory_per_rank(model: torch.nn.Module, plan, dp_shard: int, tp: int, frozen_bytes: int = 4,
                    ep: int = 1) -> dict[str, float]:
    """Bytes per rank of parameters (trainable ones fp32, frozen ones ``frozen_bytes`` each: bf16 when the compute
    dtype is, see ``parallelize.store_frozen_params``), fp32 gradients and AdamW state (2 fp32 tensors).

    Parameters under a column-/row-wise style of the tensor-parallel plan are split tp ways (norm weights are
    replicated); FSDP splits everything dp_shard ways, and a routed MoE's routers (and its experts without ep) tp
    ways as well: each tp rank trains them on its own tokens (``parallel.tensor_parallel``). ``deferred_grads``: the whole (unsharded over dp) fp32
    gradients that ``grad_reduce = "last_microbatch"`` keeps between microbatches. Gradients and optimizer state
    exist for trainable parameters only (LoRA freezes the base).
    """
    root, block = plan
    split = [f for f, st in root.items() if isinstance(st, (ColwiseParallel, RowwiseParallel))]
    split += [f"layers.*.{f}" for f, st in block.items() if isinstance(st, (ColwiseParallel, RowwiseParallel))]

    def is_split(name: str) -> bool:
        parts = name.split(".")
        generic = ".".join(["layers", "*", *parts[2:]]) if parts[0] == "layers" else name
        return any(generic.startswith(f + ".") for f in split)

    def tp_ways(name: str) -> int:
        if ".feed_forward.router." in name or (".feed_forward.experts." in name and ep == 1):
            return tp
        return tp if is_split(name) else 1

    from titan_sft.compat import FSDP_INTEGER_PARAMS

    trained = sum(p.numel() / tp_ways(n) for n, p in model.named_parameters() if p.requires_grad)
    frozen = sum(frozen_param_bytes(p, frozen_bytes) / tp_ways(n) for n, p in model.named_parameters()
                 if not p.requires_grad and p.is_floating_point())
    # integer ones (NF4 codes): sharded like the rest where this torch's FSDP2 shards them, else whole per rank
    codes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_floating_point())
    return {"params": (4 * trained + frozen + (codes if FSDP_INTEGER_PARAMS else codes * dp_shard)) / dp_shard, "grads": 4 * trained / dp_shard, "optimizer": 8 * trained / dp_shard,
            "deferred_grads": 4 * trained}


class _Stages(torch.nn.Module):
    """Several stage modules as one, for counting their parameters (names stay unique: global layer indices)."""

    def __init__(self, stages: list):
        super().__init__()
        for i, st in enumerate(stages):
            self.add_module(f"stage{i}", st)
        self.numel_total = sum(p.numel() for p in self.parameters())

    def named_parameters(self, *args, **kwargs):
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.split(".", 1)[1], p


def _short(xs: list) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 8 else ", ".join(map(str, xs[:4] + ["..."] + xs[-2:]))


def _objective_line(cfg) -> str:
    ob = cfg.objective
    if cfg.objective.name != "masked_diffusion":
        return f"objective {ob.name}: see its module"
    split = f", split answer {ob.answer_weight:g} / padding {ob.padding_weight:g}" if ob.split_loss else ""
    return (f"masked diffusion: t ~ U({ob.t_min:g}, 1), 1/t-weighted CE at masked answer positions, normalised "
            f"{ob.normalization}{split}; {'shifted (Dream)' if ob.shift else 'unshifted (LLaDA)'}; mask token "
            f"{ob.mask_token_id if ob.mask_token_id >= 0 else 'default (first row past the tokenizer)'}")


def offline_flavor(cfg: JobConfig, spec) -> bool:
    """Whether the plan uses ``model.flavor``'s arguments because the HF directory the run starts from is not on
    this machine yet (a dry run needs no download: the released sizes are flavors)."""
    from titan_sft.config import ConfigError
    from titan_sft.hf_io import resolve_hf_dir

    # the default flavor (debug) is not a plan for a released model's directory: then the error stands
    if not cfg.model.init_from_hf or cfg.model.flavor not in spec.flavors or cfg.model.flavor.startswith("debug"):
        return False
    try:
        return not (resolve_hf_dir(cfg.model.hf_assets_path) / "config.json").is_file()
    except (ConfigError, ValueError, OSError):
        return True


def dry_run(cfg: JobConfig) -> str:
    """The plan as text (one fact per line). Without the packed dataset (not prepared yet) the plan still shows
    the model, layout and memory, and the schedule when ``training.steps`` is explicit."""

    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.sampler import holdout_split
    from titan_sft.optimizer import decay_groups, scaled_lr

    spec = get_train_spec(cfg.model.name)
    get_objective(cfg.objective.name)  # an unknown objective fails here, as it would at start
    require_data_path(cfg)
    if cfg.data.sources:
        ds = None
        mixture_lines = _mixture_lines(cfg)
    else:
        ds = PackedDataset(cfg.data.path) if Path(cfg.data.path).exists() else None
    # The plan is for the GPU machine the run is meant for: 'auto' resolves as it would there.
    attention, _ = resolve_backend(cfg.model.attention, "cuda")
    offline, hf_path = offline_flavor(cfg, spec), cfg.model.hf_assets_path
    if offline:  # no download needed to plan: the flavor's own arguments stand in for config.json
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, init_from_hf=False))
    args = model_args(dataclasses.replace(cfg.model, attention=attention), spec)
    shown = f"auto -> {attention} on GPU" if cfg.model.attention == "auto" else attention
    B = cfg.training.global_batch_size
    if cfg.data.sources:
        L, T, data_lines = mixture_lines
    elif ds is not None:
        m, L = ds.manifest, ds.seq_len
        trained, held = holdout_split(len(ds), cfg.validation.holdout_fraction, cfg.validation.holdout_seed)
        T = total_steps(cfg, len(trained))
        data_lines = [
            f"data: {cfg.data.path}: {len(ds):,} packed examples of {L:,} tokens ({m['n_documents']:,} documents, "
            f"{m.get('n_assistant_tokens', 0):,} assistant tokens, "
            f"{m.get('n_loss_targets', int(ds.assistant_counts.sum())):,} loss targets)",
            f"global batch: {B} packed examples = {B * L:,} tokens per step; per device {cfg.training.per_device_batch}",
            *([f"held out for validation: {len(held):,} packs (validation.holdout_fraction)"] if len(held) else []),
            f"steps: {T} ({f'{cfg.training.epochs} epochs' if cfg.training.steps == 0 else 'explicit'}), presenting {T * B * L:,} tokens = "
            f"{T * B / len(trained):.2f} epochs",
        ]
    else:
        L, T = None, cfg.training.steps
        data_lines = [
            f"data: {cfg.data.path} is not prepared yet (python -m titan_sft.data."
            f"{'prepare_diffusion' if cfg.objective.name == 'masked_diffusion' else 'prepare'} ... --out "
            f"{cfg.data.path}); "
            "tokens per step and epochs follow from it",
            f"global batch: {B} packed examples per step; per device {cfg.training.per_device_batch}",
            f"steps: {T} (explicit)" if T else f"steps: {cfg.training.epochs} epochs of the packed data (known once it is prepared)",
        ]
    o = cfg.optimizer
    lr = scaled_lr(o, B)
    with torch.device("meta"):
        model = spec.model_cls(args)
    lora_line = []
    if "lora" in cfg.model.converters:
        from titan_sft.lora import apply_lora

        apply_lora(model, cfg)
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        n_all = parameter_count(model)
        kind = "DoRA" if cfg.lora.use_dora else "LoRA"
        lora_line = [f"{kind}: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}"
                     f"{' (rsLoRA: scale alpha / sqrt(rank))' if cfg.lora.use_rslora else ''} on "
                     f"{', '.join(cfg.lora.targets)}"
                     f"{' + norms' if cfg.lora.train_norms else ''}: {n_train / 1e6:,.2f}M trainable of "
                     f"{n_all / 1e6:,.1f}M parameters (optimizer state for those only)"]
    decay, no_decay = decay_groups(model, cfg.optimizer.decay_mask)
    whole = model
    schedule_lines = []
    c = cfg.checkpoint
    if T:
        s = cfg.lr_scheduler
        sched = Schedule.from_config(s, T)
        fn = lr_multiplier(s, T, lr)
        keys = sorted({0, 1, sched.warmup - 1, sched.warmup, sched.warmup + sched.stable - 1,
                       sched.warmup + sched.stable, T // 2, T - 1} & set(range(T)))
        shape = (f"{s.decay_type}, warmup {sched.warmup} / stable {sched.stable} / decay {sched.decay} steps"
                 if s.name == "levanter" else f"transformers' {s.name}, warmup {sched.warmup} steps")
        exports = [label(s) for s in range(1, T + 1)
                   if c.hf_export_interval >= 0 and hook_fires(s, T, c.hf_export_interval)]
        ckpts = [label(s) for s in range(1, T + 1) if hook_fires(s, T, c.interval)]
        schedule_lines = [
            f"schedule: {shape}, base lr {lr:g}, final lr {lr * fn(T - 1):.4g}",
            "lr at steps: " + ", ".join(f"{k}: {lr * fn(k):.4g}" for k in keys),
        ]
        cadence = (f"checkpoints every {c.interval} (labels {_short(ckpts)}); HF export every {c.hf_export_interval} "
                   f"(labels {_short(exports)}), dtype {c.hf_export_dtype}")
    else:
        cadence = f"checkpoints every {c.interval}; HF export every {c.hf_export_interval}, dtype {c.hf_export_dtype}"
    world = planned_world_size(cfg)
    dp_rep, dp_shard, tp, ep, cp, pp = check_layout(cfg, world)
    L = L or cfg.data.seq_len or None
    check_tensor_parallel(tp, args.n_heads, args.n_kv_heads, L or tp, args.linear_n_k_heads)
    check_context_parallel(cp, cfg.parallelism.cp_mode, tp, args.n_heads, args.n_kv_heads,
                           L or cp * tp * 2 * max(args.linear_conv_kernel - 1, 1), attention,
                           len(args.linear_layers()), args.linear_n_k_heads, args.linear_conv_kernel)
    check_expert_parallel(ep, args.n_experts, cfg.training.compile, "lora" in cfg.model.converters and cfg.lora.experts,
                          tp)
    plan = spec.tp_plan_fn()
    dtype_bytes = 2 if cfg.training.param_dtype == "bfloat16" else 4
    pipeline_lines, stage_share = [], 1.0
    if pp > 1:  # the memory of the heaviest pipeline rank's stages; activations of the microbatches in flight
        from titan_sft.parallel.pipeline_parallel import PipelinePlan, build_stage, check_pipeline_parallel

        check_pipeline_parallel(cfg, args)
        pplan = PipelinePlan.from_config(cfg, args.n_layers)
        m = B // (dp_rep * dp_shard) // cfg.training.per_device_batch
        parts = []
        for r in range(pp):
            with torch.device("meta"):
                stages = [build_stage(spec.model_cls, args, pplan.stage_layers(s), s == 0, s == pplan.n_stages - 1)
                          for s in pplan.stages_of(r)]
            parts.append((sum(len(st.layers) for st in stages), _Stages(stages)))
        heaviest = max(range(pp), key=lambda r: parts[r][1].numel_total)
        model = parts[heaviest][1]
        in_flight = m if cfg.parallelism.pp_schedule == "GPipe" else min(m, pp)
        stage_share = parts[heaviest][0] / args.n_layers * in_flight
        pipeline_lines = [
            f"pipeline parallel {pp} ({cfg.parallelism.pp_schedule}, {pplan.n_stages} stages, {m} microbatches per "
            f"step): bubble {pplan.bubble_fraction(m):.1%} of the step in the schedule's theory; layers per stage "
            f"{pplan.layers}", *pplan.describe(),
            f"memory below: pp rank {heaviest} (the heaviest: {parts[heaviest][0]} layers); activations of up to "
            f"{in_flight} microbatches in flight on it"]
    mem = memory_per_rank(model, plan, dp_shard * cp, tp, dtype_bytes, ep)
    quant = nf4_line(model, dtype_bytes, dp_shard * cp)
    size = checkpoint_bytes(whole, dtype_bytes, cfg.checkpoint.frozen_base)
    cadence += "\n" + size_line(size, cfg.checkpoint.frozen_base)
    deferred = cfg.parallelism.grad_reduce == "last_microbatch"
    layout = [
        f"mesh: {f'pp {pp} x ' if pp > 1 else ''}dp_replicate {dp_rep} x dp_shard {dp_shard} x cp {cp} x tp {tp} = "
        f"{world} ranks"
        f"{f', expert parallel {ep}: each rank holds {args.n_experts // ep} of the {args.n_experts} experts of a layer, FSDP-sharded over the {dp_rep * dp_shard // ep} ranks holding the same ones' if ep > 1 else ''}"
        f"{' (WORLD_SIZE)' if 'WORLD_SIZE' in os.environ else ''}; each rank takes "
        f"{B // (dp_rep * dp_shard)} packed examples per step in microbatches of {cfg.training.per_device_batch}",
        *([f"context parallel {cp} ({cfg.parallelism.cp_mode}): every row split into {cp} parts"
           f"{' (head-tail chunks)' if cfg.parallelism.cp_mode == 'ring' else ''}; FSDP shards over dp_shard x cp "
           f"= {dp_shard * cp} ranks"
           + (f"; {args.n_kv_heads // tp} key/value heads per tp rank are repeated to "
              f"{math.lcm(args.n_kv_heads // tp, cp)} for the all-to-all"
              if cfg.parallelism.cp_mode == "ulysses" and (args.n_kv_heads // tp) % cp else "")] if cp > 1 else []),
        *pipeline_lines,
        *(["tensor-parallel plan (sequence parallel between blocks, loss parallel on the vocab-split head):",
           *describe_plan(plan, args.moe_layers())] if tp > 1 else []),
        f"memory per rank: parameters {mem['params'] / GIB:.2f} GiB, gradients {mem['grads'] / GIB:.2f} GiB, "
        f"AdamW state {mem['optimizer'] / GIB:.2f} GiB (fp32, sharded)"
        + (f"; grad_reduce last_microbatch adds {mem['deferred_grads'] / GIB:.2f} GiB of unsharded gradients "
           "between microbatches" if deferred else
           f"; gradients are reduce-scattered every microbatch (last_microbatch would hold "
           f"{mem['deferred_grads'] / GIB:.2f} GiB unsharded)"),
        *([quant] if quant else []),
    ]
    if L:
        t = cfg.training
        act = activation_memory_per_rank(args, L, t.per_device_batch, cp, tp, t.activation_checkpoint, t.ac_every_n,
                                         dtype_bytes, t.loss_chunk_size, cfg.parallelism.cp_mode)
        cp_ring = cp > 1 and cfg.parallelism.cp_mode == "ring"
        if pp > 1:  # this rank's layers, times the microbatches it holds at once
            act["blocks"] *= stage_share
            act["total"] = act["blocks"] + act["recompute"] + act["loss"]
        layout.append(
            f"activations per rank (estimate): {act['total'] / GIB:.2f} GiB for a microbatch of "
            f"{t.per_device_batch} x {L:,} tokens ({act['tokens']:,.0f} on this rank"
            f"{f' at cp {cp}' if cp > 1 else ''}{f', tp {tp}' if tp > 1 else ''}), activation_checkpoint "
            f"{t.activation_checkpoint}: blocks {act['blocks'] / GIB:.2f} GiB, recompute {act['recompute'] / GIB:.2f} "
            f"GiB, loss chunk {act['loss'] / GIB:.2f} GiB"
            + (f"; its {len(args.linear_layers())} linear-attention layers counted as torch's delta rule keeps them "
               f"({linear_attention_bytes(args, dtype_bytes, cp_ring) / 2**10:.0f} KiB per token each before tp; "
               "flash-linear-attention's kernel keeps less)" if args.linear_layers() else ""))
        peak = (mem["params"] + mem["grads"] + mem["optimizer"] + act["total"] + nf4_transient(model, dtype_bytes)
                + (mem["deferred_grads"] if deferred else 0))
        layout.append(f"per rank in all (estimate, a floor: allocator fragmentation and kernel workspaces come on "
                      f"top): {peak / GIB:.2f} GiB")
    lines = [
        f"model: {cfg.model.name} {('(from ' + cfg.model.hf_assets_path + ')') if cfg.model.init_from_hf else cfg.model.flavor}"
        f", {args.num_params() / 1e6:,.1f}M parameters, attention {shown}",
        *([f"({hf_path}/config.json is not on this machine: planned from flavor {cfg.model.flavor}'s arguments; "
           f"the run needs the directory: python -m titan_sft.download {hf_path} --to DIR, or huggingface-cli "
           f"download {hf_path})"] if offline else []),
        *([f"experts: {args.n_experts} per MoE layer ({len(args.moe_layers())} of {args.n_layers} layers), "
           f"{args.n_experts_per_tok} per token: {args.num_params(active=True) / 1e6:,.1f}M active parameters "
           "(MFU counts these)"] if args.n_experts else []),
        f"objective: {cfg.objective.name}",
        *lora_line,
        *data_lines,
        *([f"lr scaling {o.lr_scaling}: {o.lr:g} x ({B} / {o.reference_batch})"
           f"{'^0.5' if o.lr_scaling == 'sqrt' else ''} = {lr:.4g}"] if o.lr_scaling != "none" else []),
        *schedule_lines,
        f"weight decay {cfg.optimizer.weight_decay:g} on {len(decay)} tensors; " + (
            f"excluded ({len(no_decay)}): norms, token embedding{' (tied with the head)' if args.tie_embeddings else ''}"
            ", biases" if o.decay_mask == "recipe" else "every trainable tensor (decay_mask all)"),
        (f"clip to global norm {cfg.training.max_grad_norm:g}; " if cfg.training.max_grad_norm else "no clipping; ") +
        f"{'AdamW8bit' if o.name == 'adamw8bit' else 'AdamW'} betas ({cfg.optimizer.beta1}, {cfg.optimizer.beta2})"
        f", eps {cfg.optimizer.eps:g}",
        (f"loss groups: {cfg.training.loss_groups} of {B // cfg.training.loss_groups} examples (mean of group token "
         "means)") if cfg.objective.name == "causal_lm" else _objective_line(cfg),
        cadence,
        *layout,
    ]
    return "\n".join(lines)


def peak_memory_estimate(cfg: JobConfig, seq_len: int) -> dict[str, float]:
    """Bytes one rank of a run without pipeline parallel needs at its peak, as the dry run plans it: parameters,
    gradients and AdamW state (:func:`memory_per_rank`, LoRA applied where the config has it) plus one microbatch
    of ``seq_len``-token rows' activations (:func:`activation_memory_per_rank`). Keys: ``state``, ``activations``,
    ``dequantized`` (NF4 weights dequantized at once, QLoRA: :func:`nf4_transient`), ``total``. A floor, not a bound: the caching allocator's fragmentation and the kernels' workspaces come on
    top."""
    spec = get_train_spec(cfg.model.name)
    attention, _ = resolve_backend(cfg.model.attention, "cuda")
    args = model_args(dataclasses.replace(cfg.model, attention=attention), spec)
    with torch.device("meta"):
        model = spec.model_cls(args)
    if "lora" in cfg.model.converters:
        from titan_sft.lora import apply_lora

        apply_lora(model, cfg)
    _, dp_shard, tp, ep, cp, pp = check_layout(cfg, planned_world_size(cfg))
    if pp > 1:
        raise ValueError("peak_memory_estimate plans layouts without pipeline parallel; the dry run plans pp")
    t = cfg.training
    dtype_bytes = 2 if t.param_dtype == "bfloat16" else 4
    mem = memory_per_rank(model, spec.tp_plan_fn(), dp_shard * cp, tp, dtype_bytes, ep)
    state = mem["params"] + mem["grads"] + mem["optimizer"]
    if cfg.parallelism.grad_reduce == "last_microbatch":
        state += mem["deferred_grads"]
    act = activation_memory_per_rank(args, seq_len, t.per_device_batch, cp, tp, t.activation_checkpoint,
                                     t.ac_every_n, dtype_bytes, t.loss_chunk_size, cfg.parallelism.cp_mode)
    dequant = nf4_transient(model, dtype_bytes)
    return {"state": state, "activations": act["total"], "dequantized": dequant,
            "total": state + act["total"] + dequant}
