"""Kernel and memory features whose logic runs on CPU: attention backend selection and varlen metadata, the
op-level selective activation checkpointing policy, and which layers float8 converts."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_sft.models import build_model
from titan_sft.models.attention import AttentionBackend, BackendUnavailable, check_backend
from titan_sft.registry import get_train_spec

DEBUG = get_train_spec("qwen3").flavors["debug"]


@pytest.mark.parametrize("name", ["varlen", "flash_varlen"])
def test_gpu_backends_fail_on_cpu_naming_the_cpu_ones(name):
    with pytest.raises(BackendUnavailable, match=f"'{name}' needs a CUDA device; on cpu use one of: sdpa, flex"):
        check_backend(name, "cpu")
    with pytest.raises(BackendUnavailable, match="allowed: sdpa, flex, varlen, flash_varlen"):
        check_backend("paged", "cpu")


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_metadata_and_flex_masks_against_sdpa(causal):
    """The varlen kernels get the flattened rows' cu_seqlens and longest document; flex's per-row block mask
    gives sdpa's output in both attention modes (the GPU kernels read the same metadata)."""
    cu = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32)  # 2 rows of 24: docs 10+14 | 6+18
    meta = AttentionBackend("varlen", causal=causal).prepare(2, 24, torch.device("cpu"), cu)
    assert meta.cu_seqlens.tolist() == [0, 10, 24, 30, 48] and meta.max_seqlen == 18 and meta.causal is causal
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    outs = {}
    for name in ("sdpa", "flex"):
        backend = AttentionBackend(name, causal=causal)
        outs[name] = backend(q, k, v, backend.prepare(2, 24, torch.device("cpu"), cu))
    assert torch.allclose(outs["sdpa"], outs["flex"], atol=1e-5)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _backward_ops(mode):
    from titan_sft.parallel.parallelize import apply_activation_checkpointing

    torch.manual_seed(0)
    model = build_model(DEBUG, device="cpu")
    model.init_weights()
    if mode != "none":
        apply_activation_checkpointing(model, mode, every_n=2)
    h = model(torch.randint(0, 500, (1, 32)), hidden_only=True)
    with CountOps() as ops:
        h.pow(2).mean().backward()
    return ops.counts


def test_selective_ac_recomputes_everything_but_matmuls_and_attention():
    none, full, selective = _backward_ops("none"), _backward_ops("full"), _backward_ops("selective")
    assert full["mm"] > none["mm"]  # full AC runs each block's forward matmuls again
    assert selective["mm"] == none["mm"]  # selective keeps them
    attention = [k for k in full if "scaled_dot_product" in k and "backward" not in k]
    assert attention and all(selective.get(k, 0) == none.get(k, 0) for k in attention)
    assert selective.get("rsqrt", 0) > none.get("rsqrt", 0)  # the norms are recomputed
    every_2 = _backward_ops("every_n")
    assert none["mm"] < every_2["mm"] < full["mm"]  # blocks 0 and 2 of 4


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise", "rowwise_with_gw_hp"])
def test_float8_converts_block_linears_with_dims_of_16_only(recipe):
    from titan_sft.converters import apply_float8

    args = dataclasses.replace(DEBUG, n_layers=2, ffn_dim=200, tie_embeddings=False)  # 200: not a multiple of 16
    with torch.device("meta"):
        model = build_model(args)
    converted = apply_float8(model, recipe, emulate=True)
    assert converted == [f"layers.{i}.attention.{w}" for i in range(2) for w in ("wq", "wk", "wv", "wo")]
    assert type(model.output).__name__ == "Linear" and type(model.layers["0"].feed_forward.w1).__name__ == "Linear"


def test_float8_tp_plan_uses_float8_styles_for_converted_linears_and_runs(tmp_path):
    """Tensor-wise float8 + TP: torchao's float8 styles replace the plain ones exactly where the block's linears
    are float8 (an input preparation only when every projection it feeds is), and the plan runs: on a 1-rank tp
    mesh (gloo; a real gather of float8 needs NCCL, see test_gpu.py) it gives the non-TP float8 forward and
    gradients."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from titan_sft.converters import apply_float8
    from titan_sft.parallel.tensor_parallel import apply_tp, float8_tp_plan

    spec = get_train_spec("qwen3")
    args = dataclasses.replace(DEBUG, n_layers=2, ffn_dim=200)  # 200: the MLP stays high precision

    def build():
        torch.manual_seed(0)
        m = build_model(args, device="cpu")
        m.init_weights()
        apply_float8(m, "tensorwise", emulate=True)
        return m

    model = build()
    _, block = float8_tp_plan(spec.tp_plan_fn(), model.layers["0"])
    kinds = {fqn: type(style).__name__ for fqn, style in block.items()}
    assert kinds["attention"] == "PrepareFloat8ModuleInput"
    assert [kinds[f"attention.{w}"] for w in ("wq", "wk", "wv", "wo")] == ["Float8ColwiseParallel"] * 3 + [
        "Float8RowwiseParallel"]
    assert [kinds[f] for f in ("feed_forward", "feed_forward.w1", "feed_forward.w2")] == [
        "PrepareModuleInput", "ColwiseParallel", "RowwiseParallel"]
    assert kinds["attention_norm"] == "SequenceParallel"

    x = torch.randint(0, args.vocab_size, (2, 32))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        results = []
        for tp in (False, True):
            m = build()
            if tp:
                apply_tp(m, init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)),
                         float8_tp_plan(spec.tp_plan_fn(), m.layers["0"]))
            h = m(x, hidden_only=True)
            h = h.full_tensor() if hasattr(h, "full_tensor") else h
            h.float().pow(2).sum().backward()
            grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                     for p in m.layers["0"].attention.parameters()]
            results.append((h.detach(), grads))
        (h0, g0), (h1, g1) = results
        assert (h0 - h1).abs().max() <= 1e-5 * h0.abs().max()
        for a, b in zip(g0, g1):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max()
    finally:
        dist.destroy_process_group()


def test_validation_matmuls_stay_high_precision_under_float8():
    """Inside ``high_precision_matmuls`` (where the trainer runs validation and generation) a float8 model gives
    the unconverted model's output bit for bit; outside it is float8 again. (With per-block compile, dynamo
    recompiles for the swapped forward: checked by hand, 1.7e-6 from eager.)"""
    from titan_sft.converters import _FLOAT8_ON, apply_float8, high_precision_matmuls

    def build(f8):
        torch.manual_seed(0)
        m = build_model(DEBUG, device="cpu")
        m.init_weights()
        if f8:
            apply_float8(m, "rowwise", emulate=True)
        return m

    plain, f8 = build(False), build(True)
    x = torch.randint(0, DEBUG.vocab_size, (2, 32))
    with torch.no_grad():
        want, quantised = plain(x, hidden_only=True), f8(x, hidden_only=True)
        with high_precision_matmuls(f8):
            assert not _FLOAT8_ON.get()  # what the Transformer Engine blocks' fp8_autocast reads
            assert torch.equal(f8(x, hidden_only=True), want)
        assert _FLOAT8_ON.get() and torch.equal(f8(x, hidden_only=True), quantised)
    assert (quantised - want).abs().max() > 1e-3


def test_transformer_engine_gate_outcomes(monkeypatch, caplog):
    """Capability and library presence mocked: bf16 with one notice, a stop with the install command, or TE."""
    import importlib.util
    import logging

    from titan_sft import converters
    from titan_sft.config import ConfigError, load_config

    cfg = load_config(None, ["--training.float8", "true", "--training.float8_backend", "te"])
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "FakeGPU")
    has_te = {"value": False}
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda n, *a: object() if n == "transformer_engine" and has_te["value"] else
                        (None if n == "transformer_engine" else real_find_spec(n, *a)))
    applied = []
    monkeypatch.setattr(converters, "apply_te_float8", lambda model, kwargs: applied.append(model))

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))  # A100: not capable
    with caplog.at_level(logging.WARNING, logger="titan_sft"):
        converters.float8_converter("model", cfg, gpu)
    assert "needs compute capability 8.9 or 9.0+; FakeGPU (compute capability (8, 0))" in caplog.text
    assert "training in bf16 instead" in caplog.text and not applied
    assert converters.te_gate(torch.device("cpu")) == "incapable"

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))  # H100 without TE
    with pytest.raises(ConfigError, match=r"needs Transformer Engine on this FakeGPU: pip install 'transformer-engine\[pytorch\]'"):
        converters.float8_converter("model", cfg, gpu)

    has_te["value"] = True  # H100 with TE
    converters.float8_converter("model", cfg, gpu)
    assert applied == ["model"]


@pytest.mark.slow
def test_compiled_loss_equals_eager(tmp_path):
    """``training.compile_loss``: the compiled per-chunk math gives the eager loss and gradients (fp32 within 1e-6,
    bf16 within bf16 rounding), on ragged chunks with ignored tokens and per-token weights, and in the
    loss-parallel kernel on a vocabulary slice that holds only some targets (a 1-rank group: the reductions are
    identities, so eager and compiled see the same inputs)."""
    import torch.distributed as dist

    from titan_sft.loss import _VocabParallelCrossEntropy, chunked_cross_entropy_sum

    g = torch.Generator().manual_seed(0)
    hidden0 = torch.randn(2, 23, 16, generator=g)
    weight0 = torch.randn(300, 16, generator=g) * 0.3
    labels = torch.randint(0, 300, (2, 23), generator=g)
    labels[0, :5] = -100
    weights = torch.rand(2, 23, generator=g)

    def run(fn, dtype, compiled):
        h = hidden0.to(dtype, copy=True).requires_grad_()
        w = weight0.to(dtype, copy=True).requires_grad_()
        loss = fn(h, w, compiled)
        loss.backward()
        return loss.detach(), h.grad.float(), w.grad.float()

    def plain(h, w, compiled):
        return chunked_cross_entropy_sum(h, w, labels, 16, weights, compiled=compiled)  # chunks of 16, 16, 14

    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        eager, comp = run(plain, dtype, False), run(plain, dtype, True)
        for a, b in zip(eager, comp):
            assert (a - b).abs().max() <= tol * a.abs().max(), dtype

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        def sliced(h, w, compiled):  # this "rank" holds vocabulary rows 100..299 (offset 100)
            return _VocabParallelCrossEntropy.apply(h, w[100:], labels, weights, 16, 100, dist.group.WORLD, compiled)

        eager, comp = run(sliced, torch.float32, False), run(sliced, torch.float32, True)
        for a, b in zip(eager, comp):
            assert (a - b).abs().max() <= 1e-6 * a.abs().max()
        assert eager[2][:100].abs().max() == 0  # rows outside the slice get no gradient
    finally:
        dist.destroy_process_group()


def test_selective_ac_keeps_every_attention_backends_op():
    """Per backend, the ops its attention dispatches are in the policy's save set: sdpa's (exercised above),
    torch's varlen custom op (registered only once torch.nn.attention.varlen is imported), flash-attn's."""
    from titan_sft.parallel.parallelize import ATTENTION_SAVE_OPS, _save_ops

    save = _save_ops()
    assert torch.ops.torch_attn._varlen_attn.default in save
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in save
    assert torch._higher_order_ops.flex_attention in save
    assert set(ATTENTION_SAVE_OPS) == {"sdpa", "varlen", "flash_varlen"}


def test_selective_ac_does_not_recompute_flash_attn_kernels():
    """flash-attn's varlen forward, as it registers it (flash_attn::_flash_attn_varlen_forward), under the policy:
    run once in forward, never again in backward. A CPU stand-in with flash-attn's op name (and a call counter)."""
    import importlib.util

    from torch.utils.checkpoint import checkpoint

    from titan_sft.parallel.parallelize import _save_ops, selective_checkpoint_context

    if importlib.util.find_spec("flash_attn") is not None:
        assert torch.ops.flash_attn._flash_attn_varlen_forward.default in _save_ops()
        return
    calls = []

    @torch.library.custom_op("flash_attn::_flash_attn_varlen_forward", mutates_args=())
    def fake_forward(q: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return q.softmax(-1)

    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(-1, keepdim=True))

    fake_forward.register_autograd(backward, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))
    x = torch.randn(4, 8, requires_grad=True)
    y = checkpoint(lambda t: torch.ops.flash_attn._flash_attn_varlen_forward(t * 2).sin(), x, use_reentrant=False,
                   context_fn=selective_checkpoint_context)
    y.sum().backward()
    assert len(calls) == 1  # saved by the policy: not recomputed
    assert torch.ops.flash_attn._flash_attn_varlen_forward.default in _save_ops()


@pytest.mark.parametrize("params,expected", [
    ({"is_causal"}, ({"is_causal": True}, True)),  # torch 2.10
    ({"window_size"}, ({"window_size": (-1, 0)}, True)),  # torch 2.11: no enable_gqa
    ({"window_size", "enable_gqa"}, ({"window_size": (-1, 0), "enable_gqa": True}, False)),  # torch 2.13
])
def test_varlen_arguments_follow_the_installed_signature(params, expected):
    from titan_sft.models.attention import varlen_kwargs

    assert varlen_kwargs(True, params) == expected
    kwargs, _ = varlen_kwargs(False, params)
    assert kwargs.get("window_size", (-1, -1)) == (-1, -1) and kwargs.get("is_causal", False) is False


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_without_enable_gqa_expands_kv_heads(monkeypatch, causal):
    """On a torch whose varlen_attn has no enable_gqa (2.11), GQA key/value heads are repeated before the call. A
    CPU stand-in with 2.11's signature computes per document with sdpa and refuses unequal head counts."""
    import torch.nn.attention.varlen as varlen
    import torch.nn.functional as F

    def varlen_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        assert q.shape[1] == k.shape[1] == v.shape[1], "no enable_gqa: heads must match"
        out = torch.empty_like(q)
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            sl = slice(a, b)
            out[sl] = F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                                                     v[sl].transpose(0, 1), is_causal=window_size == (-1, 0)
                                                     ).transpose(0, 1)
        return out

    monkeypatch.setattr(varlen, "varlen_attn", varlen_2_11)
    cu = torch.tensor([0, 10, 24, 30, 48], dtype=torch.int32)
    q, k, v = torch.randn(2, 4, 24, 16), torch.randn(2, 2, 24, 16), torch.randn(2, 2, 24, 16)
    outs = {}
    for name in ("sdpa", "varlen"):
        backend = AttentionBackend(name, causal=causal)
        outs[name] = backend(q, k, v, backend.prepare(2, 24, torch.device("cpu"), cu))
    assert torch.allclose(outs["varlen"], outs["sdpa"], atol=1e-5)


@pytest.mark.parametrize("name", ["varlen", "flash_varlen"])
def test_flash_backends_refuse_fp32_compute_with_one_line(name, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    with pytest.raises(BackendUnavailable, match=f"'{name}'.*bf16/fp16 only.*float32.*training.param_dtype"):
        check_backend(name, "cuda", torch.float32)
    check_backend(name, "cuda", torch.bfloat16)


def test_auto_backend_resolves_to_one_that_is_present(monkeypatch):
    import importlib.util

    from titan_sft.models.attention import resolve_backend

    assert resolve_backend("auto", "cpu")[0] == "sdpa"
    assert resolve_backend("flex", "cuda") == ("flex", None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flash_attn" else real(n, *a))
    name, notice = resolve_backend("auto", "cuda")
    assert name == "varlen" and "flash-attn not installed" in notice
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flash_attn" else real(n, *a))
    assert resolve_backend("auto", "cuda")[0] == "flash_varlen"


def test_recipe_configs_use_auto_attention():
    from pathlib import Path

    from titan_sft.config import load_config

    root = Path(__file__).resolve().parent.parent / "train_configs"
    for path in sorted(root.glob("*.toml")):
        if not path.name.startswith("debug"):
            assert load_config(str(path), []).model.attention == "auto", path.name


def test_transformer_engine_with_tensor_parallel_is_refused_at_config_time():
    from titan_sft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="training.float8_backend.*'torchao' with parallelism.tp > 1"):
        load_config("train_configs/debug_model.toml", ["--training.float8", "true", "--training.float8_backend", "te",
                                                       "--parallelism.tp", "2"])


def test_isolation_check_does_not_make_compiled_blocks_recompile():
    """The start-up check runs a [1, 256] row; the compiled blocks must compile once, for the training shape."""
    from titan_sft.startup_checks import check_document_isolation

    torch._dynamo.reset()
    compiles = []

    def counting_backend(gm, example_inputs):
        compiles.append([tuple(t.shape) for t in example_inputs if isinstance(t, torch.Tensor)])
        return gm.forward

    model = build_model(DEBUG, device="cpu")
    model.init_weights()
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, backend=counting_backend, fullgraph=True))
    check_document_isolation(model, DEBUG.vocab_size, 512, torch.device("cpu"), "sdpa")
    cu = torch.tensor([0, 100, 512, 700, 1024], dtype=torch.int32)
    for _ in range(2):
        model(torch.randint(0, 500, (2, 512)), cu_seqlens=cu, hidden_only=True)
    assert len(compiles) == 1, compiles  # one graph (shared by the blocks), at the training shape only
    torch._dynamo.reset()


def test_transformer_engine_recipe_knobs_reach_delayed_scaling(monkeypatch):
    """[training] te_* become TE's DelayedScaling arguments (a stand-in TE records them; the reference trainer's
    defaults when unset), the block projections become TE linears, and every block runs under fp8_autocast."""
    import contextlib
    import enum
    import sys
    import types

    from titan_sft import converters
    from titan_sft.config import load_config

    recipes, autocasts = [], []

    class Format(enum.Enum):
        HYBRID = "hybrid"
        E4M3 = "e4m3"

    def DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max",
                       override_linear_precision=(False, False, False)):  # TE 2: no interval
        recipes.append(dict(margin=margin, fp8_format=fp8_format, amax_history_len=amax_history_len,
                            amax_compute_algo=amax_compute_algo, override_linear_precision=override_linear_precision))
        return recipes[-1]

    class Linear(torch.nn.Linear):
        def __init__(self, i, o, bias=False, params_dtype=None, device=None):
            super().__init__(i, o, bias=bias, device=device, dtype=params_dtype)

    @contextlib.contextmanager
    def fp8_autocast(enabled=True, fp8_recipe=None):
        autocasts.append((enabled, fp8_recipe))
        yield

    te = types.ModuleType("transformer_engine")
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear, te_pt.fp8_autocast = Linear, fp8_autocast
    common = types.ModuleType("transformer_engine.common")
    recipe_mod = types.ModuleType("transformer_engine.common.recipe")
    recipe_mod.DelayedScaling, recipe_mod.Format = DelayedScaling, Format
    for name, mod in (("transformer_engine", te), ("transformer_engine.pytorch", te_pt),
                      ("transformer_engine.common", common), ("transformer_engine.common.recipe", recipe_mod)):
        monkeypatch.setitem(sys.modules, name, mod)

    defaults = converters.te_recipe_kwargs(load_config(None, []).training)
    assert defaults == {"fp8_format": "HYBRID", "margin": 0, "interval": 1, "amax_history_len": 1024,
                        "amax_compute_algo": "max", "override_linear_precision": (False, False, False)}
    t = load_config(None, ["--training.te_format", "E4M3", "--training.te_margin", "2", "--training.te_amax_history_len",
                           "16", "--training.te_amax_compute_algo", "most_recent",
                           "--training.te_override_linear_precision", "false,false,true"]).training
    model = build_model(DEBUG, device="cpu")
    converted = converters.apply_te_float8(model, converters.te_recipe_kwargs(t))
    assert recipes == [dict(margin=2, fp8_format=Format.E4M3, amax_history_len=16, amax_compute_algo="most_recent",
                            override_linear_precision=(False, False, True))]
    assert len(converted) == 4 * 7 and isinstance(model.layers["0"].attention.wq, Linear)
    model(torch.randint(0, 500, (1, 16)))
    assert len(autocasts) == 4 and all(e and r is recipes[0] for e, r in autocasts)


def test_flex_block_masks_are_built_compiled_on_gpu():
    """On a GPU the flex mask is built by a compiled ``create_block_mask`` (one compile, shared by every forward
    and by context parallel's masks): eager, it materialises a mask element per (query, key) pair of each row,
    ~1G at 32k. The CPU reference path builds it eagerly."""
    from torch.nn.attention.flex_attention import create_block_mask

    from titan_sft.models.attention import block_mask_fn

    assert block_mask_fn(torch.device("cpu")) is create_block_mask
    compiled = block_mask_fn(torch.device("cuda"))  # compiles on its first call, so nothing runs here
    assert compiled is not create_block_mask and block_mask_fn(torch.device("cuda")) is compiled
    assert getattr(compiled, "__wrapped__", None) is create_block_mask
