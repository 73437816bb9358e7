"""The built-in train specs: qwen3 and llama3 share the decoder, parallelize function and components."""

from __future__ import annotations

from titan_sft.checkpoint import CheckpointManager, export_hf
from titan_sft.data.chat import load_tokenizer
from titan_sft.data.dataset import PackedDataset
from titan_sft.loss import chunked_cross_entropy_sum
from titan_sft.lr_schedule import build_lr_scheduler
from titan_sft.metrics import MetricsLogger
from titan_sft.models.hf_adapter import StateDictAdapter
from titan_sft.models.llama3 import LLAMA3_FLAVORS
from titan_sft.models.qwen3 import QWEN3_FLAVORS
from titan_sft.models.transformer import Transformer
from titan_sft.optimizer import build_optimizer
from titan_sft.parallel import parallelize_transformer
from titan_sft.registry import TrainSpec, register_train_spec


def build_packed_dataset(cfg) -> PackedDataset:
    if not cfg.data.path:
        from titan_sft.config import ConfigError

        raise ConfigError("config key 'data.path': empty; allowed: a packed dataset directory (titan_sft.data.prepare)")
    return PackedDataset(cfg.data.path)


def build_tokenizer(cfg):
    return load_tokenizer(cfg.model.tokenizer_path or cfg.model.hf_assets_path)


_COMMON = dict(
    model_cls=Transformer,
    parallelize_fn=parallelize_transformer,
    state_dict_adapter=StateDictAdapter,
    build_tokenizer_fn=build_tokenizer,
    build_dataloader_fn=build_packed_dataset,
    build_loss_fn=lambda cfg: chunked_cross_entropy_sum,
    build_optimizer_fn=build_optimizer,
    build_lr_scheduler_fn=build_lr_scheduler,
    build_checkpointer_fn=CheckpointManager,
    build_metrics_fn=MetricsLogger,
    export_hf_fn=export_hf,
)

register_train_spec(TrainSpec(name="qwen3", flavors=QWEN3_FLAVORS, hf_model_types=("qwen3",), **_COMMON))
register_train_spec(TrainSpec(name="llama3", flavors=LLAMA3_FLAVORS, hf_model_types=("llama",), **_COMMON))
