"""Typed run configuration: TOML file + ``--section.key VALUE`` overrides -> ``JobConfig``.

Every key lives in a dataclass below, so an unknown section or key, a value of the wrong type, or an
impossible combination is caught here, before any work, with one line that names the key. The names of
``shared/spec/contracts.md`` are fixed; the rest are ours.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A bad config value; the message is one line naming the key and what is allowed."""


@dataclass
class Job:
    dump_folder: str = "./outputs"
    description: str = ""
    seed: int = 0


@dataclass
class Model:
    name: str = "qwen3"
    flavor: str = "debug"
    # HF directory for config, tokenizer and (with init_from_hf) weights.
    hf_assets_path: str = ""
    init_from_hf: bool = False
    # Tokenizer directory; empty means hf_assets_path.
    tokenizer_path: str = ""
    attention: Literal["sdpa", "flex", "flash_varlen"] = "sdpa"
    reset_positions_per_document: bool = False


@dataclass
class Data:
    path: str = ""
    validation_path: str = ""
    shuffle: bool = False
    shuffle_seed: int = 0


@dataclass
class Training:
    steps: int = 0  # 0 = 8 epochs over the packed data (the recipe)
    # Stop cleanly (with a checkpoint) after this many completed steps, keeping the schedule of `steps`;
    # 0 runs to the end. Splits a long job into chunks (and tests resumption).
    stop_at_step: int = 0
    global_batch_size: int = 8
    per_device_batch: int = 1
    loss_groups: int = 1
    max_grad_norm: float = 1.0
    param_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    loss_chunk_size: int = 4096
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    compile: bool = False
    float8: bool = False
    skip_startup_checks: bool = False
    deterministic: bool = False


@dataclass
class Optimizer:
    name: Literal["adamw"] = "adamw"
    lr: float = 2e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    fused: bool = False
    foreach: bool = True  # ignored when fused


@dataclass
class LRScheduler:
    warmup: float = 0.0  # <= 1: fraction of total steps; > 1: whole steps
    decay: float = 1.0  # same rule; the rest of the steps are stable
    min_lr_ratio: float = 0.0
    decay_type: Literal["cosine", "linear", "constant"] = "cosine"


@dataclass
class Checkpoint:
    enable: bool = True
    interval: int = 20
    hf_export_interval: int = 100  # 0: only after the final step; -1: never
    temp_interval_minutes: float = 10.0
    keep_latest_k: int = 0  # 0 keeps all
    resume: str = "auto"  # auto | none | a checkpoint path
    # "async": the state is staged to host memory and written by a background thread while training goes on;
    # the checkpoint is renamed into place (complete) once written, at the latest before the next save.
    async_mode: Literal["disabled", "async"] = "disabled"
    hf_export_dtype: Literal["bfloat16", "float32", "float16"] = "bfloat16"
    hf_max_shard_size_gb: float = 5.0


@dataclass
class Metrics:
    log_freq: int = 1
    enable_tensorboard: bool = True
    wandb_project: str = ""
    wandb_id: str = ""


@dataclass
class Validation:
    # JSONL of held-out chats; after the final export, rank 0 greedily decodes each prompt with transformers and
    # reports exact-match accuracy of the last assistant turn. Empty disables it.
    generation_eval_path: str = ""
    max_new_tokens: int = 32
    max_examples: int = 200


@dataclass
class Parallelism:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1 = the rest of the ranks
    tp: int = 1


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    parallelism: Parallelism = field(default_factory=Parallelism)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def write_resolved(self, path: str | Path) -> None:
        """Writes ``resolved_config.json`` atomically (temporary sibling, then rename)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".partial")
        tmp.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        tmp.replace(path)


# --------------------------------------------------------------------------------------------------
# Parsing and coercion


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))


def _coerce(key: str, tp: Any, value: Any, from_cli: bool) -> Any:
    """Converts ``value`` to ``tp``; CLI values arrive as strings, TOML values keep their types."""
    origin = typing.get_origin(tp)
    bad = ConfigError(f"config key '{key}': got {value!r}, expected {_describe(tp)}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise bad
        return value
    if origin is list:
        (elem,) = typing.get_args(tp)
        if from_cli and isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()]
        if not isinstance(value, list):
            raise bad
        return [_coerce(key, elem, v, from_cli) for v in value]
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
            return value.lower() in ("true", "1", "yes")
        raise bad
    if tp is int:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is float:
        if isinstance(value, bool):
            raise bad
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                raise bad from None
        raise bad
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad
    raise TypeError(f"unsupported config type {tp} for {key}")  # a bug in this file, not user input


def _set(cfg: JobConfig, section: str, key: str, value: Any, from_cli: bool, where: str) -> None:
    sections = _sections()
    if section not in sections:
        raise ConfigError(
            f"{where}unknown config section '[{section}]'{_closest(section, list(sections))}; "
            f"known: {', '.join(sections)}"
        )
    sec_obj = getattr(cfg, section)
    hints = typing.get_type_hints(type(sec_obj))
    if key not in hints:
        raise ConfigError(
            f"{where}unknown config key '{section}.{key}'{_closest(key, list(hints))}; "
            f"known in [{section}]: {', '.join(hints)}"
        )
    try:
        setattr(sec_obj, key, _coerce(f"{section}.{key}", hints[key], value, from_cli))
    except ConfigError as e:
        raise ConfigError(f"{where}{e}") from None


def parse_overrides(args: list[str]) -> list[tuple[str, str, str]]:
    """Parses ``--section.key VALUE`` / ``--section.key=VALUE`` into (section, key, value) triples.

    A key followed by another ``--`` option or nothing is a boolean switch set to ``true``.
    """
    out: list[tuple[str, str, str]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument '{arg}': overrides look like --section.key VALUE")
        name, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            else:
                value = "true"
        section, _, key = name.partition(".")
        out.append((section.replace("-", "_"), key.replace("-", "_"), value))
        i += 1
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> JobConfig:
    """Builds a validated ``JobConfig`` from an optional TOML file and CLI overrides.

    Args:
        path: TOML file; ``None`` uses the defaults.
        overrides: ``["--training.steps", "20", "--optimizer.lr=1e-4", ...]``.

    Raises:
        ConfigError: one line naming the file or key and what is allowed.
    """
    cfg = JobConfig()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file '{path}' does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        for section, table in data.items():
            if not isinstance(table, dict):
                raise ConfigError(f"{path}: top-level key '{section}' must be a [section] table")
            for key, value in table.items():
                _set(cfg, section, key, value, from_cli=False, where=f"{path}: ")
    for section, key, value in parse_overrides(overrides or []):
        _set(cfg, section, key, value, from_cli=True, where="command line: ")
    validate(cfg)
    return cfg


def validate(cfg: JobConfig) -> None:
    """Checks ranges and combinations that a single key's type cannot express."""

    def need(ok: bool, key: str, allowed: str, value: Any) -> None:
        if not ok:
            raise ConfigError(f"config key '{key}': got {value!r}, allowed: {allowed}")

    t, o, s, c = cfg.training, cfg.optimizer, cfg.lr_scheduler, cfg.checkpoint
    need(t.steps >= 0, "training.steps", ">= 0 (0 = 8 epochs)", t.steps)
    need(t.stop_at_step >= 0, "training.stop_at_step", ">= 0 (0 = run to the end)", t.stop_at_step)
    need(t.global_batch_size >= 1, "training.global_batch_size", ">= 1", t.global_batch_size)
    need(t.per_device_batch >= 1, "training.per_device_batch", ">= 1", t.per_device_batch)
    need(t.loss_groups >= 1, "training.loss_groups", ">= 1", t.loss_groups)
    need(
        t.global_batch_size % t.loss_groups == 0,
        "training.loss_groups",
        f"a divisor of training.global_batch_size ({t.global_batch_size})",
        t.loss_groups,
    )
    need(t.max_grad_norm >= 0, "training.max_grad_norm", ">= 0 (0 disables clipping)", t.max_grad_norm)
    need(t.loss_chunk_size >= 1, "training.loss_chunk_size", ">= 1", t.loss_chunk_size)
    need(o.lr >= 0, "optimizer.lr", ">= 0", o.lr)
    need(0 <= o.beta1 < 1, "optimizer.beta1", "0 <= beta1 < 1", o.beta1)
    need(0 <= o.beta2 < 1, "optimizer.beta2", "0 <= beta2 < 1", o.beta2)
    need(o.eps > 0, "optimizer.eps", "> 0", o.eps)
    need(o.weight_decay >= 0, "optimizer.weight_decay", ">= 0", o.weight_decay)
    for key, v in (("warmup", s.warmup), ("decay", s.decay)):
        need(v >= 0, f"lr_scheduler.{key}", ">= 0 (<= 1: fraction of steps, > 1: whole steps)", v)
        need(v <= 1 or float(v).is_integer(), f"lr_scheduler.{key}", "a fraction <= 1 or a whole number of steps", v)
    need(0 <= s.min_lr_ratio <= 1, "lr_scheduler.min_lr_ratio", "0 <= ratio <= 1", s.min_lr_ratio)
    need(c.interval >= 1, "checkpoint.interval", ">= 1", c.interval)
    need(c.hf_export_interval >= -1, "checkpoint.hf_export_interval", ">= 0 (0 = only at the end) or -1 (never)",
         c.hf_export_interval)
    need(c.temp_interval_minutes >= 0, "checkpoint.temp_interval_minutes", ">= 0 (0 disables)", c.temp_interval_minutes)
    need(c.keep_latest_k >= 0, "checkpoint.keep_latest_k", ">= 0 (0 keeps all)", c.keep_latest_k)
    need(c.hf_max_shard_size_gb > 0, "checkpoint.hf_max_shard_size_gb", "> 0", c.hf_max_shard_size_gb)
    need(cfg.metrics.log_freq >= 1, "metrics.log_freq", ">= 1", cfg.metrics.log_freq)
    p = cfg.parallelism
    need(p.dp_replicate >= 1, "parallelism.dp_replicate", ">= 1", p.dp_replicate)
    need(p.dp_shard == -1 or p.dp_shard >= 1, "parallelism.dp_shard", "-1 (the rest) or >= 1", p.dp_shard)
    need(p.tp >= 1, "parallelism.tp", ">= 1", p.tp)
    need(cfg.model.name != "", "model.name", "a registered model name", cfg.model.name)
    if cfg.model.init_from_hf:
        need(cfg.model.hf_assets_path != "", "model.hf_assets_path", "an HF directory when model.init_from_hf", "")
