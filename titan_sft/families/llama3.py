"""The llama3 family: the shared decoder with Llama 3.1 RoPE scaling, its flavors, HF ``llama`` checkpoints."""

from titan_sft.families import standard_components
from titan_sft.models.hf_adapter import StateDictAdapter
from titan_sft.models.llama3 import LLAMA3_FLAVORS
from titan_sft.models.transformer import Transformer
from titan_sft.parallel import parallelize_transformer
from titan_sft.parallel.tensor_parallel import decoder_tp_plan
from titan_sft.registry import TrainSpec, register_train_spec

register_train_spec(TrainSpec(
    name="llama3",
    model_cls=Transformer,
    flavors=LLAMA3_FLAVORS,
    hf_model_type="llama",
    hf_architecture="LlamaForCausalLM",
    state_dict_adapter=StateDictAdapter,
    parallelize_fn=parallelize_transformer,
    tp_plan_fn=lambda: decoder_tp_plan(qk_norm=False),
    **standard_components(),
))
