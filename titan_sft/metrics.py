"""Step metrics: throughput and MFU, a progress line on rank 0, metrics.jsonl, TensorBoard, optional W&B.

MFU follows torchtitan's convention: FLOPs per token = 6 * N + 12 * n_layers * n_heads * head_dim * seq_len,
with N the parameters excluding the token embedding, against the GPU's dense bf16 peak. (Document masking makes
the true attention cost lower; the convention counts full causal attention, as torchtitan does.)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

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


def flops_per_token(args, seq_len: int) -> float:
    n = args.num_params() - args.vocab_size * args.dim  # embedding lookups are not matmuls
    return 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * seq_len


class MetricsLogger:
    """Rank 0 writes; every rank may call. ``flops_per_token`` feeds MFU (null where the peak is unknown)."""

    def __init__(self, job_cfg: JobConfig, rank: int, device: torch.device, total_steps: int, flops_per_token: float):
        cfg, dump_folder = job_cfg.metrics, job_cfg.job.dump_folder
        self.rank, self.cfg, self.device, self.total = rank, cfg, device, total_steps
        self.peak = peak_flops(device)
        self.flops_per_token = flops_per_token
        self.t_start = time.monotonic()
        self.start_step: int | None = None
        self._losses: list[float] = []  # train losses since the last logged record (the running loss)
        self.jsonl = self.tb = self.wandb = None
        if rank != 0:
            return
        Path(dump_folder).mkdir(parents=True, exist_ok=True)
        self.jsonl = open(Path(dump_folder) / "metrics.jsonl", "a")
        if cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(Path(dump_folder) / "tb"))
            if job_cfg.job.description:
                self.tb.add_text("description", job_cfg.job.description)
        if cfg.wandb_project:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb_project, id=cfg.wandb_id or None, resume="allow",
                                    config=job_cfg.to_dict(), dir=dump_folder, notes=job_cfg.job.description or None,
                                    name=cfg.wandb_run_name or None)

    def throughput(self, n_tokens: int, seconds: float, world: int) -> dict:
        """``tokens_per_s`` (input tokens per second per device), ``mfu`` (percent, None where the device's peak
        is unknown) and ``memory_gib`` (peak device memory, None on CPU) of one step."""
        tokens_per_s = n_tokens / world / seconds
        mfu = 100 * tokens_per_s * self.flops_per_token / self.peak if self.peak else None
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        return {"tokens_per_s": tokens_per_s, "mfu": mfu, "memory_gib": memory}

    def observe(self, record: dict) -> None:
        """Every train step's record, logged or not: feeds ``loss_running`` (the mean loss since the last log)."""
        if "loss" in record and not record.get("skipped"):
            self._losses.append(record["loss"])

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
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                if self.tb:
                    self.tb.add_scalar(f"{split}/{key}", value, step)
        if self.wandb:
            self.wandb.log({f"{split}/{k}": v for k, v in record.items() if k != "split"}, step=step)
        if record.get("skipped"):
            return
        if split == "train":
            if self.start_step is None:
                self.start_step, self.t_start = step - 1, time.monotonic() - record["step_time_s"]
            done = step - self.start_step
            eta = (time.monotonic() - self.t_start) / done * (self.total - step)
            mem = f" mem {record['memory_gib']:.1f}GiB" if record.get("memory_gib") is not None else ""
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
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            self.wandb.finish()


def _fmt_time(sec: float) -> str:
    sec = int(sec)
    return f"{sec // 3600}:{sec % 3600 // 60:02d}:{sec % 60:02d}"
