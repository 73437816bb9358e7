"""Model families: each module here registers one train spec (``titan_sft.registry``) from its model definition
(``titan_sft.models``) and the components its runs use. ``get_train_spec(name)`` imports
``titan_sft.families.<name>`` on first use. A new family (from outside code too) registers a ``TrainSpec`` the
same way; see docs/architecture.md.
"""

from __future__ import annotations

from typing import Any, Callable

from titan_sft.config import JobConfig


def build_tokenizer(cfg: JobConfig):
    """The run's tokenizer: ``model.tokenizer_path``, else ``model.hf_assets_path``."""
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.hf_io import resolve_hf_dir

    return load_tokenizer(resolve_hf_dir(cfg.model.tokenizer_path or cfg.model.hf_assets_path))


def standard_components() -> dict[str, Callable[..., Any]]:
    """The component builders the built-in families share (data, optimizer, schedule, checkpointer, metrics)."""
    from titan_sft.checkpoint import CheckpointManager
    from titan_sft.data.loader import build_loader
    from titan_sft.lr_schedule import build_lr_scheduler
    from titan_sft.metrics import MetricsLogger
    from titan_sft.optimizer import build_optimizer

    return dict(
        build_tokenizer_fn=build_tokenizer,
        build_dataloader_fn=build_loader,
        build_optimizer_fn=build_optimizer,
        build_lr_scheduler_fn=build_lr_scheduler,
        build_checkpointer_fn=CheckpointManager,
        build_metrics_fn=MetricsLogger,
    )
