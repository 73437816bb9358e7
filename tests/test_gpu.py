"""GPU-only checks (skipped without CUDA; benchmarks/gpu_check.sh runs them on a GPU machine): each attention
backend against sdpa in both modes, float8 training steps, and NCCL FSDP x TP over the GPUs present."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["flex", "varlen", "flash_varlen"])
def test_backend_matches_sdpa_forward_and_backward(name, causal):
    from titan_sft.models.attention import AttentionBackend

    if name == "flash_varlen" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn not installed")
    dev = torch.device("cuda")
    cu = torch.tensor([0, 700, 2048, 2100, 4096], dtype=torch.int32, device=dev)  # 2 rows of 2048
    torch.manual_seed(0)
    q = torch.randn(2, 8, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, 2, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(2, 2, 2048, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
    outs, grads = {}, {}
    for b in ("sdpa", name):
        backend = AttentionBackend(b, causal=causal)
        out = backend(q, k, v, backend.prepare(2, 2048, dev, cu))
        out.float().pow(2).mean().backward()
        outs[b], grads[b] = out.float(), [t.grad.float().clone() for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
    assert (outs[name] - outs["sdpa"]).abs().max() < 2e-2
    for g, r in zip(grads[name], grads["sdpa"]):
        assert (g - r).norm() / r.norm() < 2e-2


def _train(nproc, *overrides):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", "train_configs/debug_model.toml", "--training.steps", "5",
           "--checkpoint.enable", "false", "--checkpoint.hf_export_interval", "-1",
           "--validation.generation_eval_path", "", "--metrics.log_freq", "1", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_steps_on_gpu(tmp_path, recipe):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs SM 8.9+")
    extra = ["--training.skip_startup_checks", "true"] if recipe == "tensorwise" else []
    r = _train(1, "--training.float8", "true", "--training.float8_recipe", recipe, "--training.param_dtype",
               "bfloat16", "--job.dump_folder", str(tmp_path), *extra)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="FSDP 2 x TP 2 needs 4 GPUs")
def test_nccl_fsdp_x_tp(tmp_path):
    r = _train(4, "--parallelism.tp", "2", "--training.param_dtype", "bfloat16", "--job.dump_folder", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP 2 needs 2 GPUs")
def test_float8_tensorwise_tp_all_gathers_in_float8(tmp_path):
    """torchao's float8 TP styles (float8_tp_plan) over NCCL: float8 all-gathers of the activations run."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs SM 8.9+")
    common = ["--parallelism.tp", "2", "--training.float8", "true", "--training.float8_recipe", "tensorwise",
              "--training.skip_startup_checks", "true", "--training.param_dtype", "bfloat16"]
    r = _train(2, *common, "--job.dump_folder", str(tmp_path / "f8tp"))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("attention", ["varlen", "flex"])
def test_diffusion_lora_steps_on_gpu_match_sdpa(tmp_path, attention):
    """The masked-diffusion debug job (bidirectional attention, LoRA) for a few fp32 steps: a GPU backend gives the
    sdpa losses."""
    import json

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    losses = {}
    for backend in ("sdpa", attention):
        dump = tmp_path / backend
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
               "titan_sft.train", "--config", "train_configs/debug_diffusion.toml", "--training.steps", "5",
               "--model.attention", backend, "--validation.generation_every", "0", "--checkpoint.enable", "false",
               "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1", "--job.dump_folder", str(dump)]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        losses[backend] = [json.loads(x)["loss"] for x in (dump / "metrics.jsonl").read_text().splitlines()
                           if json.loads(x)["split"] == "train"]
    assert losses[attention] == pytest.approx(losses["sdpa"], rel=2e-3)
