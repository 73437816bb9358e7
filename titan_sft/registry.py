"""Component registry: what a run's config picks by name.

Three tables, each filled by the module that defines the thing, never by editing the trainer:

* train specs (``[model] name``): a model family (class, flavors, HF model_type and architecture, state-dict
  adapter, parallelize function) plus the builders of the components its runs use. The built-in families
  register themselves from ``titan_sft.families.<name>``, imported here on first lookup;
* objectives (``[objective] name``): the training objective (collator, attention mode, loss with the output
  head, validator, step metrics); built-ins in ``titan_sft.objectives.<name>``;
* model converters (float8, LoRA, ...): functions that swap modules of a meta-device model before it is
  sharded; built-ins in ``titan_sft.converters``.

Outside code registers its own (``register_train_spec``, ``register_objective``, ``register_converter``) in a
module named by ``[job] custom_imports``, which the trainer imports before it builds anything. This module
imports nothing from the rest of titan_sft, so every layer may use it without an import cycle.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

BUILTIN_FAMILIES = ("qwen3", "qwen3_moe", "llama3", "qwen3_5", "qwen3_5_moe")
BUILTIN_OBJECTIVES = ("causal_lm", "masked_diffusion")


@dataclass(frozen=True)
class TrainSpec:
    """A model family and the builders of the components a run of it uses. Every field is used by the trainer.

    Builder signatures (``cfg`` is the whole ``JobConfig``):
        parallelize_fn(model, mesh, cfg, device, tp_plan): TP, converters, AC, compile, FSDP2, in place, on the
            meta model.
        tp_plan_fn() -> (root plan, per-block plan): the family's tensor-parallel plan (``{FQN: ParallelStyle}``).
        build_tokenizer_fn(cfg) -> tokenizer (``len()`` is its vocabulary size).
        build_dataloader_fn(cfg, dp_rank, dp_world, collate_fn, pin_memory) -> loader with ``.dataset``,
            ``.sampler``, ``start(step)``, ``next()`` and ``close()`` (see ``titan_sft.data.loader``).
        build_optimizer_fn(model, cfg.optimizer, global_batch) -> torch optimizer (lr scaled by the batch).
        build_lr_scheduler_fn(optimizer, cfg.lr_scheduler, total_steps) -> LR scheduler.
        build_checkpointer_fn(cfg, model, optimizer, lr_scheduler, sampler, exporter) -> checkpointer.
        build_metrics_fn(cfg, rank, device, total_steps, flops) -> metrics logger (flops: metrics.FlopCounter).
    """

    name: str
    model_cls: type
    flavors: dict[str, Any]  # flavor name -> model args
    hf_model_type: str  # config.json "model_type" this family reads and writes
    hf_architecture: str  # config.json "architectures" entry written on export
    state_dict_adapter: type  # adapter(args): native <-> HF tensor names
    parallelize_fn: Callable
    tp_plan_fn: Callable
    build_tokenizer_fn: Callable
    build_dataloader_fn: Callable
    build_optimizer_fn: Callable
    build_lr_scheduler_fn: Callable
    build_checkpointer_fn: Callable
    build_metrics_fn: Callable

    def replace(self, **changes: Any) -> "TrainSpec":
        """A copy with some fields changed (register it under a new name, or with ``overwrite=True``)."""
        return dataclasses.replace(self, **changes)


_SPECS: dict[str, TrainSpec] = {}
_OBJECTIVES: dict[str, Callable] = {}
_CONVERTERS: dict[str, Callable] = {}
_CONVERTER_HOOKS: dict[str, dict[str, Callable | None]] = {}


def _register(table: dict, kind: str, name: str, value: Any, overwrite: bool) -> None:
    if name in table and not overwrite:
        raise ValueError(f"a {kind} named '{name}' is already registered (pass overwrite=True)")
    table[name] = value


def _lookup(table: dict, kind: str, key: str, name: str, builtin_module: str | None) -> Any:
    if name not in table and builtin_module is not None:
        try:
            importlib.import_module(builtin_module)
        except ModuleNotFoundError as e:
            if e.name != builtin_module:
                raise
    if name not in table:
        raise KeyError(f"{key}: unknown {kind} '{name}'; known: {', '.join(sorted(table))}")
    return table[name]


def register_train_spec(spec: TrainSpec, *, overwrite: bool = False) -> None:
    """Registers ``spec`` under ``spec.name``; re-registering a name needs ``overwrite=True``."""
    _register(_SPECS, "train spec", spec.name, spec, overwrite)


def _load_builtin_families() -> None:
    for name in BUILTIN_FAMILIES:
        importlib.import_module(f"titan_sft.families.{name}")


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as ``name`` (a built-in family is imported on first use); unknown names list the
    known ones."""
    if name not in _SPECS:
        _load_builtin_families()
    return _lookup(_SPECS, "model", "model.name", name, None)


def list_train_specs() -> list[str]:
    _load_builtin_families()
    return sorted(_SPECS)


def spec_for_hf_model_type(model_type: str) -> TrainSpec:
    """The spec whose family reads config.json ``model_type``."""
    _load_builtin_families()
    for spec in _SPECS.values():
        if spec.hf_model_type == model_type:
            return spec
    known = sorted({s.hf_model_type for s in _SPECS.values()})
    raise KeyError(f"config.json model_type '{model_type}' has no registered model family; known: {', '.join(known)}")


def register_objective(name: str, build: Callable, *, overwrite: bool = False) -> None:
    """Registers an objective; ``build(cfg)`` returns an :class:`titan_sft.objectives.Objective`."""
    _register(_OBJECTIVES, "objective", name, build, overwrite)


def get_objective(name: str) -> Callable:
    """The builder of objective ``name`` (built-ins are imported on first use)."""
    module = f"titan_sft.objectives.{name}" if name in BUILTIN_OBJECTIVES else None
    return _lookup(_OBJECTIVES, "objective", "objective.name", name, module)


def list_objectives() -> list[str]:
    for name in BUILTIN_OBJECTIVES:
        get_objective(name)
    return sorted(_OBJECTIVES)


def register_converter(name: str, apply: Callable, *, overwrite: bool = False, on_start: Callable | None = None,
                       on_end: Callable | None = None, on_step: Callable | None = None) -> None:
    """Registers a model converter; ``apply(model, cfg, device)`` swaps modules of the meta-device model in
    place (before activation checkpointing, compile and FSDP). Optional hooks, each ``hook(model, cfg, exporter)``
    on every rank: ``on_start`` once the model holds its starting weights and the validators kept what they need
    of them (before a resume), ``on_end`` after the last step (LoRA: a warm start, and adapters/final), and
    ``on_step`` after each step's checkpoint and export, called with (completed steps, total steps) as well (LoRA:
    adapter snapshots)."""
    _register(_CONVERTERS, "model converter", name, apply, overwrite)
    _CONVERTER_HOOKS[name] = {"on_start": on_start, "on_end": on_end, "on_step": on_step}


def converter_hook(name: str, when: str) -> Callable | None:
    """The converter's ``on_start`` / ``on_end`` / ``on_step`` hook, or None."""
    return _CONVERTER_HOOKS.get(name, {}).get(when)


def get_converter(name: str) -> Callable:
    return _lookup(_CONVERTERS, "model converter", "model.converters", name, "titan_sft.converters")
