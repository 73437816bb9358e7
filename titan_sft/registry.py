"""Component registry: a model family's name maps to a ``TrainSpec`` that the trainer is assembled from.

A spec holds the model class, its flavors, how to parallelize it, how to convert its HF checkpoints, and the
builders of every other component (tokenizer, data, loss, optimizer, LR schedule, checkpointer, metrics,
validator). A run's config picks the spec by ``[model] name``; outside code adds its own with
:func:`register_train_spec` (or replaces a builder with ``dataclasses.replace(spec, build_loss_fn=...)``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch.nn as nn


@dataclass(frozen=True)
class TrainSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    hf_model_types: tuple[str, ...]  # config.json model_type values this spec loads
    parallelize_fn: Callable
    state_dict_adapter: type
    build_tokenizer_fn: Callable
    build_dataloader_fn: Callable
    build_loss_fn: Callable
    build_optimizer_fn: Callable
    build_lr_scheduler_fn: Callable
    build_checkpointer_fn: Callable
    build_metrics_fn: Callable
    export_hf_fn: Callable
    build_validator_fn: Callable | None = None

    def replace(self, **changes: Any) -> "TrainSpec":
        return dataclasses.replace(self, **changes)


_SPECS: dict[str, TrainSpec] = {}


def register_train_spec(spec: TrainSpec, *, overwrite: bool = False) -> None:
    """Registers ``spec`` under ``spec.name``; re-registering a name needs ``overwrite=True``."""
    if spec.name in _SPECS and not overwrite:
        raise ValueError(f"a train spec named '{spec.name}' is already registered (pass overwrite=True)")
    _SPECS[spec.name] = spec


def _ensure_builtins() -> None:
    import titan_sft.specs  # noqa: F401  (registers qwen3 and llama3)


def get_train_spec(name: str) -> TrainSpec:
    """The spec registered as ``name``; an unknown name is an error listing the known ones."""
    _ensure_builtins()
    if name not in _SPECS:
        raise KeyError(f"model.name: unknown model '{name}'; known: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def list_train_specs() -> list[str]:
    _ensure_builtins()
    return sorted(_SPECS)


def spec_for_hf_model_type(model_type: str) -> TrainSpec:
    _ensure_builtins()
    for spec in _SPECS.values():
        if model_type in spec.hf_model_types:
            return spec
    known = sorted(t for s in _SPECS.values() for t in s.hf_model_types)
    raise KeyError(f"config.json model_type '{model_type}' has no registered spec; known: {', '.join(known)}")
