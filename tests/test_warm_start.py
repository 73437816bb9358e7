"""Warm start from an adapter directory and a data offset (issue 19, item 4)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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
    _run(tmp_path / "a", "--training.steps", "4", "--checkpoint.hf_export_interval", "0", "--optimizer.lr", "2e-2")
    adapter, merged = tmp_path / "a" / "adapters" / "final", tmp_path / "a" / "hf" / "step-3"
    r, b = _run(tmp_path / "b", "--training.steps", "1", "--lora.init_from", str(adapter),
                "--checkpoint.hf_export_interval", "-1")
    assert "[init] warm start:" in r.stdout
    _, c = _run(tmp_path / "c", "--training.steps", "1", "--model.hf_assets_path", str(merged),
                "--checkpoint.hf_export_interval", "-1")
    _, fresh = _run(tmp_path / "d", "--training.steps", "1", "--checkpoint.hf_export_interval", "-1")
    assert b[0]["loss"] == pytest.approx(c[0]["loss"], rel=1e-6)
    assert abs(b[0]["loss"] - fresh[0]["loss"]) > 1e-3 * fresh[0]["loss"]  # and not the untrained model's


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
