"""The shipped configs carry the recipe's values; --dry-run prints the plan without building real weights."""

import subprocess
import sys
from pathlib import Path

import pytest

from titan_sft.config import load_config
from titan_sft.registry import TrainSpec, get_train_spec, list_train_specs, register_train_spec
from titan_sft.dry_run import dry_run

ROOT = Path(__file__).resolve().parent.parent

RECIPES = {  # recipe.md table: lr, wd, warmup, max_grad_norm, global batch, steps
    "qwen3_8b": (5e-6, 0.01, 0.05, 1.0, 64, 2000),
    "qwen3_4b": (2e-5, 0.0, 0.03, 0.2, 128, 0),
    "qwen3_1_7b": (2e-5, 0.0, 0.03, 0.2, 128, 0),
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_values(name):
    c = load_config(ROOT / "train_configs" / f"{name}.toml")
    lr, wd, warmup, clip, batch, steps = RECIPES[name]
    assert (c.optimizer.lr, c.optimizer.weight_decay, c.lr_scheduler.warmup, c.training.max_grad_norm) == (lr, wd, warmup, clip)
    assert (c.training.global_batch_size, c.training.steps, c.training.loss_groups) == (batch, steps, 2)
    assert (c.lr_scheduler.decay, c.lr_scheduler.min_lr_ratio, c.lr_scheduler.decay_type) == (0.9, 0.1, "cosine")
    assert (c.optimizer.beta1, c.optimizer.beta2, c.optimizer.eps) == (0.9, 0.999, 1e-8)
    assert (c.checkpoint.interval, c.checkpoint.hf_export_interval, c.checkpoint.hf_export_dtype) == (20, 100, "bfloat16")
    assert c.data.shuffle is False and c.model.reset_positions_per_document is False


def test_dry_run_plan_for_the_8b_recipe_shape():
    cfg = load_config(ROOT / "train_configs" / "qwen3_8b.toml", [
        "--data.path", "titan_sft/assets/debug_data/packed", "--model.init_from_hf", "false"])
    text = dry_run(cfg)
    assert "warmup 100 / stable 100 / decay 1800" in text  # int(0.05*2000), the rest, int(0.9*2000)
    assert "0: 0," in text and "final lr 5e-07" in text
    assert "labels 100, 200, 300, 400, ..., 1900, 1999" in text  # HF export cadence
    assert "64 packed examples" in text and "excluded" in text


def test_dry_run_cli_and_bad_key():
    run = lambda *a: subprocess.run([sys.executable, "-m", "titan_sft.train", "--config",  # noqa: E731
                                     "train_configs/debug_model.toml", *a], cwd=ROOT, capture_output=True, text=True)
    ok = run("--dry-run")
    assert ok.returncode == 0 and "steps: 250 (explicit)" in ok.stdout
    bad = run("--dry-run", "--training.stepz", "3")
    assert bad.returncode == 2 and "training.stepz" in bad.stderr and "did you mean 'steps'" in bad.stderr


def test_registry_lookup_and_register():
    assert {"qwen3", "llama3"} <= set(list_train_specs())
    with pytest.raises(KeyError, match="known: .*llama3.*qwen3"):
        get_train_spec("gpt2")
    custom = get_train_spec("qwen3").replace(name="my_qwen3")
    register_train_spec(custom)
    assert get_train_spec("my_qwen3") is custom
    with pytest.raises(ValueError, match="already registered"):
        register_train_spec(custom)
    assert isinstance(custom, TrainSpec)


@pytest.mark.parametrize("name,cp,heads", [("qwen3_8b_32k", 2, "16,384 on this rank at cp 2"),
                                           ("qwen3_8b_128k", 8, "16,384 on this rank at cp 8")])
def test_long_context_configs_plan_context_parallel(name, cp, heads, monkeypatch):
    """The long-context variants keep the 8B recipe's values and plan cp ranks per row with the activation
    estimate; the 128k one extends RoPE with YaRN (factor 4 over 32768 positions) up to 131072 positions."""
    from titan_sft.hf_io import model_args

    c = load_config(ROOT / "train_configs" / f"{name}.toml", ["--model.init_from_hf", "false"])
    base = load_config(ROOT / "train_configs" / "qwen3_8b.toml")
    assert (c.optimizer, c.lr_scheduler, c.training.global_batch_size, c.training.loss_groups) == (
        base.optimizer, base.lr_scheduler, base.training.global_batch_size, base.training.loss_groups)
    assert c.parallelism.cp == cp and c.parallelism.cp_mode == "ulysses"
    monkeypatch.setenv("WORLD_SIZE", "16")
    text = dry_run(c)
    assert f"context parallel {cp} (ulysses)" in text and heads in text
    args = model_args(c.model, get_train_spec("qwen3"))
    if name == "qwen3_8b_128k":
        assert args.rope_scaling.rope_type == "yarn" and args.rope_scaling.factor == 4.0 and args.max_seq_len == 131072
    else:
        assert args.rope_scaling is None


@pytest.mark.parametrize("name,world,stages", [
    ("llama3_70b", "32", "layers per stage [9, 11, 11, 10, 10, 10, 10, 9]"),
    ("qwen3_32b_32k", "16", "layers per stage [16, 16, 16, 16]")])
def test_pipeline_configs_plan_stages(name, world, stages, monkeypatch):
    """The multi-node pipeline configs keep the recipe's values and plan their stages, the schedule's bubble and
    the memory of the heaviest pp rank for their world size."""
    c = load_config(ROOT / "train_configs" / f"{name}.toml", ["--model.init_from_hf", "false"])
    base = load_config(ROOT / "train_configs" / "qwen3_8b.toml")
    assert (c.optimizer, c.lr_scheduler, c.training.global_batch_size, c.training.loss_groups) == (
        base.optimizer, base.lr_scheduler, base.training.global_batch_size, base.training.loss_groups)
    monkeypatch.setenv("WORLD_SIZE", world)
    text = dry_run(c)
    assert f"mesh: pp 4 x dp_replicate 1 x dp_shard {int(world) // 4}" in text and stages in text
    assert "bubble 15.8% of the step in the schedule's theory" in text and "pp rank 3: stage" in text
    print(text)


RECIPE_WORLDS = {"llama3_70b": 32, "qwen3_30b_a3b": 16, "qwen3_30b_a3b_lora": 16, "qwen3_32b_32k": 16,
                 "qwen3_8b_32k": 16, "qwen3_8b_128k": 16, "qwen3_5_35b_a3b": 16}


@pytest.mark.parametrize("path", sorted(p for p in (ROOT / "train_configs").glob("*.toml")
                                        if "init_from_hf = true" in p.read_text() and "flavor" in p.read_text()))
def test_recipe_configs_dry_run_offline_from_their_flavor(path, monkeypatch):
    """Issue 38, item 11: a recipe config whose HF directory is not on the machine plans from its flavor's own
    arguments (no download, no overrides), and says so."""
    cfg = load_config(path)
    monkeypatch.setenv("WORLD_SIZE", str(RECIPE_WORLDS.get(path.stem, 8 if cfg.parallelism.ep == 1 else 16)))
    if (ROOT / cfg.model.hf_assets_path / "config.json").is_file():
        pytest.skip("the HF directory is here")
    text = dry_run(cfg)
    assert f"{cfg.model.hf_assets_path}/config.json is not on this machine: planned from flavor {cfg.model.flavor}'s" \
           in text
    assert f"model: {cfg.model.name} {cfg.model.flavor}," in text
