"""Reading a local Hugging Face model directory into the native model, in one process (``models.load_hf``).

An HF directory: ``config.json``, ``model.safetensors`` or shards + ``model.safetensors.index.json``. Names and
config fields map through ``models.hf_adapter`` (stacked experts are filled expert by expert). Distributed loading,
hub-id resolution and writing live in ``titan_sft.hf_io``, which builds on the helpers here.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_sft.models.hf_adapter import (MULTIMODAL_TYPES, ROUTING_BIAS_FILE, StateDictAdapter, args_from_hf_config,
                                         expert_hf_names, expert_slot, fused_expert_source, fused_parts, is_fused_expert_name,
                                         multimodal_tensor_name, routing_bias_name, text_config, text_tensor_name)
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


# Tensors of an HF directory that are not the language model's: a multimodal checkpoint's vision tower, and the
# multi-token-prediction head Qwen3.5's checkpoints ship (transformers ignores it; vLLM's speculative decoding
# reads it). A text run does not read them; the export of a run that started from the directory copies them.
CARRIED_PREFIXES = ("model.visual.", "mtp.")


@dataclass(frozen=True)
class HFTensors:
    """The tensors of a local HF directory, from the safetensors headers, by their text-only checkpoint names
    (``model.layers.0...``, ``lm_head.weight``): a multimodal checkpoint's ``model.language_model.`` nesting is
    undone here, so everything that maps names sees one layout."""

    path: Path
    multimodal: bool  # config.json is a multimodal model's (Qwen3_5ForConditionalGeneration)
    shapes: dict[str, tuple[int, ...]]  # text name -> shape
    stored: dict[str, str]  # text name -> its name in the file
    files: dict[str, Path]  # text name -> the file holding it
    carried: dict[str, Path]  # stored name -> file of the tensors a text run leaves alone (CARRIED_PREFIXES)

    @property
    def fused_experts(self) -> bool:
        """The routed experts are stored fused (``mlp.experts.gate_up_proj``), not one tensor per expert."""
        return any(is_fused_expert_name(n) for n in self.shapes)

    def read(self, name: str, index: tuple = ()) -> torch.Tensor:
        """The tensor ``name`` (text name), or its ``index`` slice, read from its file alone."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as f:
            part = f.get_slice(self.stored[name])
            return part[index] if index else part[:]

    def stored_name(self, name: str) -> str:
        """The name a text name takes in this directory's layout (for writing an export in it)."""
        return multimodal_tensor_name(name) if self.multimodal and name != "lm_head.weight" else name


def index_hf_tensors(path: str | Path) -> HFTensors:
    """The tensor index of a local HF directory (headers only)."""
    from safetensors import safe_open

    path = Path(path)
    multimodal = read_config(path).get("model_type") in MULTIMODAL_TYPES
    shapes, stored, files, carried = {}, {}, {}, {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.startswith(CARRIED_PREFIXES):
                    carried[name] = file
                    continue
                text = text_tensor_name(name) if multimodal else name
                shapes[text], stored[text], files[text] = tuple(f.get_slice(name).get_shape()), name, file
    return HFTensors(path, multimodal, shapes, stored, files, carried)


def tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names (text-only layout) and shapes of a local HF directory's language-model tensors, from the headers."""
    return index_hf_tensors(path).shapes


def read_expert_rows(index: HFTensors, native: str, n_experts: int, experts: range, rows: slice,
                     cols: slice) -> torch.Tensor:
    """``[experts, rows, cols]`` of the native stacked expert tensor ``native`` ([E, out, in]), read from one
    tensor per expert or from the fused ``gate_up_proj``/``down_proj``, whichever the directory holds."""
    if index.fused_experts:
        hf, half = fused_expert_source(native)
        if hf not in index.shapes:
            raise ValueError(f"{index.path}: the checkpoint lacks tensor '{hf}'")
        if half is not None:  # gate rows [0, I), up rows [I, 2I)
            width = index.shapes[hf][1] // 2
            rows = slice(half * width + rows.start, half * width + rows.stop)
        return index.read(hf, (slice(experts.start, experts.stop), rows, cols))
    names = expert_hf_names(native, n_experts)
    return torch.stack([index.read(names[e], (rows, cols)) for e in experts])


def check_expert_shapes(index: HFTensors, native: str, shape: tuple[int, ...], n_experts: int) -> None:
    """Raises naming the tensor when the directory lacks the experts of ``native`` [E, out, in] or their shape
    differs."""
    if index.fused_experts:
        hf, half = fused_expert_source(native)
        want = (shape[0], 2 * shape[1], shape[2]) if half is not None else tuple(shape)
        found = {hf: index.shapes.get(hf)}
    else:
        want = tuple(shape[1:])
        found = {n: index.shapes.get(n) for n in expert_hf_names(native, n_experts)}
    for hf, got in found.items():
        if got is None:
            raise ValueError(f"{index.path}: the checkpoint lacks tensor '{hf}'")
        if got != want:
            raise ValueError(f"{index.path}: tensor '{hf}' has shape {got}, the model expects {want}")


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32, attention: str = "sdpa") -> Transformer:
    """The native model with a local directory's weights, on CPU, in eval mode (see ``models.load_hf``). A
    multimodal checkpoint gives its language model; its vision tower is not read."""
    hf_cfg = read_config(path)
    args = args_from_hf_config(hf_cfg)
    kind = text_config(hf_cfg).get("model_type")
    adapter = StateDictAdapter(args)
    bias = read_routing_bias(path, args)  # a titan_sft export trained with it routes with it
    index = index_hf_tensors(path)
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, attention=attention, router_bias=bias is not None))
    model.to_empty(device="cpu")
    expected = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for name, values in (bias or {}).items():
            expected[name].copy_(values)
            loaded.add(name)
        for hf_name in index.shapes:
            parts = fused_parts(hf_name, args)
            if parts is not None:  # one HF tensor holding several native ones (rows [q | k | v])
                tensor = index.read(hf_name)
                for name, start, rows in parts:
                    expected[name].copy_(tensor[start:start + rows])
                    loaded.add(name)
                continue
            slot = expert_slot(hf_name)
            if slot or is_fused_expert_name(hf_name):  # read below, per stacked tensor
                layer = hf_name.split(".")[2]
                if f"layers.{layer}.feed_forward.experts.w1" not in expected or (slot and slot[1] >= args.n_experts):
                    raise ValueError(f"{index.files[hf_name]}: unexpected tensor '{index.stored[hf_name]}' for "
                                     f"this {kind} model")
                continue
            try:
                native = adapter.from_hf({hf_name: None})
            except KeyError:
                raise ValueError(f"{index.files[hf_name]}: unexpected tensor '{index.stored[hf_name]}' for a "
                                 f"{kind} model") from None
            for name in native:  # empty for a tied checkpoint's spare lm_head.weight
                if name not in expected:
                    raise ValueError(f"{index.files[hf_name]}: unexpected tensor '{index.stored[hf_name]}' for "
                                     f"this {kind} model")
                if index.shapes[hf_name] != tuple(expected[name].shape):
                    raise ValueError(f"{index.files[hf_name].name}: tensor '{index.stored[hf_name]}' has shape "
                                     f"{index.shapes[hf_name]}, the model expects {tuple(expected[name].shape)}")
                expected[name].copy_(index.read(hf_name))
                loaded.add(name)
        for name, target in expected.items():
            if expert_hf_names(name, args.n_experts):
                check_expert_shapes(index, name, tuple(target.shape), args.n_experts)
                target.copy_(read_expert_rows(index, name, args.n_experts, range(target.shape[0]),
                                              slice(0, target.shape[1]), slice(0, target.shape[2])))
                loaded.add(name)
    missing = [n for n in expected if n not in loaded and not (n == "output.weight" and args.tie_embeddings)]
    if missing:
        raise ValueError(f"{path}: checkpoint lacks tensor(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    model = model.to(dtype).eval()
    for name in bias or {}:  # the biases stay fp32, as in training: in bf16 near-equal experts would swap
        model.get_submodule(name.rsplit(".", 1)[0]).expert_bias = expected[name].float()
    return model
