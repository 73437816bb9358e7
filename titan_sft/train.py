"""``python -m titan_sft.train --config FILE.toml [--section.key VALUE ...] [--dry-run]``: the SFT trainer.

Reads top to bottom: init distributed -> build components from the registry spec -> parallelize -> load or
resume -> loop (batch, forward/loss, backward, clip, step, schedule, log, checkpoint, export) -> finish.

The recipe's semantics live here (shared/spec/recipe.md):
* loss groups (item 6): the B packed examples of a step are cut, in order, into G groups; the step loss is the
  mean over groups of (group CE sum / group target count). Every token carries the weight 1 / (G * N_group), with
  N_group all-reduced over ranks, so summing weighted CE over all microbatches and ranks gives exactly that
  number, and its gradient, whatever the number of ranks or microbatches;
* gradients are SUMMED across ranks (FSDP divide factor 1), because the weights already normalise (item 10);
* labels (item 8): a step is labelled completed_steps - 1; hooks fire when label > 1 and label % period == 0,
  and after the final step.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from titan_sft.config import ConfigError, JobConfig, load_config
from titan_sft.lr_schedule import Schedule
from titan_sft.models.attention import BackendUnavailable, check_backend
from titan_sft.registry import get_train_spec


class StartupCheckError(RuntimeError):
    """A recipe start-up check failed (document isolation, loss denominators)."""


def total_steps(cfg: JobConfig, n_packs: int) -> int:
    """training.steps, or 0 = 8 epochs over the packed data: ceil(8 * n_packs / global batch)."""
    return cfg.training.steps or math.ceil(8 * n_packs / cfg.training.global_batch_size)


def model_args(cfg: JobConfig, spec):
    """The model's architecture: from the HF directory's config.json when starting from HF, else the flavor."""
    from titan_sft.models.hf_adapter import args_from_hf_config, read_hf_config

    if cfg.model.init_from_hf:
        args = args_from_hf_config(read_hf_config(cfg.model.hf_assets_path))
    else:
        if cfg.model.flavor not in spec.flavors:
            raise ConfigError(
                f"config key 'model.flavor': '{cfg.model.flavor}' is not a {spec.name} flavor; "
                f"allowed: {', '.join(spec.flavors)}"
            )
        args = spec.flavors[cfg.model.flavor]
    return dataclasses.replace(args, attention=cfg.model.attention)


def group_weights(labels: torch.Tensor, groups: torch.Tensor, counts: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Per-token loss weight 1 / (G * N_group) on loss-carrying positions, 0 elsewhere."""
    w = 1.0 / (n_groups * counts.double())
    return torch.where(labels != -100, w[groups], 0.0).float()


def check_document_isolation(model, vocab_size: int, seq_len: int, device: torch.device, backend: str) -> None:
    """Recipe item 7: changing a pack's second document must leave the first's hidden states bit-identical."""
    g = torch.Generator().manual_seed(1234)
    n = min(seq_len, 256)
    row = torch.randint(0, vocab_size, (1, n), generator=g)
    other = row.clone()
    split = n // 2
    other[0, split:] = torch.randint(0, vocab_size, (n - split,), generator=g)
    cu = torch.tensor([0, split, n], dtype=torch.int32)
    with torch.no_grad():
        a = model(row.to(device), cu_seqlens=cu.to(device), hidden_only=True)
        b = model(other.to(device), cu_seqlens=cu.to(device), hidden_only=True)
    if not torch.equal(a[:, :split], b[:, :split]):
        raise StartupCheckError(
            f"document isolation check failed for attention backend '{backend}': document 1's hidden states changed "
            "when document 2 changed (use --training.skip_startup_checks true to bypass)"
        )


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.stop_signal: int | None = None
        self._init_distributed()
        spec = get_train_spec(cfg.model.name)
        self.spec = spec
        torch.manual_seed(cfg.job.seed)

        # ---- data
        self.dataset = spec.build_dataloader_fn(cfg)
        self.seq_len = self.dataset.seq_len
        self.total_steps = total_steps(cfg, len(self.dataset))
        from titan_sft.data.sampler import RecipeSampler

        self.sampler = RecipeSampler(len(self.dataset), cfg.training.global_batch_size, self.dp_rank, self.dp_world,
                                     cfg.data.shuffle, cfg.data.shuffle_seed)
        from titan_sft.data.loader import BatchLoader

        self.loader = BatchLoader(self.dataset, self.sampler, cfg.training.per_device_batch, cfg.training.loss_groups,
                                  cfg.model.reset_positions_per_document, pin_memory=torch.cuda.is_available())
        if self.sampler.local_batch % cfg.training.per_device_batch:
            raise ConfigError(
                f"config key 'training.per_device_batch': {cfg.training.per_device_batch} must divide the per-rank "
                f"batch global_batch_size / ranks = {self.sampler.local_batch}"
            )

        # ---- model: meta -> parallelize -> materialise -> init or load
        self.args = model_args(cfg, spec)
        vocab = self.dataset.manifest.get("vocab_size", 0)
        if vocab > self.args.vocab_size:
            raise ConfigError(f"data.path: the dataset's tokenizer has {vocab} tokens, more than the model's "
                              f"vocab_size {self.args.vocab_size}")
        with torch.device("meta"):
            model = spec.model_cls(self.args)
        model.loss_chunk_size = cfg.training.loss_chunk_size
        spec.parallelize_fn(model, self.mesh, cfg.training, self.device)
        model.to_empty(device=self.device)
        self._init_weights(model)
        self.model = model

        self.optimizer = spec.build_optimizer_fn(model, cfg.optimizer)
        self.lr_scheduler = spec.build_lr_scheduler_fn(self.optimizer, cfg.lr_scheduler, self.total_steps)
        self.metrics = spec.build_metrics_fn(cfg.job.dump_folder, self.rank, cfg.metrics, self.device,
                                             self.total_steps, cfg.to_dict())
        self.checkpointer = spec.build_checkpointer_fn(cfg.checkpoint, cfg.job.dump_folder, model, self.optimizer,
                                                       self.lr_scheduler, self.sampler, cfg.to_dict())
        self.step = self.checkpointer.resume() if cfg.checkpoint.enable else 0
        if self.step and self.rank == 0:
            print(f"[resume] continuing after step {self.step} of {self.total_steps}", flush=True)

    # -- set-up ----------------------------------------------------------------------------------------------
    def _init_distributed(self) -> None:
        if "RANK" not in os.environ:  # plain `python -m titan_sft.train`: a one-process group
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        use_cuda = torch.cuda.is_available()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank) if use_cuda else torch.device("cpu")
        if use_cuda:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        from titan_sft.parallel import ParallelDims

        self.pdims = ParallelDims.from_config(self.cfg.parallelism, self.world)
        self.mesh = self.pdims.build_mesh(self.device.type)
        self.dp_world = self.pdims.dp_world
        self.dp_rank = self.mesh["dp_replicate"].get_local_rank() * self.pdims.dp_shard + self.mesh["dp_shard"].get_local_rank()
        try:
            check_backend(self.cfg.model.attention, self.device)
        except BackendUnavailable as e:
            raise ConfigError(str(e)) from None
        if self.cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)

    def _init_weights(self, model) -> None:
        """HF weights (each rank reads its own shards) or a seeded random init that is identical for any world
        size: rank 0 builds the full state on CPU and every rank receives its shards (``broadcast_from_rank0``)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        if self.cfg.model.init_from_hf:
            from titan_sft.checkpoint import load_hf_weights

            load_hf_weights(model, self.args, self.cfg.model.hf_assets_path)
            self._report_vocab()
            return
        full = {}
        if self.rank == 0:
            with torch.device("meta"):
                cpu_model = self.spec.model_cls(self.args)
            cpu_model.to_empty(device="cpu")
            torch.manual_seed(self.cfg.job.seed)
            cpu_model.init_weights()
            full = cpu_model.state_dict()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))

    def _report_vocab(self) -> None:
        tok_dir = self.tokenizer_dir()
        if self.rank != 0 or not tok_dir:
            return
        try:
            n = len(self.spec.build_tokenizer_fn(self.cfg))
        except (OSError, ValueError):
            print(f"[init] loaded {self.cfg.model.hf_assets_path}; no tokenizer found to compare with vocab_size "
                  f"{self.args.vocab_size}", flush=True)
            return
        note = "" if n <= self.args.vocab_size else " -- MORE than the model's embeddings: ids past it will fail"
        print(f"[init] loaded {self.cfg.model.hf_assets_path}; tokenizer has {n} tokens, model vocab_size "
              f"{self.args.vocab_size}{note}", flush=True)

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, handler)

    # -- one step --------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        cfg = self.cfg.training
        G, B = cfg.loss_groups, cfg.global_batch_size
        batch = self.loader.next()
        step, global_ids, mbs = batch.step, batch.global_ids, batch.microbatches
        counts = torch.zeros(G, dtype=torch.float64)
        for mb in mbs:
            counts += torch.bincount(mb.groups[mb.labels != -100], minlength=G).double()
        dist.all_reduce(counts)
        derived = np.bincount(np.arange(B) // (B // G), weights=self.dataset.assistant_counts[global_ids], minlength=G)
        if not cfg.skip_startup_checks and step == self.first_step and not np.array_equal(counts.numpy(), derived):
            raise StartupCheckError(f"loss denominators {counts.tolist()} differ from the dataset's assistant_counts "
                                    f"{derived.tolist()} (recipe item 10)")
        if (counts == 0).any():
            raise RuntimeError(f"step {step}: loss group(s) {torch.nonzero(counts == 0).flatten().tolist()} have no "
                               "loss-carrying target (recipe item 6)")

        t0 = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        n_tokens = 0
        for k, mb in enumerate(mbs):
            self.model.set_requires_gradient_sync(k == len(mbs) - 1)
            weights = group_weights(mb.labels, mb.groups, counts, G)
            mb = mb.to(self.device, non_blocking=True)
            loss = self.model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, labels=mb.labels,
                              loss_weights=weights.to(self.device, non_blocking=True))
            loss.backward()
            loss_sum += loss.detach()
            n_tokens += mb.input_ids.numel()
        grad_norm = self._clip_grads(cfg.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.checkpointer.wait_staged()  # an async save must finish copying the state before it changes
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        stats = torch.tensor([loss_sum.item(), float(n_tokens)], dtype=torch.float64)
        dist.all_reduce(stats)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        tokens_per_s = stats[1].item() / self.world / dt
        mfu = None
        if self.metrics.peak:
            from titan_sft.metrics import flops_per_token

            mfu = 100 * tokens_per_s * flops_per_token(self.args, self.seq_len) / self.metrics.peak
        return {
            "split": "train", "step": step + 1, "loss": stats[0].item(), "lr": lr, "grad_norm": grad_norm,
            "n_loss_tokens": int(counts.sum().item()), "n_tokens": int(stats[1].item()), "step_time_s": dt,
            "tokens_per_s": tokens_per_s, "mfu": mfu,
            "memory_gib": torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None,
        }

    def _clip_grads(self, max_norm: float) -> float:
        """Global L2 norm over all shards (pre-clip, what is logged), then clipping if max_norm > 0."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        if max_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm, foreach=True)
        return norm.item()

    # -- the run ---------------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        out = Path(cfg.job.dump_folder)
        if self.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            cfg.write_resolved(out / "resolved_config.json")
        if not cfg.training.skip_startup_checks and self.step == 0:
            check_document_isolation(self.model, self.args.vocab_size, self.seq_len, self.device, cfg.model.attention)
        self._install_signal_handlers()
        self.first_step = self.step
        self.sampler.step = self.step
        self.loader.start(self.step)
        while self.step < self.total_steps:
            record = self.train_step()
            self.step += 1
            self.sampler.step = self.step  # the data position a checkpoint records
            if self.step % cfg.metrics.log_freq == 0 or self.step == self.total_steps:
                self.metrics.log(record)
            if cfg.checkpoint.enable:
                self.checkpointer.maybe_save(self.step, self.total_steps)
            self._maybe_export()
            planned_stop = self.step == cfg.training.stop_at_step and self.step < self.total_steps
            if self._stop_requested() or planned_stop:
                if cfg.checkpoint.enable:
                    self.checkpointer.save(self.step, temp=True)
                if self.rank == 0:
                    why = "training.stop_at_step" if planned_stop else f"signal {self.stop_signal}"
                    print(f"[stop] {why}: stopped after step {self.step}; checkpoint saved", flush=True)
                return
        if self.rank == 0:
            print(f"training done: {self.step} steps", flush=True)
        self._final_eval()

    def _stop_requested(self) -> bool:
        flag = torch.tensor(float(self.stop_signal is not None))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank stops at the same step
        return bool(flag.item())

    def _maybe_export(self) -> None:
        from titan_sft.checkpoint import hook_fires, label

        c = self.cfg.checkpoint
        if c.hf_export_interval < 0 or not hook_fires(self.step, self.total_steps, c.hf_export_interval):
            return
        path = Path(self.cfg.job.dump_folder) / "hf" / f"step-{label(self.step)}"
        self.spec.export_hf_fn(self.model, self.args, path, c.hf_export_dtype, self.tokenizer_dir(),
                               c.hf_max_shard_size_gb)
        self.last_export = path
        if self.rank == 0:
            print(f"[export] wrote {path}", flush=True)

    def tokenizer_dir(self) -> str | None:
        return self.cfg.model.tokenizer_path or self.cfg.model.hf_assets_path or self.dataset.manifest.get("tokenizer")

    def _final_eval(self) -> None:
        v = self.cfg.validation
        if not v.generation_eval_path or self.rank != 0 or getattr(self, "last_export", None) is None:
            return
        from titan_sft.evaluate import evaluate_exact_match

        acc, n = evaluate_exact_match(self.last_export, v.generation_eval_path, v.max_new_tokens, v.max_examples)
        self.metrics.log({"split": "validation", "step": self.step, "exact_match": acc, "n_examples": n})
        print(f"[eval] exact-match accuracy of {self.last_export} on {n} held-out prompts: {acc:.1%}", flush=True)

    def close(self) -> None:
        self.checkpointer.close()
        self.loader.close()
        self.metrics.close()
        dist.barrier()
        dist.destroy_process_group()


def dry_run(cfg: JobConfig) -> str:
    """Recipe item 12: the plan, without a GPU, the network or building real weights."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.optimizer import decay_groups

    spec = get_train_spec(cfg.model.name)
    ds = PackedDataset(cfg.data.path)
    m = ds.manifest
    args = model_args(cfg, spec)
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
    from titan_sft.checkpoint import hook_fires, label

    exports = [label(s) for s in range(1, T + 1) if c.hf_export_interval >= 0 and hook_fires(s, T, c.hf_export_interval)]
    ckpts = [label(s) for s in range(1, T + 1) if hook_fires(s, T, c.interval)]
    short = lambda xs: ", ".join(map(str, xs)) if len(xs) <= 8 else ", ".join(map(str, xs[:4] + ["..."] + xs[-2:]))  # noqa: E731
    lines = [
        f"model: {cfg.model.name} {('(from ' + cfg.model.hf_assets_path + ')') if cfg.model.init_from_hf else cfg.model.flavor}"
        f", {args.num_params() / 1e6:,.1f}M parameters, attention {cfg.model.attention}",
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
        f"checkpoints every {c.interval} (labels {short(ckpts)}); HF export every {c.hf_export_interval} "
        f"(labels {short(exports)}), dtype {c.hf_export_dtype}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path, dry = None, False
    rest = []
    i = 0
    while i < len(argv):
        if argv[i] == "--config":
            config_path = argv[i + 1] if i + 1 < len(argv) else None
            i += 2
            continue
        if argv[i].startswith("--config="):
            config_path = argv[i].split("=", 1)[1]
        elif argv[i] == "--dry-run":
            dry = True
        else:
            rest.append(argv[i])
        i += 1
    try:
        cfg = load_config(config_path, rest)
        if dry:
            print(dry_run(cfg))
            return 0
        trainer = Trainer(cfg)
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train()
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
