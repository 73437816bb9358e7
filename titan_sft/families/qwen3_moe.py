"""The qwen3_moe family: the shared decoder with per-head q/k norms and routed experts (``models.moe``), Qwen3-MoE's
flavors, HF ``qwen3_moe`` checkpoints (one tensor per expert on disk, stacked in the model)."""

from titan_sft.families import standard_components
from titan_sft.models.hf_adapter import StateDictAdapter
from titan_sft.models.qwen3_moe import QWEN3_MOE_FLAVORS
from titan_sft.models.transformer import Transformer
from titan_sft.parallel import parallelize_transformer
from titan_sft.parallel.tensor_parallel import decoder_tp_plan
from titan_sft.registry import TrainSpec, register_train_spec

register_train_spec(TrainSpec(
    name="qwen3_moe",
    model_cls=Transformer,
    flavors=QWEN3_MOE_FLAVORS,
    hf_model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    state_dict_adapter=StateDictAdapter,
    parallelize_fn=parallelize_transformer,
    tp_plan_fn=lambda: decoder_tp_plan(qk_norm=True),
    **standard_components(),
))
