"""QLoRA (issue 37, item 2): ``lora.base_quant = "nf4"`` keeps the frozen block weights in torchao's NF4 format.

Asserted here: the dequantization equals torchao's bitwise and the round trip stays within NF4's bound; the codes
loaded from an HF directory are the whole tensor's quantization on every layout; only adapters and norms change in
training; the debug job on 2 FSDP ranks (with activation checkpointing and compile) equals 1 rank; a run learns the
embedded task on an NF4 base and exports onto the original weights; the dry run counts NF4 bytes."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from test_train_e2e import ROOT, run
from titan_sft import nf4
from titan_sft.config import load_config
from titan_sft.dry_run import dry_run

DEBUG_BASE = ROOT / "titan_sft/assets/debug_base"
QLORA = ["--model.converters", "lora", "--lora.rank", "4", "--lora.base_quant", "nf4"]


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nf4_round_trip_is_torchaos_and_within_the_bound(dtype):
    """Per element, |w - w'| <= 0.1519 s + |s - s'| (0.1519: half NF4's widest gap between levels, -1 to -0.6962;
    s: the block's absmax, s': its double-quantized value), and |s - s'| is at most one int8 step of its group."""
    from torchao.quantization import to_nf4

    weights = [torch.randn(96, 64, generator=torch.Generator().manual_seed(0)).to(dtype),
               torch.randn(3, 40, 64, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.02]
    weights += [w.to(dtype) for k, w in load_file(str(DEBUG_BASE / "model.safetensors")).items() if "proj" in k][:4]
    for w in weights:
        q = nf4.quantize(w)
        back = nf4.dequantize(*(q[s] for s in nf4.PIECES), tuple(w.shape), dtype)
        ref = to_nf4(w.reshape(-1, w.shape[-1]), 64, nf4.scaler_block(w.numel())).get_original_weight()
        assert torch.equal(back, ref.reshape(w.shape))
        blocks = w.float().reshape(-1, 64)
        s = blocks.abs().amax(1)
        s_q = (q["_scalers"].float().view(q["_factors"].numel(), -1) / q["_factors"].float().unsqueeze(-1)).flatten() \
            + q["_mean"].float()
        centred = (s - s.mean()).view(q["_factors"].numel(), -1)
        step = 2 * centred.abs().amax(1, keepdim=True) / 256  # one int8 step of each scaler group
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-6  # the scalers' own arithmetic in the weight's dtype
        assert ((s - s_q).abs().view_as(centred) <= step * (1 + tol) + tol * s.max()).all()
        err = (back.float().reshape(-1, 64) - blocks).abs()
        assert (err <= 0.1519 * s.unsqueeze(1) + (s - s_q).abs().unsqueeze(1) + tol * s.max()).all()
        assert err.max() > 0  # 4 bits: not lossless


def _qlora_model(cfg_overrides=()):
    from titan_sft.hf_io import load_hf_weights, model_args
    from titan_sft.parallel import ParallelDims, parallelize_transformer
    from titan_sft.registry import get_train_spec

    cfg = load_config(None, ["--model.hf_assets_path", str(DEBUG_BASE), "--model.init_from_hf", "true",
                             "--training.param_dtype", "float32", *QLORA, *cfg_overrides])
    spec = get_train_spec("qwen3")
    args = model_args(cfg.model, spec)
    with torch.device("meta"):
        model = spec.model_cls(args)
    mesh, *_ = ParallelDims.from_config(cfg, 1).build_mesh("cpu")
    parallelize_transformer(model, mesh, cfg, torch.device("cpu"), spec.tp_plan_fn())
    model.to_empty(device="cpu")
    load_hf_weights(model, args, DEBUG_BASE, spec)
    for m in model.modules():
        if hasattr(m, "reset_converter_parameters"):
            m.reset_converter_parameters(0)
    return model, cfg, spec, args


def _full(p):
    return p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()


def test_codes_come_from_the_hf_weights_and_only_adapters_and_norms_train(one_rank_group):
    from titan_sft.hf_io import read_hf_weights
    from titan_sft.lora import NF4Linear, NF4LoRALinear
    from titan_sft.optimizer import build_optimizer

    model, cfg, spec, args = _qlora_model(["--lora.targets", "q_proj,v_proj,down_proj"])
    quantized = nf4.quantized_weights(model)
    # every block linear: 7 per layer, adapted or not; embedding and head are not
    assert len(quantized) == 7 * args.n_layers and "tok_embeddings.weight" not in quantized
    assert isinstance(model.layers["0"].attention.wq, NF4LoRALinear)
    assert isinstance(model.layers["0"].attention.wk, NF4Linear)
    originals = read_hf_weights({k: nf4.full_shape(*v) for k, v in quantized.items()}, args, DEBUG_BASE, spec)
    for key, (module, name) in quantized.items():
        expected = nf4.quantize(originals[key])
        for suffix in nf4.PIECES:
            assert torch.equal(_full(getattr(module, f"{name}_nf4{suffix}")), expected[suffix]), key
    before = {n: _full(p).clone() for n, p in model.named_parameters()}
    opt = build_optimizer(model, dataclasses.replace(cfg.optimizer, lr=1e-2))  # on the sharded parameters
    # B = 0: the model is the dequantized base
    dense = spec.model_cls(args)
    dense.load_state_dict({**{k: v.full_tensor() for k, v in model.state_dict().items()
                              if not nf4.is_nf4_key(k) and "lora_" not in k},
                           **{k: nf4.weight(m, n, torch.float32) for k, (m, n) in quantized.items()}})
    x = torch.randint(0, 280, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(model(x), dense(x), atol=1e-5, rtol=1e-5)
    for _ in range(2):
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in before if n.endswith(("lora_a", "lora_b")) or "norm" in n}
    for n, p in model.named_parameters():
        assert (not torch.equal(_full(p), before[n])) == (n in trainable), n


@pytest.mark.slow
def test_qlora_two_ranks_with_compile_and_checkpointing_equal_one_rank(tmp_path):
    """The seeded-init base quantized whole on every rank: 2 FSDP ranks (compiled blocks, full activation
    checkpointing) and 2 pipeline stages give 1 rank's losses and grad norms within 1e-5; checkpoints hold
    adapters and norms only."""
    one = run(1, tmp_path / "one", *QLORA, "--training.steps", "3")
    two = run(2, tmp_path / "two", *QLORA, "--training.steps", "3", "--training.compile", "true",
              "--training.activation_checkpoint", "full")
    pp = run(2, tmp_path / "pp", *QLORA, "--training.steps", "3", "--parallelism.pp", "2")
    assert len(one) == len(two) == len(pp) == 3
    for other in (two, pp):
        for a, b in zip(one, other):
            for key in ("loss", "grad_norm"):
                assert abs(a[key] - b[key]) <= 1e-5 * abs(a[key]), (key, a[key], b[key])
    audit = json.loads((tmp_path / "one" / "parameter_audit.json").read_text())
    assert not any(n.endswith(".weight") and ".layers." in f".{n}" and "norm" not in n
                   for n in audit.get("trainable_names", []))
    from torch.distributed.checkpoint import FileSystemReader

    keys = FileSystemReader(str(tmp_path / "one" / "checkpoints" / "step-2")).read_metadata().state_dict_metadata
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(k.endswith(("lora_a", "lora_b")) or "norm" in k for k in model_keys)
    meta = json.loads((tmp_path / "one" / "checkpoints" / "step-2" / "meta.json").read_text())
    assert "layers.0.attention.wq.weight_nf4" in meta["base_identity"]["fingerprint"]


@pytest.mark.slow
def test_qlora_on_routed_experts_two_ranks_equal_one(tmp_path):
    """The MoE debug job with expert adapters on an NF4 base (the experts' stacked weights quantized too): 2 FSDP
    ranks give 1 rank's losses (1e-5), and the base's fingerprint covers the experts' codes."""
    moe = ["--config", "train_configs/debug_moe.toml", *QLORA, "--lora.rank", "8", "--lora.experts", "true",
           "--training.steps", "3"]
    one, two = run(1, tmp_path / "one", *moe), run(2, tmp_path / "two", *moe)
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    meta = json.loads((tmp_path / "one" / "checkpoints" / "step-2" / "meta.json").read_text())
    assert "layers.1.feed_forward.experts.w1_nf4" in meta["base_identity"]["fingerprint"]


@pytest.mark.slow
def test_qlora_diffusion_debug_job_learns_and_exports_onto_the_original_weights(tmp_path):
    """The shipped LoRA debug job with an NF4 base learns the task (exact match on the held-out prompts); its
    merged export is the original HF weights plus the adapters (not the dequantized base), and `convert to-hf` of
    its adapter-only checkpoint (the NF4 base rebuilt from the HF directory and checked) writes the same export."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(["./run_train.sh", "train_configs/debug_diffusion.toml", "--job.dump_folder",
                        str(tmp_path / "job"), "--lora.base_quant", "nf4", "--validation.test_path", ""],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    gen = [x for x in records if x["split"] == "generation"]
    print(f"QLoRA (NF4 base) debug diffusion job: exact match {gen[0]['exact_match']:.2f}")
    assert len(gen) == 1 and gen[0]["exact_match"] >= 0.8, gen
    base = load_file(str(DEBUG_BASE / "model.safetensors"))
    merged = load_file(str(tmp_path / "job" / "hf" / "step-149" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "job" / "adapters" / "step-149" / "adapter_model.safetensors"))
    conf = json.loads((tmp_path / "job" / "adapters" / "step-149" / "adapter_config.json").read_text())
    assert conf["titan_sft_base_quant"] == "nf4"
    key = "model.layers.1.self_attn.q_proj"
    a, b = (adapter[f"base_model.model.{key}.lora_{x}.weight"].float() for x in "AB")
    expected = base[f"{key}.weight"].float() + conf["lora_alpha"] / conf["r"] * b @ a
    assert torch.allclose(merged[f"{key}.weight"].float(), expected, atol=1e-6)
    assert torch.equal(merged["model.embed_tokens.weight"].float(), base["model.embed_tokens.weight"].float())
    # the adapter-only checkpoint converts to the same export: the NF4 base rebuilt and checked, then restored
    subprocess.run([sys.executable, "-m", "titan_sft.convert", "to-hf", "--checkpoint",
                    str(tmp_path / "job" / "checkpoints" / "step-149"), "--out", str(tmp_path / "conv"),
                    "--dtype", "float32"], cwd=ROOT, env=env, check=True, capture_output=True)
    converted = load_file(str(tmp_path / "conv" / "model.safetensors"))
    assert converted.keys() == merged.keys() and all(torch.equal(converted[k], merged[k]) for k in merged)


@pytest.mark.parametrize("name,nf4_gib,total_gib", [("qwen3_32b_qlora", 14.99, 30.38),
                                                    ("qwen3_30b_a3b_qlora", 14.36, 28.57)])
def test_qlora_configs_plan_one_80gb_gpu(name, nf4_gib, total_gib, monkeypatch):
    """The shipped QLoRA plans fit one 80 GB GPU by the dry run's estimate (computed from shapes): the NF4 base
    at 0.516 bytes per parameter, adapters' state, one microbatch's activations and the dequantized weights."""
    from titan_sft.dry_run import GIB, peak_memory_estimate

    monkeypatch.setenv("WORLD_SIZE", "1")
    cfg = load_config(ROOT / "train_configs" / f"{name}.toml", ["--model.init_from_hf", "false",
                                                                 "--model.hf_assets_path", ""])
    assert cfg.lora.base_quant == "nf4" and cfg.checkpoint.interval == 10 and cfg.checkpoint.keep_latest_k == 5
    text = dry_run(cfg)
    print(text)
    assert f"in {nf4_gib:.2f} GiB (0.516 bytes each" in text
    assert f"per rank in all (estimate, a floor: allocator fragmentation and kernel workspaces come on top): " \
           f"{total_gib:.2f} GiB" in text
    peak = peak_memory_estimate(cfg, cfg.data.seq_len)
    assert abs(peak["total"] / GIB - total_gib) < 0.01 and peak["total"] < 80e9
    # unquantized, the same plan would not fit: bf16 base weights alone are 58 / 56 GiB
    plain = load_config(ROOT / "train_configs" / f"{name}.toml", ["--model.init_from_hf", "false",
                                                                   "--model.hf_assets_path", "",
                                                                   "--lora.base_quant", "none"])
    assert peak_memory_estimate(plain, cfg.data.seq_len)["total"] > peak["total"] + 40 * GIB


@pytest.mark.slow
def test_qlora_from_a_weights_only_start_equals_the_hf_start(tmp_path):
    """`convert from-hf` then `--checkpoint.resume <it>` on 2 ranks: the NF4 codes are quantized from the DCP's
    whole tensors, so the losses equal a 1-rank start from the HF directory (1e-5)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([sys.executable, "-m", "titan_sft.convert", "from-hf", "--hf", str(DEBUG_BASE), "--out",
                    str(tmp_path / "start")], cwd=ROOT, env=env, check=True, capture_output=True)
    common = ["train_configs/debug_diffusion.toml", "--training.steps", "3", "--training.per_device_batch", "8",
              "--validation.interval", "0",
              "--validation.path", "", "--validation.keep_best", "false", "--validation.test_path", "",
              "--validation.generation_every", "0",
              "--checkpoint.hf_export_interval", "-1", "--metrics.enable_tensorboard", "false",
              "--metrics.log_freq", "1", "--lora.base_quant", "nf4"]
    losses = []
    for nproc, extra in ((1, []), (2, ["--checkpoint.resume", str(tmp_path / "start")])):
        dump = tmp_path / f"run{nproc}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "titan_sft.train", "--config", *common, "--job.dump_folder", str(dump), *extra]
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        losses.append([json.loads(x)["loss"] for x in (dump / "metrics.jsonl").read_text().splitlines()
                       if json.loads(x)["split"] == "train"])
    assert len(losses[0]) == 3
    for a, b in zip(*losses):
        assert abs(a - b) <= 1e-5 * abs(a), losses


def test_base_quant_refused_with_one_line_where_unsupported():
    from titan_sft.config import ConfigError

    base = ["--model.converters", "lora", "--lora.base_quant", "nf4"]
    load_config("train_configs/debug_model.toml", base)  # FSDP: fine
    for extra, why in ((["--parallelism.tp", "2"], "parallelism.tp > 1"),
                       (["--training.float8", "true"], "training.float8"),
                       (["--lora.use_dora", "true"], "lora.use_dora")):
        with pytest.raises(ConfigError, match=rf"lora.base_quant.*with {why}"):
            load_config("train_configs/debug_model.toml", base + extra)
    with pytest.raises(ConfigError, match=r"lora.base_quant.*unless model.converters holds"):
        load_config("train_configs/debug_model.toml", ["--lora.base_quant", "nf4"])


@pytest.mark.torch_range
@pytest.mark.slow
def test_qlora_on_the_oldest_supported_torch(tmp_path):
    """torch 2.11's FSDP2 cannot shard integer parameters: the NF4 codes stay whole on every rank there
    (``compat.FSDP_INTEGER_PARAMS``) and 2 FSDP ranks still give 1 rank's losses (1e-5)."""
    one = run(1, tmp_path / "one", *QLORA, "--training.steps", "3")
    two = run(2, tmp_path / "two", *QLORA, "--training.steps", "3")
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
