"""Config: TOML + overrides with coercion, and one-line errors naming the key."""

import json

import pytest

from titan_sft.config import ConfigError, load_config, parse_overrides


def write(tmp_path, text):
    p = tmp_path / "c.toml"
    p.write_text(text)
    return p


def test_toml_and_overrides(tmp_path):
    p = write(tmp_path, '[training]\nsteps = 5\nmax_grad_norm = 1\n[optimizer]\nlr = 1e-3\n')
    cfg = load_config(p, ["--training.steps", "20", "--optimizer.lr=2e-4", "--data.shuffle", "--model.flavor", "0.6B"])
    assert cfg.training.steps == 20 and cfg.optimizer.lr == 2e-4 and cfg.data.shuffle is True
    assert cfg.training.max_grad_norm == 1.0 and isinstance(cfg.training.max_grad_norm, float)
    assert cfg.model.flavor == "0.6B"
    cfg = load_config(None, ["--metrics.enable_tensorboard", "false", "--lr_scheduler.warmup", "0.05"])
    assert cfg.metrics.enable_tensorboard is False and cfg.lr_scheduler.warmup == 0.05


def test_resolved_config_written(tmp_path):
    cfg = load_config(None, ["--training.steps", "3"])
    cfg.write_resolved(tmp_path / "resolved_config.json")
    data = json.loads((tmp_path / "resolved_config.json").read_text())
    assert data["training"]["steps"] == 3 and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["--training.stepz", "3"], "'training.stepz'.*did you mean 'steps'"),
        (["--trainin.steps", "3"], "'\\[trainin\\]'.*did you mean 'training'"),
        (["--training.steps", "three"], "'training.steps'.*integer"),
        (["--training.steps", "-1"], "'training.steps'.*>= 0"),
        (["--model.attention", "flash"], "'model.attention'.*'sdpa'"),
        (["--data.shuffle", "maybe"], "'data.shuffle'.*true or false"),
        (["--training.global_batch_size", "8", "--training.loss_groups", "3"], "'training.loss_groups'.*divisor"),
        (["--lr_scheduler.warmup", "2.5"], "'lr_scheduler.warmup'.*whole number"),
    ],
)
def test_errors_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        load_config(None, overrides)
    assert "\n" not in str(e.value)


def test_toml_errors_name_the_file(tmp_path):
    p = write(tmp_path, "[training]\nsteps = 'ten'\n")
    with pytest.raises(ConfigError, match=r"c.toml: config key 'training.steps'"):
        load_config(p)
    p = write(tmp_path, "[nope]\nx = 1\n")
    with pytest.raises(ConfigError, match=r"c.toml: unknown config section '\[nope\]'"):
        load_config(p)
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")


def test_parse_overrides_forms():
    assert parse_overrides(["--a.b", "1", "--c.d=2", "--e.f"]) == [("a", "b", "1"), ("c", "d", "2"), ("e", "f", "true")]
    with pytest.raises(ConfigError, match="unexpected argument"):
        parse_overrides(["steps"])


@pytest.mark.parametrize("module", ["titan_sft.train", "titan_sft.data.prepare", "titan_sft.data.prepare_diffusion",
                                    "titan_sft.convert", "titan_sft.generate", "titan_sft.evaluate",
                                    "titan_sft.download"])
def test_every_cli_help_runs(module):
    """argparse %-formats help texts: a literal % (the chat template's {% generation %}) must not crash --help."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "usage:" in r.stdout
