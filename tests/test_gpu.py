"""GPU-only checks (skipped without CUDA; benchmarks/gpu_check.sh runs them, phase a): each attention backend against
sdpa in both modes, float8 training steps, the NCCL collective path on one GPU (FSDP2 at world size 1 with every
per-step collective, a 1-rank TP mesh with loss parallel), masked diffusion + LoRA in bf16 on each GPU backend, and
NCCL FSDP x TP where the GPUs are there. Trainer runs are in-process (one import of torch and transformers)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parent.parent
FAST = ["--checkpoint.hf_export_interval", "-1", "--validation.generation_eval_path", "", "--metrics.log_freq", "1",
        "--metrics.enable_tensorboard", "false"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _train(dump, *overrides, config="train_configs/debug_model.toml", inspect=None):
    """One in-process, one-rank run (NCCL + gloo process group); returns its train records. ``inspect(trainer)``
    runs after the model is built, before training."""
    from titan_sft.config import load_config
    from titan_sft.train import Trainer

    os.environ["MASTER_PORT"] = str(_free_port())
    import torch.distributed as dist

    cfg = load_config(config, [*FAST, "--job.dump_folder", str(dump), *overrides])
    trainer = None
    try:  # the construction too: a failed one must not leave its process group to the next test
        trainer = Trainer(cfg)
        if inspect:
            inspect(trainer)
        trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
    return [r for r in map(json.loads, (Path(dump) / "metrics.jsonl").read_text().splitlines())
            if r["split"] == "train"]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", ["flex", "varlen", "flash_varlen"])
def test_backend_matches_sdpa_forward_and_backward(name, causal):
    from titan_sft.models.attention import AttentionBackend

    if name == "flash_varlen" and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn not installed (gpu_check's table shows its case as failed too)")
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


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_steps_convert_the_block_linears_and_learn(tmp_path, recipe):
    """float8 on the GPU's real kernels: the block linears are Float8Linear (the debug model's every projection has
    dims divisible by 16), and 12 steps give finite losses that fall."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs SM 8.9+")
    from torchao.float8.float8_linear import Float8Linear

    converted = []

    def count(trainer):
        converted.append(sum(isinstance(m, Float8Linear) for m in trainer.model.modules()))

    extra = ["--training.skip_startup_checks", "true"] if recipe == "tensorwise" else []
    recs = _train(tmp_path, "--training.float8", "true", "--training.float8_recipe", recipe, "--training.steps",
                  "12", "--training.param_dtype", "bfloat16", "--checkpoint.enable", "false", *extra, inspect=count)
    assert converted == [4 * 7]  # 4 blocks x (q, k, v, o, gate, up, down)
    losses = [r["loss"] for r in recs]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses


def test_nccl_fsdp_one_gpu_collectives_and_exact_resume(tmp_path):
    """World size 1 on NCCL (+ gloo for host tensors): every per-step collective of the trainer (loss denominators,
    the step's agreement all-reduce, held-out loss, temporary and async checkpoints) runs on the GPU; a run stopped
    at step 3 and resumed continues the uninterrupted run (losses within 2e-3: GPU kernels are not bitwise
    deterministic run to run; a resume that lost the state would be back near the step-1 loss)."""
    import torch.distributed as dist

    backends = []
    common = ["--training.steps", "6", "--training.param_dtype", "bfloat16", "--validation.holdout_fraction", "0.1",
              "--validation.interval", "3", "--checkpoint.interval", "3", "--checkpoint.async_mode", "async",
              "--checkpoint.temp_interval_minutes", "0.0001", "--checkpoint.resume", "auto"]
    whole = _train(tmp_path / "whole", *common, inspect=lambda t: backends.append(dist.get_backend()))
    assert "nccl" in backends[0]
    _train(tmp_path / "split", *common, "--training.stop_at_step", "3")
    resumed = [r for r in _train(tmp_path / "split", *common) if r["step"] > 3]
    assert [r["step"] for r in resumed] == [4, 5, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in whole][3:], rel=2e-3)
    assert all(r["n_tokens"] == 4 * 256 for r in whole)


def test_one_rank_tp_mesh_with_loss_parallel_on_nccl(tmp_path):
    """The tensor-parallel plan and loss parallel on a 1-rank tp mesh over NCCL: DTensor's collectives run on the
    GPU and give the plain model's loss and gradients (fp32, 1e-5)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titan_sft.loss import chunked_cross_entropy_sum
    from titan_sft.models import build_model
    from titan_sft.parallel.tensor_parallel import apply_tp
    from titan_sft.registry import get_train_spec

    spec = get_train_spec("qwen3")
    args = spec.flavors["debug"]
    dev = torch.device("cuda")
    own = not dist.is_initialized()
    if own:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        x = torch.randint(0, args.vocab_size, (2, 64), device=dev)
        labels = torch.roll(x, -1, dims=1)
        results = []
        for tp in (False, True):
            torch.manual_seed(0)
            m = build_model(args, device=dev)
            m.init_weights()
            if tp:
                apply_tp(m, init_device_mesh("cuda", (1,), mesh_dim_names=("tp",)), spec.tp_plan_fn())
            h = m(x, hidden_only=True)
            loss = chunked_cross_entropy_sum(h, m.output.weight, labels, 32)
            loss.backward()
            g = m.layers["0"].attention.wq.weight.grad
            results.append((loss.detach().float().item(), (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()))
        (l0, g0), (l1, g1) = results
        assert abs(l0 - l1) <= 1e-5 * abs(l0)
        assert (g0 - g1).abs().max() <= 1e-5 * g0.abs().max()
    finally:
        if own:
            dist.destroy_process_group()


def test_diffusion_lora_steps_bf16_on_each_gpu_backend(tmp_path):
    """The masked-diffusion debug job (bidirectional attention, LoRA) in bf16 for 5 steps: varlen and flex give the
    sdpa losses (bf16 rounding: 3e-2 relative)."""
    losses = {}
    for backend in ("sdpa", "varlen", "flex"):
        recs = _train(tmp_path / backend, "--training.steps", "5", "--model.attention", backend,
                      "--training.param_dtype", "bfloat16", "--validation.generation_every", "0",
                      "--checkpoint.enable", "false", config="train_configs/debug_diffusion.toml")
        losses[backend] = [r["loss"] for r in recs]
    for backend in ("varlen", "flex"):
        assert losses[backend] == pytest.approx(losses["sdpa"], rel=3e-2), (backend, losses)


def _torchrun(nproc, *overrides):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", "train_configs/debug_model.toml", "--training.steps", "5",
           "--checkpoint.enable", "false", *FAST, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="FSDP 2 x TP 2 needs 4 GPUs")
def test_nccl_fsdp_x_tp(tmp_path):
    r = _torchrun(4, "--parallelism.tp", "2", "--training.param_dtype", "bfloat16", "--job.dump_folder", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="TP 2 needs 2 GPUs")
def test_float8_tensorwise_tp_all_gathers_in_float8(tmp_path):
    """torchao's float8 TP styles (float8_tp_plan) over NCCL: float8 all-gathers of the activations run."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 needs SM 8.9+")
    common = ["--parallelism.tp", "2", "--training.float8", "true", "--training.float8_recipe", "tensorwise",
              "--training.skip_startup_checks", "true", "--training.param_dtype", "bfloat16"]
    r = _torchrun(2, *common, "--job.dump_folder", str(tmp_path / "f8tp"))
    assert r.returncode == 0, r.stderr[-3000:]


def _delta_inputs_cuda(t: int, heads: int = 4, dk: int = 128, dv: int = 128, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(0)
    from titan_sft.models.gated_deltanet import l2_normalize

    q, k = (l2_normalize(torch.randn(1, t, heads, dk, device="cuda", generator=gen)).to(dtype) for _ in range(2))
    v = torch.randn(1, t, heads, dv, device="cuda", generator=gen, dtype=dtype)
    g = -torch.rand(1, t, heads, device="cuda", generator=gen) * 0.5
    beta = torch.rand(1, t, heads, device="cuda", generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="fla-core not installed")
def test_fla_delta_rule_matches_the_torch_reference_packed_and_in_segments():
    """flash-linear-attention's chunked kernel (what Gated DeltaNet runs on CUDA) against the torch reference on the
    same bf16 inputs: packed documents (cu_seqlens), and ring context parallel's per-segment pass (initial state
    [0 | I], final states per segment). Relative error of the outputs and states within 2e-2 (bf16 inputs)."""
    from titan_sft.models import gated_deltanet as gd

    q, k, v, g, beta = _delta_inputs_cuda(1024)
    cu = torch.tensor([0, 300, 301, 640, 1024], dtype=torch.int32, device="cuda")
    fast = gd.gated_delta_rule(q, k, v, g, beta, cu).float()
    ref = gd.packed_gated_delta_rule(*(x.float() for x in (q, k, v, g, beta)), cu_seqlens=cu).float()
    assert ((fast - ref).norm() / ref.norm()).item() < 2e-2
    doc = torch.searchsorted(cu.long(), torch.arange(1024, device="cuda"), right=True) - 1
    position = (torch.arange(1024, device="cuda") - cu.long()[:-1][doc]).view(4, 256)
    seg = [x.reshape(4, 256, *x.shape[2:]) for x in (q, k, v, g, beta)]
    got = gd.segment_gated_delta_rule(*seg, position)
    starts = position == 0
    starts[:, 0] = True
    v_ext = torch.cat([seg[2], seg[2].new_zeros(4, 256, 4, 128)], -1)
    initial = torch.zeros(4, 4, 128, 256, device="cuda")
    initial[..., 128:] = torch.eye(128, device="cuda")
    o, final = gd._torch_segments(*(x.float() for x in (seg[0], seg[1], v_ext, seg[3], seg[4])), starts,
                                  position[:, 0] > 0, initial)
    want = (o[..., :128], o[..., 128:], final[..., 128:], final[..., :128])
    for a, b in zip(got, want):
        assert ((a.float() - b).norm() / b.norm().clamp_min(1e-6)).item() < 2e-2
