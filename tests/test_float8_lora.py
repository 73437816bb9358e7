"""float8 together with LoRA (issue 19, item 2): torchao float8 on the frozen base matmuls, the adapters in high
precision (emulated float8 on CPU), the trainable set unchanged by the conversion (a check stops the run when a
converter changes it), and validation matmuls in the compute dtype."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_sft.config import ConfigError, load_config
from titan_sft.converters import apply_float8, high_precision_matmuls
from titan_sft.lora import apply_lora
from titan_sft.models import build_model
from titan_sft.registry import get_train_spec, register_converter

ROOT = Path(__file__).resolve().parent.parent
DEBUG = get_train_spec("qwen3").flavors["debug"]


def _models():
    cfg = load_config("train_configs/debug_diffusion.toml", ["--training.float8", "true"])
    out = []
    for float8 in (False, True):
        torch.manual_seed(0)
        m = build_model(DEBUG, device="cpu")
        m.init_weights()
        if float8:
            apply_float8(m, "rowwise", emulate=True)
        apply_lora(m, cfg)
        for mod in m.modules():
            if hasattr(mod, "reset_converter_parameters"):
                mod.reset_converter_parameters(0)
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n.endswith("lora_b"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05)
        out.append(m)
    return cfg, out


def test_float8_base_matmuls_with_high_precision_adapters():
    cfg, (plain, f8) = _models()
    wq = f8.layers["0"].attention.wq
    assert type(wq).__name__ == "Float8LoRALinear" and wq.weight.requires_grad is False
    assert {n for n, p in plain.named_parameters() if p.requires_grad} == \
        {n for n, p in f8.named_parameters() if p.requires_grad}
    ids = torch.randint(0, DEBUG.vocab_size, (2, 32))
    ref = plain(ids, hidden_only=True)
    out = f8(ids, hidden_only=True)
    assert not torch.equal(out, ref) and (out - ref).norm() < 0.1 * ref.norm()  # float8 rounding (e4m3)
    with torch.no_grad(), high_precision_matmuls(f8):  # validation: the compute dtype, adapters included
        assert torch.equal(f8(ids, hidden_only=True), ref.detach())
    # a step changes the adapters (and norms) only
    from titan_sft.optimizer import build_optimizer

    before = {n: p.detach().clone() for n, p in f8.named_parameters()}
    opt = build_optimizer(f8, cfg.optimizer)
    f8(ids, hidden_only=True).pow(2).mean().backward()
    opt.step()
    changed = {n for n, p in f8.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(n.endswith(("lora_a", "lora_b")) or "norm" in n for n in changed)
    assert any(n.endswith("lora_b") for n in changed)


def test_a_converter_that_changes_the_trainable_set_stops_the_run(tmp_path):
    import torch.distributed as dist

    from titan_sft.parallel import ParallelDims, parallelize_transformer

    def freeze_norms(model, cfg, device):
        for n, p in model.named_parameters():
            if "norm" in n:
                p.requires_grad_(False)

    register_converter("test_freeze_norms", freeze_norms)
    cfg = load_config("train_configs/debug_diffusion.toml", ["--model.converters", "lora,test_freeze_norms"])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        mesh, *_ = ParallelDims.from_config(cfg, 1).build_mesh("cpu")
        with torch.device("meta"):
            model = build_model(DEBUG)
        with pytest.raises(ConfigError, match=r"model.converters.*change LoRA's trainable parameters: \d+ missing"):
            parallelize_transformer(model, mesh, cfg, torch.device("cpu"), get_train_spec("qwen3").tp_plan_fn())
    finally:
        dist.destroy_process_group()


def test_float8_with_lora_refused_only_where_unsupported():
    load_config("train_configs/debug_diffusion.toml", ["--training.float8", "true"])
    with pytest.raises(ConfigError, match="training.float8"):
        load_config("train_configs/debug_diffusion.toml", ["--training.float8", "true", "--parallelism.tp", "2"])


@pytest.mark.slow
def test_debug_diffusion_job_in_float8_tracks_high_precision(tmp_path):
    """20 steps of the debug diffusion job (LoRA) with emulated float8 stay within 5% of the fp32 losses
    (measured: at most 2.5%)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    losses = {}
    for f8 in ("false", "true"):
        dump = tmp_path / f8
        cmd = [sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_diffusion.toml",
               "--training.steps", "20", "--validation.generation_every", "0", "--validation.interval", "0",
               "--validation.test_path", "", "--training.float8", f8, "--job.dump_folder", str(dump),
               "--checkpoint.enable", "false", "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1",
               "--metrics.enable_tensorboard", "false"]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        losses[f8] = [json.loads(x)["loss"] for x in (dump / "metrics.jsonl").read_text().splitlines()
                      if json.loads(x)["split"] == "train"]
    assert len(losses["true"]) == 20 and losses["true"] != losses["false"]
    assert losses["true"] == pytest.approx(losses["false"], rel=5e-2)


def test_tensorwise_float8_scales_hook_lives_on_the_model_not_the_process(monkeypatch):
    """Tensor-wise float8 on a GPU all-gathers FSDP shards in float8 and recomputes every weight's scale after
    each optimizer step. That work hangs off the model (``after_optimizer_step``, which the trainer registers on
    its own optimizer), not a process-wide optimizer hook: one of those kept the first trainer's model alive and
    ran it at every step of a later trainer in the same process (the GPU tests, the GPU check's phases)."""
    import torch.optim.optimizer as optim_mod
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    import titan_sft.converters as conv

    monkeypatch.setattr(conv, "float8_supported", lambda device: True)  # the GPU branch, on a CPU model
    cfg = load_config(None, ["--training.float8", "true", "--training.float8_recipe", "tensorwise"])
    before = dict(optim_mod._global_optimizer_post_hooks)
    model = build_model(DEBUG, device="cpu")
    conv.float8_converter(model, cfg, torch.device("cuda"))
    assert dict(optim_mod._global_optimizer_post_hooks) == before
    assert model.after_optimizer_step.func is precompute_float8_dynamic_scale_for_fsdp
    assert model.after_optimizer_step.args == (model,)
