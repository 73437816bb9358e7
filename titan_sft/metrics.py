"""Step metrics: throughput and MFU, a progress line on rank 0, metrics.jsonl, TensorBoard, optional W&B.

Two MFUs, both against the GPU's dense bf16 peak (recomputation under activation checkpointing is not counted):

* ``mfu``: the work each step actually did (:class:`FlopCounter`). Every matmul weight counts 6 FLOPs per token
  it is applied to (forward 2, input gradient 2, weight gradient 2), or 4 when it is frozen (no weight gradient:
  LoRA's base); the output head is counted wherever it runs, tied to the embedding or not (causal LM: every
  position; masked diffusion: the masked positions only); attention counts 12 * L * H * D FLOPs per (query, key)
  pair it computes, per document of the packed rows: n (n + 1) / 2 pairs for a causal document of n tokens,
  n ** 2 bidirectional.
* ``mfu_torchtitan``: torchtitan's convention, 6 * N + 12 * L * H * D * S per token, with N the parameters less
  the token embedding (a tied head is then not counted) and S the row length (full attention over the whole row,
  no causal halving, no document masking). Comparable with torchtitan's logs; not with ``mfu``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_sft.atomic import atomic_write_text
from titan_sft.config import JobConfig
from titan_sft.log import logger

# Dense bf16 peak FLOP/s per GPU model (no sparsity).
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12, "GB200": 2450e12}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def torchtitan_flops_per_token(args, seq_len: int) -> float:
    """torchtitan's count: 6 * (active parameters less the embedding) + 12 * L * H * D * S over the L full-attention
    layers, plus the chunked delta rule's work in Gated DeltaNet layers (:func:`linear_attention_flops`)."""
    n = args.num_params(active=True) - args.vocab_size * args.dim
    return 6 * n + 12 * _full_attention_layers(args) * args.n_heads * args.head_dim * seq_len + \
        linear_attention_flops(args, seq_len)


def _full_attention_layers(args) -> int:
    return args.n_layers - len(args.linear_layers())


def linear_attention_flops(args, seq_len: int) -> float:
    """Training FLOPs per token of the Gated DeltaNet layers' recurrence (3x the forward's: backward is twice it),
    beyond their projections and convs, which count as weights."""
    from titan_sft.models.gated_deltanet import gated_delta_rule_flops

    n = len(args.linear_layers())
    if not n:
        return 0.0
    return 3.0 * n * gated_delta_rule_flops(seq_len, args.linear_n_v_heads, args.linear_k_head_dim,
                                            args.linear_v_head_dim)


@dataclass
class FlopCounter:
    """Training FLOPs of a step from what it computed (see the module docstring)."""

    body_per_token: float  # the blocks' matmuls, per input token
    head_per_position: float  # the output head, per position it is applied to
    per_pair: float  # attention, per (query, key) pair: 12 * L * H * D over the L full-attention layers
    causal: bool
    torchtitan_per_token: float

    @classmethod
    def from_model(cls, model: torch.nn.Module, args, seq_len: int, causal: bool) -> "FlopCounter":
        """Counts the matmul weights of the (parallelized) model: DTensor shards count with their global size.
        Parameters of fewer than 2 dimensions (norms) are not matmuls; the embedding is a lookup."""
        embedding, head = model.tok_embeddings.weight, model.output.weight
        # Routed experts: a token passes through k of the E experts, so only k / E of their weights count.
        expert_share = {id(p): args.n_experts_per_tok / args.n_experts for name, p in model.named_parameters()
                        if ".experts." in name}
        body = 0
        for name, p in model.named_parameters():
            if p.ndim >= 2 and p is not embedding and p is not head:
                body += (6 if p.requires_grad else 4) * p.numel() * expert_share.get(id(p), 1.0)
        head_flops = (6 if head.requires_grad else 4) * head.numel()
        body += linear_attention_flops(args, seq_len)  # Gated DeltaNet's recurrence, per token
        return cls(float(body), float(head_flops), 12.0 * _full_attention_layers(args) * args.n_heads * args.head_dim,
                   causal, torchtitan_flops_per_token(args, seq_len))

    def attention_pairs(self, cu_seqlens: torch.Tensor | None, rows: int, row_len: int) -> int:
        """(query, key) pairs attention computes for one microbatch: per document (``cu_seqlens`` over the flat
        rows; None: one document per row)."""
        n = (torch.full((rows,), row_len, dtype=torch.int64) if cu_seqlens is None
             else (cu_seqlens[1:] - cu_seqlens[:-1]).to("cpu", torch.int64))
        return int((n * (n + 1) // 2).sum() if self.causal else (n * n).sum())

    def step_flops(self, n_tokens: int, head_positions: int, pairs: int) -> float:
        return self.body_per_token * n_tokens + self.head_per_position * head_positions + self.per_pair * pairs


class MetricsLogger:
    """Rank 0 writes; every rank may call. ``flops`` (a :class:`FlopCounter`) feeds both MFUs (null where the
    device's peak is unknown)."""

    def __init__(self, job_cfg: JobConfig, rank: int, device: torch.device, total_steps: int, flops: FlopCounter):
        cfg, dump_folder = job_cfg.metrics, job_cfg.job.dump_folder
        self.rank, self.cfg, self.device, self.total = rank, cfg, device, total_steps
        self.peak = peak_flops(device)
        self.flops = flops
        self.t_start = time.monotonic()
        self.start_step: int | None = None
        self._losses: list[float] = []  # train losses since the last logged record (the running loss)
        self.jsonl = self.tb = self.wandb = self.bar = None
        self.job_cfg = job_cfg
        if rank != 0:
            return
        if cfg.progress_bar is True or (cfg.progress_bar == "auto" and sys.stderr.isatty()):
            self.bar = ProgressBar(total_steps)
        Path(dump_folder).mkdir(parents=True, exist_ok=True)
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, id=cfg.wandb_id or None, resume="allow",
                                    config=job_cfg.to_dict(), dir=dump_folder, notes=job_cfg.job.description or None,
                                    name=cfg.wandb_run_name or Path(dump_folder).resolve().name)

    def start(self, completed_steps: int) -> None:
        """Opens the records of a run that continues after ``completed_steps`` (0: a fresh start).

        Records of later steps are from an attempt whose progress was lost (a kill after the last checkpoint, a
        damaged newest checkpoint): they are dropped from metrics.jsonl (rewritten through a ``*.partial``) and
        purged from TensorBoard, so every consumer sees each step once, as the redone steps log it again.
        """
        if self.rank != 0:
            return
        folder = Path(self.job_cfg.job.dump_folder)
        path = folder / "metrics.jsonl"
        if path.exists():
            lines = path.read_text().splitlines(keepends=True)
            kept = [line for line in lines if _record_step(line) <= completed_steps]
            if len(kept) < len(lines):
                atomic_write_text(path, "".join(kept))
                logger.info(f"[resume] dropped {len(lines) - len(kept)} records past step {completed_steps} from "
                            f"{path} (their steps run again)")
        self.jsonl = open(path, "a")
        if self.cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: TensorBoard hides the events of the steps from there on that an earlier attempt wrote
            self.tb = SummaryWriter(str(folder / "tb"), purge_step=completed_steps + 1)
            if self.job_cfg.job.description and not completed_steps:
                self.tb.add_text("description", self.job_cfg.job.description)

    def throughput(self, n_tokens: int, step_flops: float, seconds: float, world: int) -> dict:
        """Of one step, per device: ``tokens_per_s`` (input tokens), ``tflops`` (done, :class:`FlopCounter`),
        ``mfu`` and ``mfu_torchtitan`` (percent, None where the device's peak is unknown), ``memory_gib`` (peak
        allocated by tensors) and ``memory_reserved_gib`` (peak held by the caching allocator, what the GPU really
        lends: torchtitan reports this one), both None on CPU. ``n_tokens`` and ``step_flops`` are totals over all
        ranks."""
        tokens_per_s = n_tokens / world / seconds
        flops_per_s = step_flops / world / seconds
        mfu = 100 * flops_per_s / self.peak if self.peak else None
        titan = 100 * tokens_per_s * self.flops.torchtitan_per_token / self.peak if self.peak else None
        cuda = self.device.type == "cuda"
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if cuda else None
        reserved = torch.cuda.max_memory_reserved(self.device) / 2**30 if cuda else None
        return {"tokens_per_s": tokens_per_s, "tflops": flops_per_s / 1e12, "mfu": mfu, "mfu_torchtitan": titan,
                "memory_gib": memory, "memory_reserved_gib": reserved}

    def observe(self, record: dict) -> None:
        """Every train step's record, logged or not: feeds ``loss_running`` (the mean loss since the last log) and
        the progress bar."""
        if "loss" in record and not record.get("skipped"):
            self._losses.append(record["loss"])
        if self.bar:
            self.bar.update(record)

    def log(self, record: dict) -> None:
        """Writes one record (train or validation); prints a progress line for train records."""
        if self.rank != 0:
            return
        if record.get("split", "train") == "train" and self._losses:
            record = {**record, "loss_running": sum(self._losses) / len(self._losses)}
            self._losses = []
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        split = record.get("split", "train")
        step = record["step"]
        # A held-out source's record gets curves of its own (validation/<source>/loss).
        split_tag = f"{split}/{record['source']}" if record.get("source") else split
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                if self.tb:
                    self.tb.add_scalar(f"{split_tag}/{key}", value, step)
            elif isinstance(value, dict) and self.tb:  # one curve per entry (per MoE layer, per data source)
                for tag, v in _flatten(value, f"{split_tag}/{key}"):
                    self.tb.add_scalar(tag, v, step)
        if self.wandb:
            self.wandb.log(wandb_payload(record, split_tag, self.cfg.wandb_reference_keys), step=step)
        if record.get("skipped"):
            return
        if split == "train":
            if self.start_step is None:
                self.start_step, self.t_start = step - 1, time.monotonic() - record["step_time_s"]
            done = step - self.start_step
            eta = (time.monotonic() - self.t_start) / done * (self.total - step)
            mem = (f" mem {record['memory_gib']:.1f}/{record['memory_reserved_gib']:.1f}GiB (alloc/reserved)"
                   if record.get("memory_gib") is not None else "")
            mfu = f" mfu {record['mfu']:.1f}%" if record.get("mfu") is not None else ""
            logger.info(f"step {step}/{self.total}  loss {record['loss']:.4f} (avg {record.get('loss_running', record['loss']):.4f})  "
                        f"lr {record['lr']:.3e}  "
                        f"grad_norm {record['grad_norm']:.3f}  tok/s/dev {record['tokens_per_s']:,.0f}{mfu}{mem}  "
                        f"eta {_fmt_time(eta)}")
        else:
            fields = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in record.items()
                               if k not in ("split", "step"))
            logger.info(f"[{split}] step {step}: {fields}")

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


# The Levanter-port SFT script's W&B train keys: its name -> the record field holding its definition.
REFERENCE_WANDB_KEYS = {"train/lr": "lr_next", "train/tokens": "n_loss_tokens", "train/step_time": "step_time_s"}


def wandb_payload(record: dict, split_tag: str, reference_keys: bool) -> dict:
    """A record as W&B logs it: ``<split>/<field>``; with ``reference_keys`` a train record also carries the
    reference script's keys (:data:`REFERENCE_WANDB_KEYS`), and titan_sft's own ``lr`` (the step's) becomes
    ``train/lr_step`` since the script's ``train/lr`` is the next update's."""
    out = {f"{split_tag}/{k}": v for k, v in record.items() if k not in ("split", "source")}
    if reference_keys and split_tag == "train":
        if "lr" in record:
            out["train/lr_step"] = record["lr"]
        out.update({key: record[field] for key, field in REFERENCE_WANDB_KEYS.items() if field in record})
    return out


class ProgressBar:
    """A tqdm bar on stderr: steps done of the run, the step's loss and the running mean since the start of this
    process, lr, rate and ETA. titan_sft's log lines are written above it (through tqdm, which redraws the bar)."""

    def __init__(self, total: int, file=None):
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(total=total, unit="step", file=file or sys.stderr, dynamic_ncols=True, leave=True,
                        mininterval=0.5, smoothing=0.1)
        self.redirect = logging_redirect_tqdm(loggers=[logger])
        self.redirect.__enter__()
        self.loss_sum, self.n = 0.0, 0

    def update(self, record: dict) -> None:
        if self.bar.n == 0 and record["step"] > 1:  # a resumed run: count from where it starts
            self.bar.n = self.bar.last_print_n = record["step"] - 1
        if "loss" in record and not record.get("skipped"):
            self.loss_sum, self.n = self.loss_sum + record["loss"], self.n + 1
            self.bar.set_postfix_str(f"loss {record['loss']:.4f} avg {self.loss_sum / self.n:.4f} "
                                     f"lr {record['lr']:.2e}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()
        self.redirect.__exit__(None, None, None)


def _record_step(line: str) -> float:
    """The step of one metrics.jsonl line; a torn last line (a kill mid-write) counts as past every step."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return math.inf


def _flatten(tree: dict, prefix: str):
    """(tag, number) for every number in a nested dict, tags joined with '/'."""
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flatten(v, f"{prefix}/{k}")
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            yield f"{prefix}/{k}", v


def _fmt_time(sec: float) -> str:
    sec = int(sec)
    return f"{sec // 3600}:{sec % 3600 // 60:02d}:{sec % 60:02d}"
