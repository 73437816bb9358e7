"""Warm start from an adapter directory and a data offset (issue 19, item 4)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from titan_sft.data.sampler import RecipeSampler

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--validation.generation_every", "0", "--validation.interval", "0", "--validation.test_path", "",
        "--validation.path", "", "--validation.keep_best", "false", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false",
        "--checkpoint.enable", "false", "--checkpoint.hf_export_dtype", "float32"]


def _run(dump, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_diffusion.toml",
           "--job.dump_folder", str(dump), *FAST, *overrides]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r, [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()
               if json.loads(x)["split"] == "train"]


@pytest.mark.slow
def test_warm_start_from_an_adapter_continues_the_source_model(tmp_path):
    """Run A trains 4 steps and writes adapters/final and its merged HF export (fp32). B starts from A's adapter
    on the base; C starts from A's merged export with fresh adapters (B = 0: they add nothing). Both are A's model,
    so their step-1 losses on the same batch agree (1e-6)."""
    _run(tmp_path / "a", "--training.steps", "4", "--checkpoint.hf_export_interval", "0", "--optimizer.lr", "2e-2",
         "--lora.adapter_interval", "2")
    adapter, merged = tmp_path / "a" / "adapters" / "final", tmp_path / "a" / "hf" / "step-3"
    r, b = _run(tmp_path / "b", "--training.steps", "1", "--lora.init_from", str(adapter),
                "--checkpoint.hf_export_interval", "-1")
    assert "[init] warm start:" in r.stdout
    _, c = _run(tmp_path / "c", "--training.steps", "1", "--model.hf_assets_path", str(merged),
                "--checkpoint.hf_export_interval", "-1")
    _, fresh = _run(tmp_path / "d", "--training.steps", "1", "--checkpoint.hf_export_interval", "-1")
    assert b[0]["loss"] == pytest.approx(c[0]["loss"], rel=1e-6)
    assert abs(b[0]["loss"] - fresh[0]["loss"]) > 1e-3 * fresh[0]["loss"]  # and not the untrained model's

    # lora.adapter_interval 2: an adapter-only snapshot at label 2 (step 3) without a merged export (hf/ holds only
    # the final step's, with its adapter step-3 beside it)
    assert sorted(p.name for p in (tmp_path / "a" / "hf").iterdir()) == ["step-3"]
    assert sorted(p.name for p in (tmp_path / "a" / "adapters").iterdir()) == ["final", "step-2", "step-3"]
    snap, final = load_file(str(tmp_path / "a" / "adapters" / "step-2" / "adapter_model.safetensors")), \
        load_file(str(adapter / "adapter_model.safetensors"))
    assert snap.keys() == final.keys() and any(not torch.equal(snap[k], final[k]) for k in snap)

    # The reference trainer's layout: LoRA weights alone in the adapter, the trained norms in normalization_state.pt
    # (the PEFT model's parameter names) and the base's in normalization_initial_state.pt. Its warm start is A's.
    ref = reference_layout(adapter, tmp_path / "ref")
    _, e = _run(tmp_path / "e", "--training.steps", "1", "--lora.init_from", str(ref),
                "--checkpoint.hf_export_interval", "-1")
    assert e[0]["loss"] == pytest.approx(b[0]["loss"], rel=1e-6)
    (ref / "normalization_state.pt").unlink()  # what warm starts read before: the norms stay the base's
    _, f = _run(tmp_path / "f", "--training.steps", "1", "--lora.init_from", str(ref),
                "--checkpoint.hf_export_interval", "-1")
    assert abs(f[0]["loss"] - b[0]["loss"]) > 1e-5 * b[0]["loss"]


def reference_layout(adapter, out):
    """``adapter`` (titan_sft's, norms as modules_to_save) rewritten as the masked-diffusion reference saves one."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    conf = json.loads((out / "adapter_config.json").read_text())
    conf["modules_to_save"] = None
    (out / "adapter_config.json").write_text(json.dumps(conf))
    tensors = load_file(str(out / "adapter_model.safetensors"))
    lora = {k: v for k, v in tensors.items() if ".lora_" in k}
    norms = {k.replace(".modules_to_save.default", ""): v for k, v in tensors.items() if ".lora_" not in k}
    assert norms and all("norm" in k for k in norms)
    save_file(lora, str(out / "adapter_model.safetensors"))
    torch.save(norms, out / "normalization_state.pt")
    initial = load_file(str(out / "initial_norms.safetensors"))
    torch.save({f"base_model.model.{k}": v for k, v in initial.items()}, out / "normalization_initial_state.pt")
    (out / "initial_norms.safetensors").unlink()
    return out


def test_warm_start_refuses_a_mismatched_adapter(tmp_path):
    import torch

    from titan_sft.config import ConfigError, load_config
    from titan_sft.lora import apply_lora, save_peft_adapter, warm_start
    from titan_sft.models import build_model
    from titan_sft.models.hf_adapter import native_to_hf_name
    from titan_sft.registry import get_train_spec

    cfg = load_config("train_configs/debug_diffusion.toml", [])
    model = build_model(get_train_spec("qwen3").flavors["debug"], device="cpu")
    apply_lora(model, cfg)
    state = {n: torch.zeros(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    small = dict(vars(cfg.lora), rank=4)
    save_peft_adapter(state, type(cfg.lora)(**small), tmp_path / "r4", None, True, native_to_hf_name)
    with pytest.raises(ConfigError, match="lora.init_from.*r = 4, this run lora.rank = 16"):
        warm_start(model, tmp_path / "r4", cfg.lora)
    partial = {k: v for k, v in state.items() if "layers.0." not in k}
    save_peft_adapter(partial, cfg.lora, tmp_path / "part", None, True, native_to_hf_name)
    with pytest.raises(ConfigError, match="lora.init_from.*lacks layers.0."):
        warm_start(model, tmp_path / "part", cfg.lora)
    with pytest.raises(ConfigError, match="not a PEFT adapter directory"):
        warm_start(model, tmp_path, cfg.lora)

    # the reference trainer's norms beside the adapter: all trained norms, by names of this model, on its base
    import dataclasses

    from titan_sft.lora import check_initial_norms

    full = tmp_path / "full"
    save_peft_adapter({k: v for k, v in state.items() if "norm" not in k}, cfg.lora, full, None, False,
                      native_to_hf_name)
    norms = {native_to_hf_name(k): torch.ones(v.shape) for k, v in state.items() if "norm" in k}
    torch.save({k: v for k, v in norms.items() if "layers.1." not in k}, full / "normalization_state.pt")
    with pytest.raises(ConfigError, match="normalization_state.pt lacks the trained norm 'layers.1."):
        warm_start(model, full, cfg.lora)
    torch.save({**norms, "model.layers.0.mlp.gate_proj.weight": torch.ones(1)}, full / "normalization_state.pt")
    with pytest.raises(ConfigError, match="holds 'model.layers.0.mlp.gate_proj.weight', not a norm"):
        warm_start(model, full, cfg.lora)
    torch.save({f"base_model.model.{k}": v for k, v in norms.items()}, full / "normalization_state.pt")
    assert warm_start(model, full, cfg.lora) == len(state)
    assert all(torch.equal(p, torch.ones(p.shape)) for n, p in model.named_parameters() if "norm" in n)
    with pytest.raises(ConfigError, match="lora.train_norms"):
        warm_start(model, full, dataclasses.replace(cfg.lora, train_norms=False))
    initial = {k: torch.full(v.shape, 2.0) for k, v in state.items() if "norm" in k}
    torch.save({native_to_hf_name(k): v for k, v in initial.items()}, full / "normalization_initial_state.pt")
    check_initial_norms(full, initial)
    initial["norm.weight"] = initial["norm.weight"] + 0.5
    with pytest.raises(ConfigError, match="'norm.weight' of the base the adapter was trained from.*0.5"):
        check_initial_norms(full, initial)


def test_skip_examples_starts_the_order_later_and_is_kept_on_resume():
    plain = RecipeSampler(100, 4)
    skipped = RecipeSampler(100, 4, offset=8)
    assert np.array_equal(skipped.global_indices(0), plain.global_indices(2))
    assert np.array_equal(skipped.global_indices(24), plain.global_indices(26) % 100)
    skipped.step = 5
    resumed = RecipeSampler(100, 4, offset=8)
    resumed.load_state_dict(skipped.state_dict())
    assert resumed.step == 5
    with pytest.raises(ValueError, match="offset=8, this run has 0"):
        RecipeSampler(100, 4).load_state_dict(skipped.state_dict())
    old = {k: v for k, v in plain.state_dict().items() if k != "offset"}  # a checkpoint from before the key
    RecipeSampler(100, 4).load_state_dict(old)
