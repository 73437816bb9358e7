"""``python -m titan_sft.train --config FILE.toml [--section.key VALUE ...] [--dry-run | --help]``: the trainer.

Reads top to bottom: init distributed -> build components from the registry (train spec, objective) ->
parallelize -> load or resume -> loop (batch, forward + objective loss, backward, clip, step, schedule, log,
validate, checkpoint, export) -> finish. What a step means (labels, loss normalisation) is the objective's;
when to save and export is the checkpointer's; the recipe's arithmetic is named where it lives.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from titan_sft.atomic import atomic_write_text
from titan_sft.checkpoint import run_folder
from titan_sft.config import (ConfigError, JobConfig, check_context_parallel, check_expert_parallel,
                              check_tensor_parallel, check_vocab, config_help, load_config)
from titan_sft.converters import high_precision_matmuls
from titan_sft.data.dataset import check_tokenizer
from titan_sft.hf_io import HFExporter, load_hf_weights, model_args
from titan_sft.log import init_logging, logger
from titan_sft.lr_schedule import total_steps
from titan_sft.metrics import FlopCounter
from titan_sft.objectives import BatchError, build_objective
from titan_sft.parallel import clip_grad_norm_, comm, init_distributed, init_sharded, shutdown
from titan_sft.parallel.distributed import exit_process, sum_gradients_over_tp
from titan_sft.parallel.context_parallel import sequence_shard
from titan_sft.parallel.pipeline_parallel import (build_pipelined_model, check_pipeline_parallel, stage_inputs,
                                                  startup_check_on_first_stage)
from titan_sft.registry import converter_hook, get_converter, get_train_spec
from titan_sft.startup_checks import StartupCheckError, check_document_isolation


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.stop_signal: int | None = None
        self._install_signal_handlers()  # early: a preemption warning during start-up must not kill the rank
        self.dist = d = init_distributed(cfg)
        init_logging(d.rank)
        folder = [run_folder(cfg.job.dump_folder, cfg.checkpoint.resume, cfg.checkpoint.enable) if d.rank == 0 else None]
        torch.distributed.broadcast_object_list(folder, src=0)  # every rank writes into the same folder
        if folder[0] != cfg.job.dump_folder:
            logger.info(f"[init] {cfg.job.dump_folder} holds an earlier run that this one does not resume: writing "
                        f"to {folder[0]}")
            cfg.job.dump_folder = folder[0]
        nodes: list = [None] * d.world  # SLURM's node name where there is one (nodes may share a host in tests)
        torch.distributed.all_gather_object(nodes, os.environ.get("SLURMD_NODENAME") or socket.gethostname())
        self.nodes = sorted(set(nodes))
        self.spec = spec = get_train_spec(cfg.model.name)
        self.objective = build_objective(cfg)
        self.objective.bind(d.dp_group, d.loss_group)
        torch.manual_seed(cfg.job.seed)

        # ---- data: dataset, sampler (this data-parallel rank's share) and the objective's collator
        self.loader = spec.build_dataloader_fn(cfg, d.dp_rank, d.dp_world, self.objective.collate,
                                               pin_memory=d.device.type == "cuda")
        self.dataset, self.sampler = self.loader.dataset, self.loader.sampler
        self.seq_len = self.dataset.seq_len
        if cfg.data.seq_len and cfg.data.seq_len != self.seq_len:
            raise ConfigError(f"config key 'data.seq_len': {cfg.data.seq_len}, but the packed data has rows of "
                              f"{self.seq_len} tokens (prepare it with --seq-len {cfg.data.seq_len}, or set 0)")
        self.objective.check_dataset(self.dataset)
        self.total_steps = total_steps(cfg, self.sampler.n_packs, getattr(self.sampler, "available", math.inf))

        # ---- model: meta -> parallelize -> materialise -> init or load
        self.args = dataclasses.replace(model_args(cfg.model, spec), causal=self.objective.causal)
        self.objective_notes = self.objective.check_model(self.args)
        check_vocab(self.dataset.manifest.get("vocab_size", 0), self.args.vocab_size)
        self.tokenizer = tokenizer = self._tokenizer()
        check_tokenizer(self.dataset, tokenizer, cfg.data.allow_tokenizer_mismatch, self.tokenizer_dir())
        self.objective_record = self.objective.setup(self.args.vocab_size, tokenizer)
        check_tensor_parallel(d.dims.tp, self.args.n_heads, self.args.n_kv_heads, self.seq_len,
                              self.args.linear_n_k_heads)
        check_context_parallel(d.dims.cp, cfg.parallelism.cp_mode, d.dims.tp, self.args.n_heads,
                               self.args.n_kv_heads, self.seq_len, cfg.model.attention, len(self.args.linear_layers()),
                               self.args.linear_n_k_heads, self.args.linear_conv_kernel)
        check_expert_parallel(d.dims.ep, self.args.n_experts, cfg.training.compile,
                              "lora" in cfg.model.converters and cfg.lora.experts, d.dims.tp)
        check_pipeline_parallel(cfg, self.args)
        self.pipelined = d.dims.pp > 1
        if self.pipelined:  # this rank's stages, the loss on the last one
            n_micro = cfg.training.global_batch_size // d.dp_world // cfg.training.per_device_batch
            model = build_pipelined_model(spec, self.args, cfg, d.mesh, d.device, self.objective, n_micro,
                                          self.seq_len)
            self.stage_inputs = stage_inputs(model.backend, self.objective.local)  # cp: this rank's part
        else:
            with torch.device("meta"):
                model = spec.model_cls(self.args)
            spec.parallelize_fn(model, d.mesh, cfg, d.device, spec.tp_plan_fn())
        # context parallel: each rank's part of the rows
        self.objective.shard_sequence(sequence_shard(model), d.mesh["cp"].get_group())
        if self.args.n_experts:
            self.objective.set_router_layout(self.args.n_experts, self.args.moe_layers())
            if d.mesh["tp"].size() > 1:  # each tp rank routes its own sequence slice
                self.objective.split_router_tokens(d.mesh["tp"].get_group())
        model.to_empty(device=d.device)
        self._init_weights(model)
        self.model = model

        self.optimizer = spec.build_optimizer_fn(model, cfg.optimizer, cfg.training.global_batch_size)
        # Work a converter asks for after every optimizer step (tensor-wise float8's scales), on this optimizer
        # only: a process-wide hook would keep this model alive, and run, in the next trainer of the process.
        for part in getattr(model, "stage_modules", [model]):
            if callable(after := getattr(part, "after_optimizer_step", None)):
                self.optimizer.register_step_post_hook(lambda opt, args, kwargs, after=after: after())
        self.lr_scheduler = spec.build_lr_scheduler_fn(self.optimizer, cfg.lr_scheduler, self.total_steps)
        whole = flop_model(spec, self.args, cfg, model, self.pipelined)
        self.flops = FlopCounter.from_model(whole, self.args, self.seq_len, self.objective.causal)
        self.decay_line = decay_line(whole, cfg.optimizer, self.args.tie_embeddings)
        self.metrics = spec.build_metrics_fn(cfg, d.rank, d.device, self.total_steps, self.flops)
        exporter = HFExporter(spec, self.args, cfg.checkpoint.hf_export_dtype, self.tokenizer_dir(),
                              cfg.checkpoint.hf_max_shard_size_gb, cfg.checkpoint.hf_generation_config,
                              lora=cfg.lora if "lora" in cfg.model.converters else None,
                              base_model=cfg.model.hf_assets_path if cfg.model.init_from_hf else None,
                              objective=self.objective_record or None)
        self.exporter = exporter
        self.checkpointer = spec.build_checkpointer_fn(cfg, model, self.optimizer, self.lr_scheduler, self.sampler,
                                                       exporter)
        self.validator = self.objective.build_validator(model)  # it keeps the base model's values
        self._converter_hooks("on_start")
        self._banner()
        self.step = self.checkpointer.resume()
        if self.step:
            logger.info(f"[resume] continuing after step {self.step} of {self.total_steps}")
        self.metrics.start(self.step)

    # -- set-up ----------------------------------------------------------------------------------------------
    def _converter_hooks(self, when: str, *args) -> None:
        """The converters' ``on_start`` / ``on_end`` / ``on_step`` hooks (titan_sft.registry.register_converter),
        in order."""
        for name in self.cfg.model.converters:
            hook = converter_hook(name, when)
            if hook is not None:
                hook(self.model, self.cfg, self.exporter, *args)

    def _banner(self) -> None:
        """What this run is, on rank 0, before the first step."""
        cfg, d, m = self.cfg, self.dist, self.dataset.manifest
        where = f"from {cfg.model.hf_assets_path}" if cfg.model.init_from_hf else f"flavor {cfg.model.flavor}"
        B, L = cfg.training.global_batch_size, self.seq_len
        loss_tokens = m.get("n_loss_targets", int(self.dataset.assistant_counts.sum()))
        for line in (
            *([f"[job] {cfg.job.description}"] if cfg.job.description else []),
            f"[init] model {cfg.model.name} ({where}): {self.args.num_params() / 1e6:,.1f}M parameters, attention "
            f"{cfg.model.attention}, objective {cfg.objective.name}",
            f"[init] {d.world} ranks on {len(self.nodes)} node(s): {', '.join(self.nodes)}; {d.dims.describe()}",
            f"[init] data {cfg.data.path or ', '.join(x.name for x in cfg.data.sources)}: {len(self.dataset):,} packs of {L:,} tokens, {m.get('n_tokens', 0):,} "
            f"tokens, {loss_tokens:,} loss tokens",
            f"[init] {B} packs = {B * L:,} tokens per step, {self.total_steps} steps; output {cfg.job.dump_folder}",
            self.decay_line,
            *([tokenizer_line(self.tokenizer, self.args.vocab_size)] if self.tokenizer is not None else []),
            *self.objective_notes,
        ):
            logger.info(line)

    def _init_weights(self, model) -> None:
        """HF weights (each rank reads its own shards) or a seeded random init that is identical for any world
        size (:func:`titan_sft.parallel.init_sharded`)."""
        if self.cfg.model.init_from_hf:
            load_hf_weights(model, self.args, self.cfg.model.hf_assets_path, self.spec)
            self._report_vocab()
        else:
            self._random_init(model)
        # Parameters a converter added (LoRA adapters) are not in the base weights: they draw their own init.
        for m in model.modules():
            if hasattr(m, "reset_converter_parameters"):
                m.reset_converter_parameters(self.cfg.job.seed)

    def _random_init(self, model) -> None:
        with torch.device("meta"):
            reference = self.spec.model_cls(self.args)  # unconverted, unsharded: what the seed's numbers fill
        torch.manual_seed(self.cfg.job.seed)
        init_sharded(model, reference, self.dist.device)

    def _report_vocab(self) -> None:
        if self.dist.rank != 0 or not self.tokenizer_dir():
            return
        try:
            n = len(self.spec.build_tokenizer_fn(self.cfg))
        except (OSError, ValueError):
            logger.info(f"[init] loaded {self.cfg.model.hf_assets_path}; no tokenizer found to compare with "
                        f"vocab_size {self.args.vocab_size}")
            return
        note = "" if n <= self.args.vocab_size else " -- MORE than the model's embeddings: ids past it will fail"
        logger.info(f"[init] loaded {self.cfg.model.hf_assets_path}; tokenizer has {n} tokens, model vocab_size "
                    f"{self.args.vocab_size}{note}")

    def _tokenizer(self):
        """The run's tokenizer, or None when neither the config nor the dataset names one that loads."""
        from titan_sft.data.chat import load_tokenizer
        from titan_sft.hf_io import resolve_hf_dir

        path = self.tokenizer_dir()
        try:
            return load_tokenizer(resolve_hf_dir(path)) if path else None
        except (OSError, ValueError):
            return None

    def tokenizer_dir(self) -> str | None:
        return self.cfg.model.tokenizer_path or self.cfg.model.hf_assets_path or self.dataset.manifest.get("tokenizer")

    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            self.stop_signal = signum

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(sig, handler)

    # -- one step --------------------------------------------------------------------------------------------
    def train_step(self) -> dict:
        batch = self.loader.next()
        skip = self.objective.begin_step(batch, self.dataset, first=batch.step == self.first_step)
        if skip is not None:  # the same on every rank: no forward, no update; the schedule keeps its pace
            lr = self.optimizer.param_groups[0]["lr"]
            self.lr_scheduler.step()
            self.skipped += 1
            logger.warning(f"[skip] {skip} ({self.skipped} skipped so far)")
            return {"split": "train", "step": batch.step + 1, "skipped": True, "reason": skip, "lr": lr,
                    "lr_next": self.optimizer.param_groups[0]["lr"], "n_loss_tokens": 0, "skipped_total": self.skipped}
        t0 = time.perf_counter()
        device = self.dist.device
        loss_sum = torch.zeros((), dtype=torch.float32, device=device)
        n_tokens = head_positions = pairs = 0
        mbs = batch.microbatches
        every_mb = self.cfg.parallelism.grad_reduce == "per_microbatch"
        if self.pipelined:  # the schedule runs every microbatch's forward and backward through the stages
            for mb in mbs:
                pairs += self.flops.attention_pairs(mb.cu_seqlens, *mb.input_ids.shape)
                head_positions += self.objective.head_positions(mb)
                n_tokens += mb.input_ids.numel()
            loss_sum = self.model.forward_backward([mb.to(device, non_blocking=True) for mb in mbs],
                                                   self.stage_inputs)
            mbs = []
        for k, mb in enumerate(mbs):
            # per microbatch: gradients are reduce-scattered into their shards at once (sharded memory);
            # otherwise they stay whole (fp32) until the last microbatch's backward.
            self.model.set_requires_gradient_sync(every_mb or k == len(mbs) - 1)
            pairs += self.flops.attention_pairs(mb.cu_seqlens, *mb.input_ids.shape)  # host metadata: no sync
            head_positions += self.objective.head_positions(mb)
            mb = mb.to(device, non_blocking=True)
            loss = self.objective.loss(self.model, mb)
            loss.backward()
            loss_sum += loss.detach()
            n_tokens += mb.input_ids.numel()
        if self.pipelined:  # the norm over all stages (a tied head's second copy not counted twice)
            grad_norm = clip_grad_norm_(self.model.counted_parameters(), self.cfg.training.max_grad_norm,
                                        self.dist.mesh["pp"].get_group(), self.model.tied_copies())
        else:
            sum_gradients_over_tp(self.model)
            grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_grad_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        self.checkpointer.wait_staged()  # an async save must finish copying the state before it changes
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        flops = self.flops.step_flops(n_tokens, head_positions, pairs)
        loss, n_tokens, flops, sums = self._agree(loss_sum, n_tokens, flops, self.objective.step_sums())
        after = self.objective.end_step(self.model, sums)
        dt = time.perf_counter() - t0
        # lr: the lr this step's update used; lr_next: the next update's (read after the scheduler step)
        return {"split": "train", "step": batch.step + 1, "loss": loss, "lr": lr,
                "lr_next": self.optimizer.param_groups[0]["lr"], "grad_norm": grad_norm,
                **self.objective.step_metrics(sums), **after, "n_tokens": n_tokens, "step_time_s": dt,
                **self.metrics.throughput(n_tokens, flops, dt, self.dist.world), **batch.metrics}

    def _agree(self, loss_sum: torch.Tensor, n_tokens: int, flops: float,
               extra: list[torch.Tensor] = ()) -> tuple[float, int, float, list[float]]:
        """The step's one all-reduce over all ranks, on the compute device: the loss, token and FLOP sums and the
        objective's ``extra`` sums (the tp ranks of a data-parallel rank computed the same loss on the same tokens,
        so only the first of them adds its own; the cp ranks each computed the loss of their part of the rows, and
        all add it, but the tokens and FLOPs of the whole microbatches only once; under pp the last stage holds
        the loss and the first counts the tokens), whether any rank was signalled,
        and the checkpointer's votes. Returns the step's loss, tokens, FLOPs and extra sums; keeps the rest for the
        loop."""
        mesh = self.dist.mesh
        lead = mesh["tp"].get_local_rank() == 0 and (not self.pipelined or self.model.is_last)
        count = (mesh["tp"].get_local_rank() == 0 and mesh["cp"].get_local_rank() == 0
                 and (not self.pipelined or self.model.is_first))
        sums = [x.double().view(1) if lead else torch.zeros(1, dtype=torch.float64, device=x.device)
                for x in (loss_sum, *extra)]
        local = torch.cat([*sums, comm.tensor([n_tokens if count else 0, flops if count else 0.0,
                                               float(self.stop_signal is not None), *self.checkpointer.votes()])])
        agreed = comm.all_reduce(local, what="step statistics").tolist()  # .tolist() waits for the step
        k = len(extra)
        self.signalled, self.checkpoint_votes = agreed[k + 3] > 0, agreed[k + 4:]
        return agreed[0], int(agreed[k + 1]), agreed[k + 2], agreed[1 : k + 1]

    def derived_values(self) -> dict:
        """What the run derived from its config (resolved_config.json's ``derived``, as the reference trainer
        writes): the learning rate after batch scaling, the batch and accumulation, steps and packs consumed,
        whether float8 was asked for and is in the model, and the precision."""
        from titan_sft.optimizer import scaled_lr

        t, opt, d = self.cfg.training, self.cfg.optimizer, self.dist
        lr = scaled_lr(opt, t.global_batch_size)
        n_packs = self.sampler.n_packs
        return {"lr": lr, "lr_scale": lr / opt.lr if opt.lr else None, "lr_scaling": opt.lr_scaling,
                "packs_per_step": t.global_batch_size, "data_parallel_ranks": d.dp_world,
                "per_device_batch": t.per_device_batch,
                "microbatches_per_step": t.global_batch_size // d.dp_world // t.per_device_batch,
                "steps": self.total_steps, "packs_used": self.total_steps * t.global_batch_size,
                "packs_in_dataset": n_packs, "epochs": self.total_steps * t.global_batch_size / n_packs,
                "fp8_requested": t.float8,
                "fp8_active": any("Float8" in type(m).__name__ for m in self.model.modules()),
                "param_dtype": t.param_dtype, "world_size": d.world}

    # -- the run ---------------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        audit = parameter_audit(self.model, self.dist.mesh["pp"].get_group() if self.pipelined else None)
        if self.dist.rank == 0:
            out = Path(cfg.job.dump_folder)
            out.mkdir(parents=True, exist_ok=True)
            cfg.write_resolved(out / "resolved_config.json", derived=self.derived_values())
            if self.objective_record:
                atomic_write_text(out / "objective.json", json.dumps(self.objective_record, indent=2) + "\n")
            atomic_write_text(out / "parameter_audit.json", json.dumps(audit, indent=2) + "\n")
        if not cfg.training.skip_startup_checks:  # on resume too: the backend or its masks may have changed
            t = cfg.training
            hint = ("; float8 tensorwise shares one activation scale across the documents of a row, so this is "
                    "expected with it (rowwise keeps them isolated)") if t.float8 and t.float8_recipe == "tensorwise" else ""
            def check(model):
                check_document_isolation(model, self.args.vocab_size, self.seq_len, self.dist.device,
                                         cfg.model.attention, self.objective.causal, hint,
                                         cp_group=self.dist.mesh["cp"].get_group())

            startup_check_on_first_stage(self.model, check) if self.pipelined else check(self.model)
            logger.info(f"[init] isolation check passed: packed documents do not see each other "
                        f"({cfg.model.attention} attention, {'causal' if self.objective.causal else 'bidirectional'})")
        t_run = time.monotonic()
        self.first_step = self.sampler.step = self.step
        self.skipped = 0
        self.loader.start(self.step)
        while self.step < self.total_steps:
            record = self.train_step()
            if record.get("skipped"):  # a skipped step had no forward: agree on the flags alone
                self._agree(torch.zeros((), device=self.dist.device), 0, 0.0)
            self.metrics.observe(record)
            self.step += 1
            self.sampler.step = self.step  # the data position a checkpoint records
            if self.step % cfg.metrics.log_freq == 0 or self.step == self.total_steps:
                self.metrics.log(record)
            self.checkpointer.maybe_save(self.step, self.total_steps, self.checkpoint_votes)
            self.checkpointer.maybe_export(self.step, self.total_steps)
            self._converter_hooks("on_step", self.step, self.total_steps)
            if self.validator:
                with high_precision_matmuls(self.model):  # validation stays bf16 when training in float8
                    records = self.validator.maybe_validate(self.step, self.total_steps, self.model, self.checkpointer)
                for rec in records:
                    self.metrics.log(rec)
            planned_stop = self.step == cfg.training.stop_at_step and self.step < self.total_steps
            if self.signalled or planned_stop:  # every rank stops at the same step
                if cfg.checkpoint.enable:
                    self.checkpointer.save(self.step, temp=True)
                why = "training.stop_at_step" if planned_stop else f"signal {self.stop_signal or '(on another rank)'}"
                saved = "; checkpoint saved" if cfg.checkpoint.enable else " (checkpoint.enable is false: not saved)"
                logger.info(f"[stop] {why}: stopped after step {self.step}{saved}")
                stop_file = os.environ.get("TITAN_SFT_STOP_FILE")  # the SLURM script requeues when it exists
                if not planned_stop and stop_file and self.dist.rank == 0:
                    Path(stop_file).write_text(f"{self.step}\n")
                return
        elapsed = int(time.monotonic() - t_run)
        logger.info(f"[done] {self.step} steps in {elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}"
                    + (f" ({self.step - self.first_step} in this run)" if self.first_step else "")
                    + (f", {self.skipped} skipped (empty loss groups)" if self.skipped else ""))
        self._converter_hooks("on_end")

    def close(self) -> None:
        self.checkpointer.close()
        self.loader.close()
        self.metrics.close()
        shutdown()


def decay_line(model: torch.nn.Module, opt, tied: bool) -> str:
    """The start-up line saying what weight decay applies to (the whole model's trainable parameters)."""
    from titan_sft.optimizer import decay_groups

    decay, no_decay = decay_groups(model, opt.decay_mask)
    params = dict(model.named_parameters())
    count = lambda names: sum(params[n].numel() for n in names)  # noqa: E731
    head = ("the head is tied to the embedding" if tied else
            "the untied head " + ("decays" if "output.weight" in decay else "does not decay" if "output.weight"
                                  in no_decay else "is frozen"))
    return (f"[init] weight decay {opt.weight_decay:g} ({opt.decay_mask} mask) on {len(decay)} tensors "
            f"({count(decay) / 1e6:,.2f}M parameters); not on {len(no_decay)} ({count(no_decay) / 1e6:,.2f}M: "
            f"{'norms, token embedding, biases' if opt.decay_mask == 'recipe' else 'none'}); {head}")


def tokenizer_line(tokenizer, vocab_size: int) -> str:
    """The start-up line about the tokenizer: its size against the embedding table and its padding token."""
    n, pad = len(tokenizer), tokenizer.pad_token_id
    padding = (f"pad token {tokenizer.pad_token!r} (id {pad})" if pad is not None
               else "no pad token (packs are padded with the dataset's pad id)")
    return (f"[init] tokenizer: {n:,} tokens, embedding rows {vocab_size:,} ({vocab_size - n:,} rows past it); "
            f"{padding}")


def flop_model(spec, args, cfg: JobConfig, model: torch.nn.Module, pipelined: bool) -> torch.nn.Module:
    """The model whose matmul weights the FLOP counter counts: ``model`` itself, or under pipeline parallel (a
    rank holds some layers) the whole model on the meta device with the config's converters applied, so that
    LoRA's frozen base counts 4 FLOPs per weight and its adapters count, as on one rank."""
    if not pipelined:
        return model
    with torch.device("meta"):
        whole = spec.model_cls(args)
    for name in cfg.model.converters:
        get_converter(name)(whole, cfg, torch.device("meta"))
    return whole


def parameter_audit(model: torch.nn.Module, pp_group=None) -> dict:
    """Trainable and frozen parameter counts in all and by module type, after every conversion (the reference
    trainer's parameter_audit.json). DTensor shards count with their global size; a tied embedding and head
    count once (as the embedding). Under pipeline parallel (``pp_group``; call it on every rank) the counts of all
    stages are summed, the last stage's copy of a tied head not counted."""
    from titan_sft.parallel.distributed import unwrapped_name

    tied = {id(p) for p in getattr(model, "tied_copies", list)()}
    seen = set(tied)
    by_type: dict[str, dict[str, int]] = {}
    for module in model.modules():
        for _, p in module.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            entry = by_type.setdefault(type(module).__name__, {"trainable": 0, "frozen": 0})
            entry["trainable" if p.requires_grad else "frozen"] += p.numel()
    names = {unwrapped_name(n) for n, p in model.named_parameters() if p.requires_grad and id(p) not in tied}
    if pp_group is not None:
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, (by_type, names), group=pp_group)
        by_type, names = {}, set()
        for part, part_names in parts:
            names |= part_names
            for name, counts in part.items():
                entry = by_type.setdefault(name, {"trainable": 0, "frozen": 0})
                for k in entry:
                    entry[k] += counts[k]
    totals = {k: sum(e[k] for e in by_type.values()) for k in ("trainable", "frozen")}
    return {**totals, "by_module_type": dict(sorted(by_type.items())), "trainable_names": sorted(names)}


def parse_cli(argv: list[str]) -> tuple[str | None, bool, list[str]]:
    """(``--config`` path, ``--dry-run`` given, the other arguments: the config overrides)."""
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
    return config_path, dry, rest


def check_output_folder(folder: str) -> None:
    """Raises ConfigError (one line) unless ``job.dump_folder`` is a folder this process can write in, or can be
    created: probed in its nearest existing ancestor, creating nothing that stays."""
    path = Path(folder).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"config key 'job.dump_folder': cannot create {folder} ({existing} is a file)")
    try:  # a real probe: os.access says yes to root even where nothing can be created (/proc, read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=".write-probe-", dir=existing))
    except OSError as e:
        what = f"cannot write in {folder}" if existing == path else f"cannot create {folder}"
        raise ConfigError(f"config key 'job.dump_folder': {what} ({e.strerror})") from None


def report_error(error) -> None:
    """The one ``error: ...`` line, in a single write: under torchrun (``python -u``) every rank reports it into the
    same pipe, and print()'s separate write of the newline lets two ranks' lines run together."""
    sys.stderr.write(f"error: {error}\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # A crash in native code (a collective's transport, a kernel) prints every thread's Python stack to stderr
    # instead of only the launcher's "Signal 11".
    if not faulthandler.is_enabled():  # pytest has its own when the tests call main() in-process
        faulthandler.enable(file=sys.__stderr__)
    if "--help" in argv or "-h" in argv:
        print(config_help())
        return 0
    config_path, dry, rest = parse_cli(argv)
    try:
        cfg = load_config(config_path, rest)
        for module in cfg.job.custom_imports:  # outside code registers its models, objectives, converters
            importlib.import_module(module)
        if dry:
            from titan_sft.dry_run import dry_run

            print(dry_run(cfg))
            return 0
        check_output_folder(cfg.job.dump_folder)
        trainer = Trainer(cfg)
    except (ConfigError, FileNotFoundError, ValueError, KeyError, ModuleNotFoundError) as e:
        report_error(e.args[0] if isinstance(e, KeyError) and e.args else e)
        return 2
    try:
        trainer.train()
    except (StartupCheckError, BatchError) as e:
        report_error(e)
        return 2
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    exit_process(main())
