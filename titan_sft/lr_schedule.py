"""Learning-rate schedules: the recipe's (item 3: warmup -> stable -> decay, Levanter's arithmetic) and, for runs
moved from a transformers script, transformers' named schedulers (``lr_scheduler.name``), step for step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

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


def warmup_steps(cfg: LRConfig, total: int) -> int:
    """The warmup's length in steps: ``lr_scheduler.warmup_steps`` when set (>= 0), else ``lr_scheduler.warmup``
    (a fraction of ``total`` or a whole number of steps)."""
    return cfg.warmup_steps if cfg.warmup_steps >= 0 else _steps(cfg.warmup, total, "warmup")


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
        warmup = min(warmup_steps(cfg, total), total)
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


def transformers_multiplier(cfg: LRConfig, total: int, lr: float) -> Callable[[int], float]:
    """transformers' own multiplier function for ``lr_scheduler.name`` (what its ``get_scheduler(name, optimizer,
    num_warmup_steps, num_training_steps)`` puts in the LambdaLR it returns), for base lr ``lr`` (polynomial
    decays to an absolute ``lr_end``, so its multiplier depends on it). Its defaults hold: one cycle, power 1,
    ``lr_end`` 1e-7; cosine_with_min_lr takes ``min_lr_ratio`` as its ``min_lr_rate``."""
    from transformers import get_scheduler

    holder = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)  # get_scheduler reads the lr from it
    extra = {"min_lr_rate": cfg.min_lr_ratio} if cfg.name == "cosine_with_min_lr" else None
    built = get_scheduler(cfg.name, holder, num_warmup_steps=warmup_steps(cfg, total), num_training_steps=total,
                          scheduler_specific_kwargs=extra)
    return built.lr_lambdas[0]


def lr_multiplier(cfg: LRConfig, total: int, lr: float) -> Callable[[int], float]:
    """The multiplier of the base lr for 0-based update ``k``, as ``lr_scheduler`` (``name``) defines it."""
    if cfg.name == "levanter":
        return Schedule.from_config(cfg, total).multiplier
    return transformers_multiplier(cfg, total, lr)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRConfig, total_steps: int):
    """A LambdaLR whose lr after ``k`` scheduler steps is the lr of 0-based update ``k`` (the convention of
    transformers' schedulers too: the first update uses multiplier(0))."""
    fn = lr_multiplier(cfg, total_steps, optimizer.defaults["lr"])
    # A plain function: LambdaLR's state_dict skips functions (the schedule is rebuilt from config on resume).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: fn(step))


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
