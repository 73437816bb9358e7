"""``python -m titan_sft.train --dry-run``: the plan of a run (recipe item 12), without a GPU, the network or
real weights: batch, tokens per step, steps and epochs, LR at key steps, decay mask, checkpoint/export cadence."""

from __future__ import annotations

import torch

from titan_sft.checkpoint import hook_fires, label
from titan_sft.config import JobConfig, require_data_path
from titan_sft.hf_io import model_args
from titan_sft.lr_schedule import Schedule, total_steps
from titan_sft.registry import get_objective, get_train_spec


def _short(xs: list) -> str:
    return ", ".join(map(str, xs)) if len(xs) <= 8 else ", ".join(map(str, xs[:4] + ["..."] + xs[-2:]))


def dry_run(cfg: JobConfig) -> str:
    """The plan as text (one fact per line)."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.optimizer import decay_groups

    spec = get_train_spec(cfg.model.name)
    get_objective(cfg.objective.name)  # an unknown objective fails here, as it would at start
    require_data_path(cfg)
    ds = PackedDataset(cfg.data.path)
    m = ds.manifest
    args = model_args(cfg.model, spec)
    T = total_steps(cfg, len(ds))
    B, L = cfg.training.global_batch_size, ds.seq_len
    sched = Schedule.from_config(cfg.lr_scheduler, T)
    lr = cfg.optimizer.lr
    with torch.device("meta"):
        model = spec.model_cls(args)
    decay, no_decay = decay_groups(model)
    keys = sorted({0, 1, sched.warmup - 1, sched.warmup, sched.warmup + sched.stable - 1,
                   sched.warmup + sched.stable, T // 2, T - 1} & set(range(T)))
    c = cfg.checkpoint
    exports = [label(s) for s in range(1, T + 1) if c.hf_export_interval >= 0 and hook_fires(s, T, c.hf_export_interval)]
    ckpts = [label(s) for s in range(1, T + 1) if hook_fires(s, T, c.interval)]
    lines = [
        f"model: {cfg.model.name} {('(from ' + cfg.model.hf_assets_path + ')') if cfg.model.init_from_hf else cfg.model.flavor}"
        f", {args.num_params() / 1e6:,.1f}M parameters, attention {cfg.model.attention}",
        f"objective: {cfg.objective.name}",
        f"data: {cfg.data.path}: {len(ds):,} packed examples of {L:,} tokens ({m['n_documents']:,} documents, "
        f"{m.get('n_assistant_tokens', 0):,} assistant tokens, {m.get('n_loss_targets', int(ds.assistant_counts.sum())):,} loss targets)",
        f"global batch: {B} packed examples = {B * L:,} tokens per step; per device {cfg.training.per_device_batch}",
        f"steps: {T} ({'8 epochs' if cfg.training.steps == 0 else 'explicit'}), presenting {T * B * L:,} tokens = "
        f"{T * B / len(ds):.2f} epochs",
        f"schedule: {cfg.lr_scheduler.decay_type}, warmup {sched.warmup} / stable {sched.stable} / decay {sched.decay} "
        f"steps, base lr {lr:g}, final lr {lr * sched.multiplier(T - 1):.4g}",
        "lr at steps: " + ", ".join(f"{s}: {lr * sched.multiplier(s):.4g}" for s in keys),
        f"weight decay {cfg.optimizer.weight_decay:g} on {len(decay)} tensors; excluded ({len(no_decay)}): norms, "
        f"token embedding{' (tied with the head)' if args.tie_embeddings else ''}, biases",
        f"clip to global norm {cfg.training.max_grad_norm:g}; AdamW betas ({cfg.optimizer.beta1}, {cfg.optimizer.beta2})"
        f", eps {cfg.optimizer.eps:g}",
        f"loss groups: {cfg.training.loss_groups} of {B // cfg.training.loss_groups} examples (mean of group token means)",
        f"checkpoints every {c.interval} (labels {_short(ckpts)}); HF export every {c.hf_export_interval} "
        f"(labels {_short(exports)}), dtype {c.hf_export_dtype}",
    ]
    return "\n".join(lines)
