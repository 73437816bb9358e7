"""The qwen3_5 family: Qwen3.5's hybrid decoder (Gated DeltaNet + gated full attention), its dense flavors, HF ``qwen3_5_text`` checkpoints (and the language model of multimodal ``qwen3_5`` ones)."""

from titan_sft.families import standard_components
from titan_sft.models.hf_adapter import StateDictAdapter
from titan_sft.models.qwen3_5 import QWEN3_5_FLAVORS
from titan_sft.models.transformer import Transformer
from titan_sft.parallel import parallelize_transformer
from titan_sft.parallel.tensor_parallel import decoder_tp_plan
from titan_sft.registry import TrainSpec, register_train_spec

register_train_spec(TrainSpec(
    name="qwen3_5",
    model_cls=Transformer,
    flavors=QWEN3_5_FLAVORS,
    hf_model_type="qwen3_5_text",
    hf_architecture="Qwen3_5ForCausalLM",
    state_dict_adapter=StateDictAdapter,
    parallelize_fn=parallelize_transformer,
    tp_plan_fn=lambda: decoder_tp_plan(qk_norm=True),  # Gated DeltaNet blocks get their own (block_plan_for)
    **standard_components(),
))
