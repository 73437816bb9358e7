"""The recipe's learning-rate schedule (recipe item 3): warmup -> stable -> decay, Levanter's arithmetic."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from titan_sft.config import LRScheduler as LRConfig


def _steps(value: float, total: int, key: str) -> int:
    """A value <= 1 is a fraction of the total (int(v * T)); a larger one a whole number of steps."""
    if value < 0:
        raise ValueError(f"lr_scheduler.{key}: must be >= 0, got {value}")
    if value <= 1:
        return int(value * total)
    if not float(value).is_integer():
        raise ValueError(f"lr_scheduler.{key}: {value} is neither a fraction <= 1 nor a whole number of steps")
    return int(value)


@dataclass(frozen=True)
class Schedule:
    total: int
    warmup: int
    stable: int
    decay: int
    min_lr_ratio: float
    decay_type: str

    @classmethod
    def from_config(cls, cfg: LRConfig, total: int) -> "Schedule":
        warmup = min(_steps(cfg.warmup, total, "warmup"), total)
        decay = min(_steps(cfg.decay, total, "decay"), total - warmup)
        return cls(total, warmup, total - warmup - decay, decay, cfg.min_lr_ratio, cfg.decay_type)

    def multiplier(self, step: int) -> float:
        """Multiplier of the base lr for the update at 0-based optimizer step ``step``."""
        if step < self.warmup:
            return step / self.warmup  # the first update uses lr 0
        if step < self.warmup + self.stable or self.decay == 0:
            return 1.0
        t = min(step - self.warmup - self.stable, self.decay)
        a = self.min_lr_ratio
        if self.decay_type == "cosine":
            return (1 - a) * 0.5 * (1 + math.cos(math.pi * t / self.decay)) + a
        if self.decay_type == "linear":
            return 1 + (a - 1) * t / self.decay
        return 1.0


def total_steps(cfg, n_packs: int, available: float = math.inf) -> int:
    """``training.steps``, or 0 = ``training.epochs`` (8, the recipe) over the packed data:
    ceil(epochs * n_packs / global batch). ``available``: the examples the data can supply (a mixture whose every
    source is capped by ``max_epochs``); the epochs are then cut to it, and explicit steps must fit."""
    from titan_sft.config import ConfigError

    B = cfg.training.global_batch_size
    fit = math.inf if math.isinf(available) else int(available // B)
    if cfg.training.steps:
        if cfg.training.steps > fit:
            raise ConfigError(f"config key 'training.steps': {cfg.training.steps}, but the mixture of data.sources "
                              f"(every source capped by max_epochs) supplies {int(available)} examples = {fit} steps")
        return cfg.training.steps
    return min(math.ceil(cfg.training.epochs * n_packs / B), fit)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRConfig, total_steps: int):
    """A LambdaLR whose lr after ``k`` scheduler steps is the lr of 0-based update ``k``."""
    schedule = Schedule.from_config(cfg, total_steps)
    # A plain function: LambdaLR's state_dict skips functions (the schedule is rebuilt from config on resume).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule.multiplier(step))


def resume_lr_scheduler(scheduler, state: dict) -> tuple[float, float]:
    """Puts ``scheduler`` (built from the current config, after the optimizer state was loaded) at the position a
    checkpoint's ``state`` (its ``state_dict()``) records, following the current config's schedule: a changed
    ``training.steps``, ``lr_scheduler`` or ``optimizer.lr`` applies from the next update on, as it would have had
    the run started with it. Returns (the checkpoint's lr, the current schedule's lr) of that next update."""
    if not hasattr(scheduler, "lr_lambdas"):  # another registered scheduler: its own state as saved
        scheduler.load_state_dict(state)
        lr = scheduler.optimizer.param_groups[0]["lr"]
        return lr, lr
    old = scheduler.optimizer.param_groups[0]["lr"]  # the loaded optimizer state's, set by the old schedule
    scheduler.last_epoch = state["last_epoch"]
    for group, base, fn in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * fn(scheduler.last_epoch)
    return old, scheduler.optimizer.param_groups[0]["lr"]
