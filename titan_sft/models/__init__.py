"""Native Qwen3 and Llama 3 models, and the public loader ``load_hf``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from titan_sft.models.hf_adapter import args_from_hf_config, hf_to_native_name, read_hf_config
from titan_sft.models.transformer import Transformer, TransformerArgs

__all__ = ["Transformer", "TransformerArgs", "build_model", "load_hf", "hf_safetensors_files"]


def build_model(args: TransformerArgs, device: str | torch.device = "meta", **runtime) -> Transformer:
    """Builds ``Transformer(args)`` on ``device`` (meta by default: no memory, initialise or load later).

    Keyword ``runtime`` fields (``attention``, ``causal``) override those of ``args``.
    """
    args = dataclasses.replace(args, **runtime)
    with torch.device(device):
        return Transformer(args)


def hf_safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF directory: the index's shards, or the single ``model.safetensors``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def args_kind(args: TransformerArgs) -> str:
    return "Qwen3" if args.qk_norm else "Llama"


def load_hf(path: str | Path, dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> Transformer:
    """Builds the native model from an HF directory's config.json and loads its safetensors weights.

    Args:
        path: HF model directory (config.json + model.safetensors or sharded with an index).
        dtype: parameter dtype of the returned model.
        attention: attention backend (``sdpa``, ``flex``, ``flash_varlen``).

    Returns:
        The native :class:`Transformer` on CPU, undistributed, in eval mode. A missing or unexpected tensor or a
        shape mismatch raises an error naming the tensor.
    """
    from safetensors import safe_open

    args = args_from_hf_config(read_hf_config(path))
    model = build_model(args, attention=attention)
    model.to_empty(device="cpu")
    expected = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for file in hf_safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    if hf_name == "lm_head.weight" and args.tie_embeddings:
                        continue
                    try:
                        name = hf_to_native_name(hf_name)
                    except KeyError:
                        raise ValueError(f"{file}: unexpected tensor '{hf_name}' for a {args_kind(args)} model") from None
                    tensor = f.get_tensor(hf_name)
                    if tuple(tensor.shape) != tuple(expected[name].shape):
                        raise ValueError(
                            f"{file.name}: tensor '{hf_name}' has shape {tuple(tensor.shape)}, "
                            f"the model expects {tuple(expected[name].shape)}"
                        )
                    expected[name].copy_(tensor)
                    loaded.add(name)
    missing = [n for n in expected if n not in loaded and not (n == "output.weight" and args.tie_embeddings)]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    return model.to(dtype).eval()
