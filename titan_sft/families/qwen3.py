"""The qwen3 family: the shared decoder with per-head q/k norms, Qwen3's flavors, HF ``qwen3`` checkpoints."""

from titan_sft.families import standard_components
from titan_sft.models.hf_adapter import StateDictAdapter
from titan_sft.models.qwen3 import QWEN3_FLAVORS
from titan_sft.models.transformer import Transformer
from titan_sft.parallel import parallelize_transformer
from titan_sft.parallel.tensor_parallel import decoder_tp_plan
from titan_sft.registry import TrainSpec, register_train_spec

register_train_spec(TrainSpec(
    name="qwen3",
    model_cls=Transformer,
    flavors=QWEN3_FLAVORS,
    hf_model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    state_dict_adapter=StateDictAdapter,
    parallelize_fn=parallelize_transformer,
    tp_plan_fn=lambda: decoder_tp_plan(qk_norm=True),  # per-head q/k norms on local heads
    **standard_components(),
))
