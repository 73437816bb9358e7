"""``python -m titan_sft.convert``: DCP training checkpoints <-> HF safetensors directories (one process, CPU).

    python -m titan_sft.convert to-hf --checkpoint outputs/run/checkpoints/step-99 --out hf_dir [--dtype bfloat16]
    python -m titan_sft.convert from-hf --hf Qwen3-0.6B --out start_ckpt [--model qwen3 --flavor 0.6B]
    [torchrun --nproc_per_node N -m] python -m titan_sft.convert from-reference --reference OLD/checkpoints/step-99 \
        --config train_configs/qwen3_8b_sft.toml [--job.dump_folder NEW ...config overrides]
    [torchrun ...] python -m titan_sft.convert from-accelerate --checkpoint OLD/checkpoint-500 \
        --config train_configs/qwen3_8b_diffusion_lora_reference.toml [--job.dump_folder NEW ...]

``to-hf`` rebuilds the model from the checkpoint's own saved config (meta.json) and writes what a run's export
writes. ``from-hf`` writes a weights-only DCP checkpoint; start a run from it with ``--checkpoint.resume PATH``
(model weights are loaded; optimizer, schedule and data order start fresh). ``from-reference`` continues a run of
the Levanter-port SFT script: its checkpoint (weights, Adam moments, step) becomes ``checkpoints/step-L`` of the
config's run folder, with the schedule and data order at its step; run the config to continue (docs/migrating.md).
``from-accelerate`` does the same for the masked-diffusion reference trainer's Accelerate checkpoint (adapters,
trained norms, Adam moments, update count; the lr checked against the config's schedule).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from titan_sft.checkpoint import model_state, read_meta
from titan_sft.config import ConfigError, JobConfig, _set
from titan_sft.hf_io import export_hf, model_args, read_hf_config
from titan_sft.models import build_model, load_hf
from titan_sft.models.hf_adapter import text_config
from titan_sft.registry import get_train_spec, spec_for_hf_model_type


class ConvertError(RuntimeError):
    pass


def _config_from_meta(meta: dict) -> JobConfig:
    cfg = JobConfig()
    for section, table in meta["config"].items():
        for key, value in table.items():
            _set(cfg, section, key, value, from_cli=False, where="checkpoint meta.json: ")
    return cfg


def model_from_checkpoint(checkpoint: str | Path):
    """(model on CPU with the checkpoint's weights, its run config, train spec, model args), in one process.

    The model is rebuilt from the checkpoint's saved config, LoRA adapters included when the run trained them
    (other converters, float8, change only how a run computes, not the weights)."""
    from titan_sft.lora import apply_lora

    ckpt = Path(checkpoint)
    meta = read_meta(ckpt)
    if meta is None:
        raise ConvertError(f"{ckpt}: not a complete titan_sft checkpoint (no .metadata or meta.json)")
    cfg = _config_from_meta(meta)
    spec = get_train_spec(cfg.model.name)
    args = model_args(cfg.model, spec)
    identity = meta.get("base_identity")
    if meta.get("trainable_only") and not cfg.model.init_from_hf:  # an older LoRA run's best checkpoint
        raise ConvertError(f"{ckpt}: holds the trainable weights only, and its run started from no HF model")
    if identity is not None or meta.get("trainable_only"):  # the frozen base is rebuilt where the run took it
        model, args = _base_model(identity["source"] if identity else {"kind": "hf", "path": cfg.model.hf_assets_path},
                                  args, spec)
    else:
        model = build_model(args)
    if "lora" in cfg.model.converters:
        apply_lora(model, cfg)
    if identity is None and not meta.get("trainable_only"):
        model.to_empty(device="cpu")
    state = {"model": model_state(model)}
    if identity is not None:
        from titan_sft.base_identity import describe, fingerprint, first_difference

        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        why = first_difference(identity["fingerprint"],
                               fingerprint(state["model"], [k for k in state["model"] if k not in trainable]))
        if why is not None:
            raise ConvertError(f"{ckpt}: its base ({describe(identity['source'])}) is not what was trained on: {why}")
        stored = trainable | {n for n, _ in model.named_buffers()}
        state["model"] = {k: v for k, v in state["model"].items() if k in stored}
    elif meta.get("trainable_only"):
        state["model"] = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    model.load_state_dict(state["model"], strict=False)
    return model.eval(), cfg, spec, args


def _base_model(source: dict, args, spec):
    """(model with the frozen base of an adapter-only checkpoint, its args), from the source the run recorded."""
    from titan_sft.hf_io import resolve_hf_dir

    if source["kind"] == "hf":
        model = load_hf(resolve_hf_dir(source["path"]))
        return model, model.args
    model = build_model(args)
    model.to_empty(device="cpu")
    if source["kind"] == "dcp":
        dcp.load({"model": model_state(model)}, checkpoint_id=str(source["path"]), no_dist=True)
        return model, args
    import torch

    from titan_sft.parallel.distributed import init_sharded

    with torch.device("meta"):
        reference = spec.model_cls(args)
    torch.manual_seed(int(source["seed"]))  # the run's seeded init (titan_sft.train.Trainer._random_init)
    init_sharded(model, reference, torch.device("cpu"))
    return model, args


def to_hf(checkpoint: str, out: str, dtype: str = "bfloat16", tokenizer: str | None = None) -> Path:
    """DCP checkpoint -> HF directory, rebuilt from the checkpoint's saved config (LoRA adapters merged, and the
    PEFT adapter written to ``<out>-adapter``)."""
    model, cfg, spec, args = model_from_checkpoint(checkpoint)
    tok = tokenizer or cfg.model.tokenizer_path or cfg.model.hf_assets_path or None
    if tok and not any((Path(tok) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        print(f"convert: no tokenizer in {tok}; writing no tokenizer (pass --tokenizer DIR)", file=sys.stderr)
        tok = None
    lora = cfg.lora if "lora" in cfg.model.converters else None
    return export_hf(model, args, out, dtype, tok, cfg.checkpoint.hf_max_shard_size_gb, spec=spec, lora=lora,
                     adapter_dir=f"{out}-adapter" if lora else None,
                     base_model=cfg.model.hf_assets_path if cfg.model.init_from_hf else None)


def from_hf(hf: str, out: str, model_name: str | None = None, flavor: str | None = None) -> Path:
    """HF directory -> weights-only DCP checkpoint (atomic) that a run can start from."""
    hf_cfg = read_hf_config(hf)
    spec = get_train_spec(model_name) if model_name else spec_for_hf_model_type(text_config(hf_cfg).get("model_type"))
    model = load_hf(hf)
    if flavor is not None:
        want = spec.flavors.get(flavor)
        if want is None:
            raise ConvertError(f"--flavor {flavor}: not a {spec.name} flavor; allowed: {', '.join(spec.flavors)}")
        if want.num_params() != model.args.num_params():
            raise ConvertError(f"--flavor {flavor}: {want.num_params():,} parameters, the HF model has "
                               f"{model.args.num_params():,}")
    out_dir = Path(out)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    dcp.save({"model": model_state(model)}, checkpoint_id=str(tmp), no_dist=True)
    cfg = JobConfig()
    cfg.model.name, cfg.model.hf_assets_path, cfg.model.init_from_hf = spec.name, str(hf), True
    if flavor:
        cfg.model.flavor = flavor
    meta = {"step": 0, "label": -1, "kind": "weights_only", "time": time.time(), "source": str(hf),
            "config": cfg.to_dict()}
    (tmp / "meta.json").write_text(json.dumps(meta))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.convert", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-hf", help="DCP checkpoint -> HF safetensors directory")
    a.add_argument("--checkpoint", required=True)
    a.add_argument("--out", required=True)
    a.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    a.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the run's)")
    b = sub.add_parser("from-hf", help="HF safetensors directory -> DCP checkpoint")
    b.add_argument("--hf", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--model", default=None)
    b.add_argument("--flavor", default=None)
    c = sub.add_parser("from-reference", help="Levanter-port script checkpoint -> titan_sft checkpoint to resume")
    c.add_argument("--reference", required=True, help="its checkpoints/step-L or checkpoints-temp directory")
    c.add_argument("--config", required=True, help="the titan_sft config of the continuing run (TOML)")
    d = sub.add_parser("from-accelerate", help="masked-diffusion reference trainer's Accelerate checkpoint -> "
                                               "titan_sft checkpoint to resume")
    d.add_argument("--checkpoint", required=True, help="its checkpoint-N directory (Accelerate save_state)")
    d.add_argument("--config", required=True, help="the titan_sft config of the continuing run (TOML)")
    ns, rest = ap.parse_known_args(argv)
    if rest and ns.cmd not in ("from-reference", "from-accelerate"):
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if ns.cmd == "from-reference":
            from titan_sft.config import load_config
            from titan_sft.from_reference import import_reference

            path = import_reference(ns.reference, load_config(ns.config, rest))
        elif ns.cmd == "from-accelerate":
            from titan_sft.config import load_config
            from titan_sft.from_accelerate import import_accelerate

            path = import_accelerate(ns.checkpoint, load_config(ns.config, rest))
        elif ns.cmd == "to-hf":
            path = to_hf(ns.checkpoint, ns.out, ns.dtype, ns.tokenizer)
        else:
            path = from_hf(ns.hf, ns.out, ns.model, ns.flavor)
    except (ConvertError, ConfigError, FileNotFoundError, ValueError, KeyError) as e:
        print(f"convert: error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 2
    if os.environ.get("RANK", "0") == "0":
        print(f"convert: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from titan_sft.parallel.distributed import exit_process

    exit_process(main())  # from-reference runs a Trainer: the same teardown as training
