"""Reading a local Hugging Face model directory into the native model, in one process (``models.load_hf``).

An HF directory: ``config.json``, ``model.safetensors`` or shards + ``model.safetensors.index.json``. Names and
config fields map through ``models.hf_adapter`` (stacked experts are filled expert by expert). Distributed loading,
hub-id resolution and writing live in ``titan_sft.hf_io``, which builds on the helpers here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from titan_sft.models.hf_adapter import (ROUTING_BIAS_FILE, StateDictAdapter, args_from_hf_config, expert_hf_names,
                                         expert_slot, fused_parts, routing_bias_name, text_config)
from titan_sft.models.transformer import Transformer


def read_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a local HF directory."""
    path = Path(path) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: an HF model directory needs a config.json")
    return json.loads(path.read_text())


def read_routing_bias(path: str | Path, args) -> dict[str, torch.Tensor] | None:
    """The aux-loss-free routing biases a titan_sft export keeps beside its weights (``routing_bias.json``), by
    native buffer name; None when the directory has none. Layers and sizes are checked against ``args``."""
    file = Path(path) / ROUTING_BIAS_FILE
    if not file.is_file():
        return None
    biases = json.loads(file.read_text())
    layers = set(args.moe_layers())
    out = {}
    for layer, values in biases.items():
        if int(layer) not in layers or len(values) != args.n_experts:
            raise ValueError(f"{file}: layer {layer} with {len(values)} biases does not fit this model "
                             f"(MoE layers {sorted(layers)}, {args.n_experts} experts)")
        out[routing_bias_name(int(layer))] = torch.tensor(values, dtype=torch.float32)
    return out


def safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of a local HF directory: the index's shards, or the single ``model.safetensors``."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a local HF directory's tensors, read from the safetensors headers only."""
    from safetensors import safe_open

    shapes = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> Transformer:
    """The native model with a local directory's weights, on CPU, in eval mode (see ``models.load_hf``)."""
    from safetensors import safe_open

    hf_cfg = read_config(path)
    args = args_from_hf_config(hf_cfg)
    kind = text_config(hf_cfg).get("model_type")
    adapter = StateDictAdapter(args)
    bias = read_routing_bias(path, args)  # a titan_sft export trained with it routes with it
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, attention=attention, router_bias=bias is not None))
    model.to_empty(device="cpu")
    expected = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, values in (bias or {}).items():
            expected[name].copy_(values)
            loaded.add(name)
    with torch.no_grad():
        for file in safetensors_files(path):
            with safe_open(str(file), framework="pt") as f:
                for hf_name in f.keys():
                    parts = fused_parts(hf_name, args)
                    if parts is not None:  # one HF tensor holding several native ones (rows [q | k | v])
                        tensor = f.get_tensor(hf_name)
                        for name, start, rows in parts:
                            expected[name].copy_(tensor[start:start + rows])
                            loaded.add(name)
                        continue
                    slot = expert_slot(hf_name)
                    try:
                        native = {slot[0]: None} if slot else adapter.from_hf({hf_name: None})
                    except KeyError:
                        raise ValueError(f"{file}: unexpected tensor '{hf_name}' for a {kind} model") from None
                    for name in native:  # empty for a tied checkpoint's spare lm_head.weight
                        if name not in expected:
                            raise ValueError(f"{file}: unexpected tensor '{hf_name}' for this {kind} model")
                        tensor = f.get_tensor(hf_name)
                        target = expected[name] if slot is None else expected[name][slot[1]]
                        if tuple(tensor.shape) != tuple(target.shape):
                            raise ValueError(f"{file.name}: tensor '{hf_name}' has shape {tuple(tensor.shape)}, "
                                             f"the model expects {tuple(target.shape)}")
                        target.copy_(tensor)
                        loaded.add(name if slot is None else hf_name)
    missing = [n for n in expected if n not in loaded and not (n == "output.weight" and args.tie_embeddings)
               and not expert_hf_names(n, args.n_experts)]
    missing += [n for n in adapter.hf_names() if expert_slot(n) and n not in loaded]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    model = model.to(dtype).eval()
    for name in bias or {}:  # the biases stay fp32, as in training: in bf16 near-equal experts would swap
        model.get_submodule(name.rsplit(".", 1)[0]).expert_bias = expected[name].float()
    return model
