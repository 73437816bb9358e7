"""HF I/O: the one module that reads and writes Hugging Face model directories.

Used by a run that starts from HF weights (each rank reads only its own shards), by periodic HF export during
training, and by ``python -m titan_sft.convert``; hub ids resolve through the huggingface_hub cache here.
(``titan_sft.models.load_hf``, the one-process loader of a local directory, lives in ``models.hf_checkpoint``.) Tensor names and
config fields are mapped by the model family's state-dict adapter and ``models.hf_adapter``; the family's train
spec says which ``model_type`` and architecture a directory holds.

An HF directory: ``config.json``, ``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` +
``model.safetensors.index.json``, and (optional) tokenizer files.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_sft.atomic import finalize, partial_dir, rank
from titan_sft.constants import DTYPES
from titan_sft.models.hf_adapter import (ROUTING_BIAS_FILE, args_from_hf_config, expert_hf_names, fuse_experts,
                                         fused_slot, hf_config_from_args, native_to_hf_name, routing_bias_layer,
                                         text_config)
from titan_sft.models.hf_checkpoint import (HFTensors, check_expert_shapes, index_hf_tensors, read_config,
                                            read_expert_rows, read_routing_bias, safetensors_files, tensor_shapes)
from titan_sft.models.transformer import TransformerArgs
from titan_sft.registry import TrainSpec

# ------------------------------------------------------------------------------------------------------------
# reading


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What an HF model directory needs from the hub (titan_sft.download, and the cache lookup below).
HF_FILES = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
            "tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt", "*.model", "*.jinja",
            "*preprocessor_config.json", "processor_config.json", "chat_template.json"]  # a multimodal model's


def resolve_hf_dir(path_or_id: str | Path) -> Path:
    """An HF model directory: ``path_or_id`` itself, or the huggingface_hub cache snapshot of that hub id.

    Raises:
        FileNotFoundError: neither; the message names both ways to get it.
    """
    path = Path(path_or_id)
    if path.is_dir():
        return path
    name = str(path_or_id)
    if HUB_ID.match(name):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(name, "config.json")
        if isinstance(cached, str):
            return Path(cached).parent
    from huggingface_hub.constants import HF_HUB_CACHE

    raise FileNotFoundError(
        f"model.hf_assets_path: '{name}' is neither a local directory nor a model in the huggingface_hub cache "
        f"({HF_HUB_CACHE}); either download it to a directory (python -m titan_sft.download {name} --to DIR, then "
        f"hf_assets_path = DIR) or into the cache (huggingface-cli download {name}) and keep the hub id"
    )


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of an HF directory (or hub id in the huggingface_hub cache)."""
    return read_config(resolve_hf_dir(path))


def hf_safetensors_files(path: str | Path) -> list[Path]:
    """The safetensors files of an HF directory (or cached hub id): the index's shards, or ``model.safetensors``."""
    return safetensors_files(resolve_hf_dir(path))


def hf_tensor_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of an HF directory's tensors, read from the safetensors headers only."""
    return tensor_shapes(resolve_hf_dir(path))


def model_args(model_cfg, spec: TrainSpec) -> TransformerArgs:
    """The model's architecture for a run: from ``hf_assets_path``/config.json when ``init_from_hf``, else the
    family's flavor; with the run's attention backend. (The one flavour lookup of titan_sft.)"""
    from titan_sft.config import ConfigError, require_flavor

    if model_cfg.init_from_hf:
        hf_cfg = read_hf_config(model_cfg.hf_assets_path)
        if text_config(hf_cfg).get("model_type") != spec.hf_model_type:  # a multimodal one: its language model's
            raise ConfigError(
                f"config key 'model.name': '{spec.name}' reads HF model_type '{spec.hf_model_type}', but "
                f"{model_cfg.hf_assets_path}/config.json has '{hf_cfg.get('model_type')}'"
            )
        args = args_from_hf_config(hf_cfg)
    else:
        require_flavor(model_cfg, spec.flavors)
        args = spec.flavors[model_cfg.flavor]
    if model_cfg.yarn_factor:
        from titan_sft.models.transformer import RopeScaling

        if model_cfg.yarn_factor <= 1:
            raise ConfigError(f"config key 'model.yarn_factor': {model_cfg.yarn_factor} must be above 1 (0 turns "
                              "YaRN off)")
        scaling = RopeScaling(factor=model_cfg.yarn_factor, rope_type="yarn",
                              original_max_position_embeddings=model_cfg.yarn_original_positions)
        args = dataclasses.replace(args, rope_scaling=scaling,
                                   max_seq_len=int(model_cfg.yarn_factor * model_cfg.yarn_original_positions))
    # A routing bias when it trains, or when the HF directory (a titan_sft export) routes with one.
    bias = model_cfg.router_bias_rate > 0 or bool(model_cfg.init_from_hf and args.n_experts
                                                  and (resolve_hf_dir(model_cfg.hf_assets_path) / ROUTING_BIAS_FILE).is_file())
    if model_cfg.router_bias_rate > 0 and not args.n_experts:
        raise ConfigError(f"config key 'model.router_bias_rate': {model_cfg.router_bias_rate}, but the model has no "
                          "routed experts; set it to 0")
    return dataclasses.replace(args, attention=model_cfg.attention, freeze_router=model_cfg.freeze_router,
                               router_bias=bias)


def load_hf_weights(model, args: TransformerArgs, path: str | Path, spec: TrainSpec) -> None:
    """Loads an HF directory straight into the (sharded) ``model``; each rank reads only its own slices.

    DCP's ``HuggingFaceStorageReader`` reads the safetensors files; no rank builds a whole copy. Names and shapes
    are checked against the safetensors headers first, so a missing tensor or a shape (vocab) mismatch is an
    error naming the tensor. NF4 weights (QLoRA, :mod:`titan_sft.nf4`) are read whole, one block at a time, and
    each rank keeps its shard of their codes.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from titan_sft import nf4
    from titan_sft.checkpoint import model_state, with_aliases
    from titan_sft.lora import is_adapter_key
    from titan_sft.parallel.distributed import transient_group, unwrapped_name

    # LoRA adapters are not in an HF checkpoint; they start from their own init (titan_sft.lora).
    # model_state: a pipeline's last stage reads its copy of a tied head under the embedding's name
    state = {k: v for k, v in model_state(model).items() if not is_adapter_key(k) and not nf4.is_nf4_key(k)}
    with transient_group() as pg:  # not the long-lived default group: it would slow every later CPU step
        native = _read_hf(state, args, path, spec, pg)
    # FSDP2's state dict holds the parameters themselves, so the load above already wrote into them; setting it
    # again keeps this correct for wrappers whose state dict holds copies.
    set_model_state_dict(model, with_aliases(model, native), options=StateDictOptions(strict=False))
    quantized = nf4.quantized_weights(model)
    for keys in nf4.by_block(quantized):
        full = read_hf_weights({k: nf4.full_shape(*quantized[k]) for k in keys}, args, path, spec)
        for k, w in full.items():
            nf4.fill(*quantized[k], w)
    biases = read_routing_bias(resolve_hf_dir(path), args) if args.router_bias else None
    held = {unwrapped_name(n): b for n, b in model.named_buffers()}  # a pipeline stage holds some layers only
    with torch.no_grad():
        for name, values in (biases or {}).items():
            if name in held:
                held[name].copy_(values)


def read_hf_weights(shapes: dict[str, tuple[int, ...]], args: TransformerArgs, path: str | Path,
                    spec: TrainSpec, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Whole native tensors (on the CPU, in ``dtype``) of the native keys ``shapes`` from an HF directory, read
    by this process alone (no collective: any rank may call it, alone or not)."""
    state = {k: torch.empty(shape, dtype=dtype) for k, shape in shapes.items()}
    native = _read_hf(dict(state), args, path, spec, None)
    return {k: native.get(k, state[k]) for k in shapes}


def _read_hf(state: dict, args: TransformerArgs, path, spec: TrainSpec, pg) -> dict:
    """Reads the HF tensors of the native ``state`` (parameters, sharded or not, or plain tensors: each receives
    its own part) in place; returns the native state DCP produced (``from_hf`` of what it read, without the
    stacked experts and fused rows, which are copied in place). ``pg`` None: this process reads alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    adapter = spec.state_dict_adapter(args)
    index = index_hf_tensors(resolve_hf_dir(path))
    # Stacked experts are read apart: each rank copies the experts of its own shard from the per-expert tensors.
    experts = {k: state.pop(k) for k in list(state) if expert_hf_names(k, args.n_experts)}
    # Row blocks of one HF tensor (Gated DeltaNet's q/k/v) likewise: each rank reads the rows of its own shard.
    fused = {k: state.pop(k) for k in list(state) if fused_slot(k, args)}
    hf_state = adapter.to_hf(state)
    for name, tensor in hf_state.items():
        if name not in index.shapes:
            raise ValueError(f"{path}: the checkpoint lacks tensor '{index.stored_name(name)}'")
        if tuple(tensor.shape) != index.shapes[name]:
            raise ValueError(f"{path}: tensor '{index.stored[name]}' has shape {index.shapes[name]}, the model "
                             f"expects {tuple(tensor.shape)}")
    if hf_state:  # DCP reads by the names in the files (a multimodal checkpoint nests them)
        stored = {index.stored[k]: v for k, v in hf_state.items()}
        dcp.load(stored, storage_reader=HuggingFaceStorageReader(str(index.path)), process_group=pg,
                 no_dist=pg is None)
        hf_state = {k: stored[index.stored[k]] for k in hf_state}
    if experts:
        _load_expert_shards(experts, args, index)
    if fused:
        _load_fused_rows(fused, args, index)
    return adapter.from_hf(hf_state) if hf_state else {}


def _local_part(param):
    """(local tensor, its global shape, its offset) of a parameter, sharded (DTensor) or not."""
    from torch.distributed.tensor import DTensor

    from titan_sft.compat import local_shape_and_offset

    if isinstance(param, DTensor):
        shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
        return param.to_local(), shape, offset
    return param, tuple(param.shape), (0,) * param.ndim


def _load_fused_rows(fused: dict, args: TransformerArgs, index: HFTensors) -> None:
    """Copies each rank's part of the native tensors that are row blocks of one HF tensor (``fused_slot``)."""
    with torch.no_grad():
        for name, param in fused.items():
            hf, start, rows = fused_slot(name, args)
            if hf not in index.shapes:
                raise ValueError(f"{index.path}: the checkpoint lacks tensor '{index.stored_name(hf)}'")
            if index.shapes[hf][0] < start + rows or index.shapes[hf][1:] != tuple(param.shape[1:]):
                raise ValueError(f"{index.path}: tensor '{index.stored[hf]}' has shape {index.shapes[hf]}, the "
                                 f"model expects rows {start}:{start + rows} of shape {tuple(param.shape)}")
            local, shape, offset = _local_part(param)
            if local.numel() == 0:
                continue
            part = tuple(slice(o, o + n) for o, n in zip(offset, shape))
            local.copy_(index.read(hf, (slice(start + offset[0], start + offset[0] + shape[0]),) + part[1:]))


def _load_expert_shards(experts: dict, args: TransformerArgs, index: HFTensors) -> None:
    """Copies each rank's rows of the stacked expert tensors (whole experts, or slices of them, as the layout
    shards them) from the checkpoint's per-expert or fused expert tensors; no rank reads experts it does not
    hold."""
    with torch.no_grad():
        for name, param in experts.items():
            check_expert_shapes(index, name, tuple(param.shape), args.n_experts)
            local, shape, offset = _local_part(param)
            if local.numel() == 0:
                continue
            local.copy_(read_expert_rows(index, name, args.n_experts, range(offset[0], offset[0] + shape[0]),
                                         slice(offset[1], offset[1] + shape[1]),
                                         slice(offset[2], offset[2] + shape[2])))


# ------------------------------------------------------------------------------------------------------------
# writing


def export_hf(model, args: TransformerArgs, out_dir: str | Path, dtype: str = "bfloat16",
              tokenizer_dir: str | None = None, max_shard_gb: float = 5.0, *, spec: TrainSpec,
              generation_config: bool = True, lora=None, adapter_dir: str | Path | None = None,
              base_model: str | None = None, objective: dict | None = None) -> Path:
    """Writes an HF directory (config.json, generation_config.json, safetensors shards + index, padded tokenizer)
    atomically.

    Parameters are gathered one tensor at a time onto rank 0's CPU (``full_state_dict`` + ``cpu_offload``), so no
    rank holds the whole model on its device; rank 0 writes. Call it on every rank. ``generation_config=False``
    writes what the reference SFT export writes (no generation_config.json).

    With LoRA (``lora``: the run's ``[lora]`` config) the export holds the merged weights (W + alpha/r B A), and
    ``adapter_dir`` receives the adapter as PEFT loads it (``titan_sft.lora.save_peft_adapter``). ``objective``
    (the run's objective record, e.g. the masked-diffusion mask token) is written beside the weights as
    ``objective.json``, so ``titan_sft.generate`` can run an export without the run folder.
    """
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    out_dir = Path(out_dir)
    tmp = partial_dir(out_dir)
    gather = getattr(model, "full_state_on_rank0", None)  # a pipelined model: its stages live on other ranks
    full = gather() if gather else get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                                        cpu_offload=True))
    if rank() == 0:
        tdtype = DTYPES[dtype]
        base = base_layout(base_model)
        full = _unquantized(full, args, spec, base_model)
        if lora is not None:
            from titan_sft.lora import lora_scaling, merge_lora, save_peft_adapter

            if adapter_dir is not None:
                adapter_dir = Path(adapter_dir)
                tmp_adapter = adapter_dir.with_name(adapter_dir.name + ".partial")
                shutil.rmtree(tmp_adapter, ignore_errors=True)
                save_peft_adapter({k: v.to(tdtype) for k, v in full.items()}, lora, tmp_adapter, base_model,
                                  lora.train_norms, native_to_hf_name, base.stored_name if base else None)
                if objective:
                    (tmp_adapter / "objective.json").write_text(json.dumps(objective, indent=2) + "\n")
                shutil.rmtree(adapter_dir, ignore_errors=True)
                tmp_adapter.rename(adapter_dir)
            full = merge_lora(full, lora_scaling(lora))
        hf_sd = {k: v.to(tdtype).contiguous() for k, v in spec.state_dict_adapter(args).to_hf(full).items()}
        if base is not None:
            hf_sd = _in_base_layout(hf_sd, args, base)
        _write_safetensors(hf_sd, tmp, int(max_shard_gb * 1e9), save_file)
        biases = {routing_bias_layer(k): v for k, v in full.items() if routing_bias_layer(k) is not None}
        if biases:  # fp32 values as JSON numbers (exact: every fp32 is a double)
            (tmp / ROUTING_BIAS_FILE).write_text(json.dumps(
                {str(i): v.float().tolist() for i, v in sorted(biases.items())}, indent=1) + "\n")
            from titan_sft.log import logger

            logger.info(f"[export] the routing biases go to {ROUTING_BIAS_FILE}: the {spec.hf_model_type} format "
                        "has none, so transformers and vLLM route without them (titan_sft's loaders read them)")
        import transformers

        config = hf_config_from_args(args, spec.hf_model_type, spec.hf_architecture, tdtype)
        config["transformers_version"] = transformers.__version__
        if base is not None and base.multimodal:
            config = _multimodal_config(read_config(base.path), config)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in PROCESSOR_FILES if base is not None else ():  # a multimodal base's image/video processors
            if (base.path / name).is_file():
                shutil.copy2(base.path / name, tmp / name)
        if objective:
            (tmp / "objective.json").write_text(json.dumps(objective, indent=2) + "\n")
        tokenizer = save_padded_tokenizer(tokenizer_dir, tmp, args.vocab_size) if tokenizer_dir else None
        if generation_config:
            (tmp / "generation_config.json").write_text(json.dumps(build_generation_config(config, tokenizer), indent=2))
    finalize(tmp, out_dir)
    return out_dir


# A multimodal model's processor files besides the tokenizer's: an export of a run that started from such a
# model carries them, so the directory stays the whole model that transformers and vLLM load.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json",
                   "chat_template.json")


def base_layout(base_model: str | None) -> HFTensors | None:
    """The tensor index of the HF directory a run started from, which an export follows (a multimodal base's
    nesting, fused experts, carried vision tower and mtp tensors); None without one, or when it is gone (the
    export is then text-only, which is said)."""
    if base_model is None:
        return None
    try:
        return index_hf_tensors(resolve_hf_dir(base_model))
    except FileNotFoundError as e:
        from titan_sft.log import logger

        logger.warning(f"[export] the base model is not readable ({e}); the export holds the language model only, "
                       "in the text-only layout")
        return None


def _in_base_layout(hf_sd: dict, args: TransformerArgs, base: HFTensors) -> dict:
    """The export's tensors in the base directory's layout: fused experts if it stores them fused, the
    multimodal nesting, and the tensors a text run does not train (vision tower, mtp) copied unchanged."""
    if base.fused_experts:
        hf_sd = fuse_experts(hf_sd, args.n_experts)
    out = {base.stored_name(k): v for k, v in hf_sd.items()}
    if base.carried:
        from safetensors import safe_open

        from titan_sft.log import logger

        for name, file in base.carried.items():
            with safe_open(str(file), framework="pt") as f:
                out[name] = f.get_tensor(name)
        what = sorted({n.split(".")[0] if n.startswith("mtp.") else "vision tower" for n in base.carried})
        logger.info(f"[export] {len(base.carried)} tensors of the base not trained by this run ({', '.join(what)}) "
                    "copied unchanged")
    return out


def _multimodal_config(base: dict, text: dict) -> dict:
    """A multimodal base's config.json with the exported language model's config as its ``text_config``."""
    version = text.get("transformers_version", base.get("transformers_version"))
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version")}
    out = {**base, "text_config": {**base["text_config"], **text}, "transformers_version": version}
    for key in ("dtype", "torch_dtype", "tie_word_embeddings"):
        if key in base:
            out[key] = text[key]
    return out


def _unquantized(full: dict, args: TransformerArgs, spec: TrainSpec, base_model: str | None) -> dict:
    """A gathered state dict with its NF4 weights (QLoRA) back in high precision: the original weights of the
    HF directory the run started from (the merge then lands on the weights users serve), or, for a base without
    one (a seeded init), the dequantized NF4 values the run computed with."""
    from titan_sft import nf4

    keys = [w for k in full if (w := nf4.weight_key(k)) is not None]
    if not keys:
        return full
    with torch.device("meta"):
        shapes = {k: tuple(p.shape) for k, p in spec.model_cls(args).named_parameters() if k in keys}
    dtype = next(v.dtype for k, v in full.items() if v.is_floating_point() and not nf4.is_nf4_key(k))
    if base_model:
        originals = {}
        for group in nf4.by_block(shapes):  # one block's weights in fp32 at a time
            originals.update({k: v.to(dtype) for k, v in read_hf_weights({k: shapes[k] for k in group}, args,
                                                                          base_model, spec).items()})
        return nf4.restore(full, originals)
    return nf4.dequantized_state(full, shapes, dtype)


def _write_safetensors(hf_sd: dict[str, torch.Tensor], out: Path, limit: int, save_file) -> None:
    """One ``model.safetensors``, or shards of at most ``limit`` bytes plus the index transformers reads."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in hf_sd.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in hf_sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )


def save_padded_tokenizer(tokenizer_dir: str | Path, out_dir: Path, vocab_size: int):
    """Saves the tokenizer with ``<|padding_i|>`` tokens added so that len(tokenizer) == vocab_size; returns it.

    The padding rows are plain (non-special) added tokens, as the reference export writes them: they never occur
    in text, and marking them special would make them look like control tokens to servers and evaluators.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(resolve_hf_dir(tokenizer_dir)), local_files_only=True)
    n_pad = vocab_size - len(tok)
    if n_pad > 0:
        tok.add_tokens([f"<|padding_{i}|>" for i in range(n_pad)], special_tokens=False)
    tok.save_pretrained(str(out_dir))
    return tok


# Tokens that end an assistant turn in the chat templates titan_sft knows (Qwen3/ChatML, Llama 3).
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")


def build_generation_config(config: dict, tokenizer) -> dict:
    """generation_config.json: the model's EOS ids plus the chat template's end-of-turn token.

    vLLM and transformers stop generating at these ids; without the end-of-turn token a chat fine-tune only stops
    at the base EOS and runs on to the token limit.
    """
    eos = config.get("eos_token_id")
    ids = list(eos) if isinstance(eos, list) else ([eos] if eos is not None else [])
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab]
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    ids = list(dict.fromkeys(ids))  # unique, in order
    gen = {"bos_token_id": config.get("bos_token_id"), "eos_token_id": ids[0] if len(ids) == 1 else ids,
           "transformers_version": config.get("transformers_version")}
    pad = config.get("pad_token_id", tokenizer.pad_token_id if tokenizer is not None else None)
    if pad is not None:
        gen["pad_token_id"] = pad
    return {k: v for k, v in gen.items() if v is not None}


@dataclass
class HFExporter:
    """What a run's periodic export writes: ``exporter(model, out_dir)`` on every rank."""

    spec: TrainSpec
    args: TransformerArgs
    dtype: str
    tokenizer_dir: str | None
    max_shard_gb: float
    generation_config: bool = True
    lora: Any = None  # the run's [lora] config when it trains adapters: merged export + PEFT adapter
    base_model: str | None = None  # recorded in the adapter's config (the HF directory the run started from)
    objective: dict | None = None  # the objective's record (objective.json), written beside the weights
    initial_norms: dict | None = None  # trained norms' values before training (LoRA with train_norms), by name

    def save_adapter(self, model, out_dir: str | Path) -> Path:
        """``adapters/best`` or ``adapters/final``: the trainable state as a servable PEFT adapter
        (``titan_sft.lora.save_adapter``). Every rank calls."""
        from titan_sft.lora import save_adapter

        base = base_layout(self.base_model)
        return save_adapter(model, out_dir, self.lora, native_to_hf=native_to_hf_name, dtype=DTYPES[self.dtype],
                            base_model=self.base_model, tokenizer_dir=self.tokenizer_dir,
                            initial_norms=self.initial_norms, objective=self.objective,
                            stored_name=base.stored_name if base else None)

    def __call__(self, model, out_dir: str | Path) -> Path:
        out_dir = Path(out_dir)
        # hf/step-<L> holds the merged model; adapters/step-<L> the PEFT adapter
        adapter_dir = out_dir.parent.parent / "adapters" / out_dir.name if self.lora is not None else None
        return export_hf(model, self.args, out_dir, self.dtype, self.tokenizer_dir, self.max_shard_gb, spec=self.spec,
                         generation_config=self.generation_config, lora=self.lora, adapter_dir=adapter_dir,
                         base_model=self.base_model, objective=self.objective)
