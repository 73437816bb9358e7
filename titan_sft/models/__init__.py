"""Native Qwen3 and Llama 3 models, and the public loader ``load_hf``.

This package is plain PyTorch: it knows nothing of losses, data, checkpoints or distribution (a test walks its
imports) and imports nothing of titan_sft outside it. ``load_hf`` reads a local HF directory
(``models.hf_checkpoint``); distributed loading and writing are ``titan_sft.hf_io``'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from titan_sft.models.transformer import Transformer, TransformerArgs

__all__ = ["Transformer", "TransformerArgs", "build_model", "load_hf"]


def build_model(args: TransformerArgs, device: str | torch.device = "meta", **runtime) -> Transformer:
    """Builds ``Transformer(args)`` on ``device`` (meta by default: no memory, initialise or load later).

    Keyword ``runtime`` fields (``attention``, ``causal``) override those of ``args``.
    """
    args = dataclasses.replace(args, **runtime)
    with torch.device(device):
        return Transformer(args)


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> Transformer:
    """Builds the native model from an HF directory's config.json and loads its safetensors weights.

    Args:
        path: a local HF model directory (config.json + model.safetensors, or shards with an index); for a hub
            id in the huggingface_hub cache, pass ``titan_sft.hf_io.resolve_hf_dir(id)``.
        dtype: parameter dtype of the returned model.
        attention: attention backend (``sdpa``, ``flex``, ``flash_varlen``).

    Returns:
        The native :class:`Transformer` on CPU, undistributed, in eval mode: ``model(input_ids)`` gives logits
        (see :class:`Transformer` for the other call forms). A missing or unexpected tensor or a shape mismatch
        raises an error naming the tensor.
    """
    from titan_sft.models.hf_checkpoint import load_hf_dir

    return load_hf_dir(path, dtype=dtype, attention=attention)
