"""Qwen3-MoE (issue 20, first part): the native model equals transformers' Qwen3MoeForCausalLM (logits and the
load-balancing loss), HF round trips are bitwise, grouped GEMM equals the per-expert loop, the objective adds the
auxiliary loss as HF does, and FSDP 2 gives the 1-rank numbers, also when training starts from an HF directory
(each rank reads its own experts). CPU, fp32."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_parallel import assert_same_adapter_updates

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = {  # name: Qwen3MoeConfig overrides
    "dense_layer_between": dict(mlp_only_layers=[1]),
    "sparse_step_2_untied": dict(decoder_sparse_step=2, tie_word_embeddings=False),
    "no_topk_renorm": dict(norm_topk_prob=False, num_experts_per_tok=3),
}


def _hf_moe(path, vocab=320, seed=0, **overrides):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              norm_topk_prob=True, max_position_embeddings=512, tie_word_embeddings=True,
              router_aux_loss_coef=0.01, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    kw.update(overrides)
    model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**kw), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif "gate.weight" in n:  # a router that prefers some experts, so routing is really tested
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    return model


def _safetensors(d):
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_aux_loss_equal_transformers_and_export_round_trips(tmp_path, name):
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from titan_sft.hf_io import export_hf
    from titan_sft.models import load_hf
    from titan_sft.models.moe import load_balancing_loss, router_z_loss
    from titan_sft.registry import get_train_spec

    hf = _hf_moe(tmp_path / "hf", **CONFIGS[name])
    model = load_hf(tmp_path / "hf")
    ids = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        ref = hf(ids, output_router_logits=True)
        ours = model(ids)
    assert (ours - ref.logits).abs().max() < 1e-5
    cfg = hf.config
    aux = load_balancing_loss(model.router_stats, cfg.num_experts)
    assert aux.item() == pytest.approx(load_balancing_loss_func(ref.router_logits, cfg.num_experts,
                                                                cfg.num_experts_per_tok).item(), rel=1e-6)
    assert len(model.router_stats) == len(model.args.moe_layers()) == len(ref.router_logits)
    z = sum(torch.logsumexp(l.float(), -1).square().mean() for l in ref.router_logits)  # ST-MoE, from HF's logits
    assert router_z_loss(model.router_stats).item() == pytest.approx(z.item(), rel=1e-6)

    export_hf(model, model.args, tmp_path / "out", dtype="float32", spec=get_train_spec("qwen3_moe"),
              generation_config=False)
    a, b = _safetensors(tmp_path / "hf"), _safetensors(tmp_path / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # per-expert names, bitwise
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert (again(ids).logits - ref.logits).abs().max() < 1e-5
    cfg_out = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg_out["num_experts"] == 8 and cfg_out["mlp_only_layers"] == cfg.mlp_only_layers


def test_grouped_gemm_equals_the_per_expert_loop_forward_and_backward():
    from titan_sft.models.moe import MoE

    torch.manual_seed(0)
    moe = MoE(32, 48, 6, 2, True, impl="grouped")
    moe.init_weights(0.5, 0.3)
    x = torch.randn(3, 20, 32, requires_grad=True)
    g = torch.randn(3, 20, 32)
    results = []
    for impl in ("grouped", "loop"):
        moe.impl = impl
        moe.zero_grad()
        x.grad = None
        out, counts, prob_sum, _ = moe(x)
        (out * g).sum().backward()
        results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in moe.parameters()], counts))
    (o1, gx1, gp1, c1), (o2, gx2, gp2, c2) = results
    assert torch.allclose(o1, o2, atol=1e-6) and torch.allclose(gx1, gx2, atol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(gp1, gp2))
    assert torch.equal(c1, c2) and c1.sum() == 3 * 20 * 2  # dropless: every token reaches its 2 experts


def test_groups_padded_for_float8_grouped_gemm_change_no_number():
    """torchao's float8 grouped GEMM needs each expert's row group aligned to 16 rows: the experts pad their
    groups with zero rows (static padded size, the last group taking the slack) and gather their rows back. On
    the CPU's grouped GEMM the padded run equals the unpadded one, forward and backward (an expert with no rows,
    groups of 1 and of more than 16 rows included), and every group boundary is a multiple of 16."""
    from titan_sft.models.moe import GroupedExperts, pad_groups

    torch.manual_seed(0)
    experts = GroupedExperts(32, 48, 5)
    experts.init_weights(0.5, 0.3)
    counts = torch.tensor([7, 0, 1, 23, 9])
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    g = torch.randn(x.shape[0], 32)
    padded, padded_counts, rows = pad_groups(x.detach(), counts, 16)
    assert padded.shape[0] % 16 == 0 and padded.shape[0] >= x.shape[0] + 5 * 15
    assert padded_counts.sum() == padded.shape[0] and (torch.cumsum(padded_counts, 0) % 16 == 0).all()
    assert torch.equal(padded[rows], x.detach()) and padded.abs().sum() == x.detach().abs().sum()
    results = []
    for align in (1, 16):
        experts.row_align = align
        experts.zero_grad()
        x.grad = None
        out = experts(x, counts, "grouped")
        (out * g).sum().backward()
        results.append((out.detach(), x.grad.clone(), [p.grad.clone() for p in experts.parameters()]))
    (o1, gx1, gp1), (o2, gx2, gp2) = results
    # fp32 sums in another blocking order: relative 1e-5 (the values are up to ~20)
    assert torch.allclose(o1, o2, rtol=1e-5, atol=1e-5) and torch.allclose(gx1, gx2, rtol=1e-5, atol=1e-5)
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(gp1, gp2))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_compiled_moe_equals_eager_and_serves_every_routing_with_one_graph(dtype):
    """training.compile with routed experts: the MoE compiles with fullgraph (bf16: torch's grouped GEMM; fp32,
    whose grouped GEMM has no fake kernel to trace: the per-expert loop on data-dependent row counts). Outputs,
    router statistics and gradients equal eager's; a second batch routed differently runs without recompiling."""
    import torch._dynamo

    from titan_sft.models.moe import MoE

    torch.manual_seed(0)
    moe = MoE(32, 48, 6, 2, True).to(dtype)
    moe.init_weights(0.5, 0.3)
    torch._dynamo.reset()
    torch._dynamo.config.capture_scalar_outputs = True  # as parallelize.apply_compile sets it
    compiled = torch.compile(moe, fullgraph=True)
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-6  # bf16: the fused graph rounds elsewhere (~1 ulp apart)

    def close(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item() < rel
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(2, 24, 32, dtype=dtype, requires_grad=True)
        runs = []
        for fn in (moe, compiled):
            moe.zero_grad()
            x.grad = None
            out, counts, prob_sum, z = fn(x)
            out.float().square().sum().backward()
            runs.append((out.detach(), counts, prob_sum.detach(), x.grad.clone(), [p.grad.clone() for p in moe.parameters()]))
        (o1, c1, p1, gx1, gp1), (o2, c2, p2, gx2, gp2) = runs
        assert torch.equal(c1, c2) and torch.allclose(p1, p2, atol=1e-5)
        assert close(o2, o1) and close(gx2, gx1) and all(close(b, a) for a, b in zip(gp1, gp2))
        torch._dynamo.config.error_on_recompile = True  # the second routing must reuse the graph
    torch._dynamo.config.error_on_recompile = False


def test_the_objective_adds_the_aux_loss_per_forward_and_logs_expert_load(tmp_path):
    import dataclasses

    from titan_sft.config import load_config
    from titan_sft.models import build_model
    from titan_sft.models.moe import load_balancing_loss, router_z_loss
    from titan_sft.models.qwen3_moe import QWEN3_MOE_FLAVORS
    from titan_sft.objectives import Objective

    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], router_aux_loss_coef=0.01)
    model = build_model(args, device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    cfg = load_config(None, ["--training.global_batch_size", "4", "--training.per_device_batch", "2"])
    obj = Objective(cfg)
    ids = torch.randint(0, 512, (2, 16))
    model(ids, hidden_only=True)
    zero = torch.zeros((), requires_grad=True)
    total = obj.router_loss(model, zero)
    aux = load_balancing_loss(model.router_stats, args.n_experts)
    assert total.item() == pytest.approx(0.01 * aux.item() / 2, rel=1e-6)  # 2 forwards make the global step
    sums = [x.item() for x in obj.step_sums()]
    metrics = obj.step_metrics([2 * s for s in sums])  # as if two forwards (ranks) summed the same
    assert metrics["aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
    assert metrics["expert_load_max"] >= 1.0 >= metrics["expert_load_min"]
    assert sorted(metrics["expert_load_max_by_layer"]) == ["1", "2", "3"]  # debug_moe: layer 0 is dense
    assert max(metrics["expert_load_max_by_layer"].values()) == metrics["expert_load_max"]
    # consumed by the step; a step without router forwards here (an earlier pipeline stage) adds zeros of the
    # same length to the all-reduce
    assert [x.item() for x in obj.step_sums()] == [0.0] * len(sums)
    cfg0 = load_config(None, ["--objective.router_aux_loss_coef", "0"])
    model(ids, hidden_only=True)
    assert Objective(cfg0).router_loss(model, zero) is zero
    cfg_z = load_config(None, ["--objective.router_aux_loss_coef", "0", "--objective.router_z_loss_coef", "0.1"])
    z = router_z_loss(model.router_stats)
    assert Objective(cfg_z).router_loss(model, zero).item() == pytest.approx(0.1 * z.item() / 8, rel=1e-6)


def _train(nproc, dump, *overrides, steps=3):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", "train_configs/debug_model.toml", "--model.name", "qwen3_moe",
           "--model.flavor", "debug_moe",
           "--training.steps", str(steps), "--training.global_batch_size", "4", "--training.loss_groups", "2",
           "--training.param_dtype", "float32", "--optimizer.lr", "1e-3", "--checkpoint.interval", "100",
           "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
           "false", "--validation.generation_eval_path", "", "--job.dump_folder", str(dump), *overrides]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines() if '"train"' in x]


def _close(a, b, keys=("loss", "grad_norm", "aux_loss"), rel=1e-5):
    for key in keys:
        assert a[key] == pytest.approx(b[key], rel=rel), (key, a, b)


@pytest.mark.slow
def test_expert_parallel_layouts_match_one_rank_resume_and_export(tmp_path):
    """EP 2 x FSDP 2 (experts sharded over the ep ranks, FSDP over the ranks holding the same experts),
    TP 2 (the MoE on each tp rank's sequence slice, its parameters FSDP-sharded over the tp ranks), TP 2 x EP 2
    with full AC and compiled blocks (attention and the dense layer split by tp, the experts' gradients summed
    over tp apart) and EP 2 x cp 2
    (each rank routes its part of the rows; the load-balancing loss is the whole rows'):
    losses, grad norms and aux losses of 3 steps within 1e-5 of one rank; the EP 2 x FSDP 2 checkpoint continues
    on one rank with the curve unchanged; the HF export of an EP run (label 2) equals the 1-rank export."""
    export = ["--checkpoint.hf_export_interval", "2", "--checkpoint.hf_export_dtype", "float32",
              "--checkpoint.resume", "auto"]
    one = _train(1, tmp_path / "one", *export, steps=6)
    ep2x2 = _train(4, tmp_path / "ep2x2", *export, "--parallelism.ep", "2", "--training.stop_at_step", "3",
                   steps=6)
    # compiled blocks as well: tp's vocab-parallel embedding hands a copy to the first compiled block (a to_local
    # view got a wrong gradient), full AC wraps the compiled block, the all-to-all splits are unbacked symbols
    tp2 = _train(2, tmp_path / "tp2", "--parallelism.tp", "2")
    from titan_sft.compat import PER_PARAM_MESH  # torch < 2.13 refuses compile here (test below)

    tp2ep2 = _train(4, tmp_path / "tp2ep2", "--parallelism.ep", "2", "--parallelism.tp", "2",
                    "--training.activation_checkpoint", "full", "--training.compile", str(PER_PARAM_MESH).lower())
    # context parallel x EP: the routers' statistics are summed over the cp ranks before the load-balancing loss,
    # the experts' gradients over the cp ranks holding the same experts
    ep2cp2 = _train(4, tmp_path / "ep2cp2", "--parallelism.cp", "2", "--parallelism.ep", "2",
                    "--training.stop_at_step", "3", steps=6)
    for run in (ep2x2, tp2, tp2ep2, ep2cp2):
        assert [r["step"] for r in run] == [1, 2, 3]
        for a, b in zip(run, one):
            _close(a, b)
            assert a["expert_load_max"] == b["expert_load_max"]
    # Weights after 3 AdamW steps: m / sqrt(v) turns the 1e-7 differences of tiny gradients into up to ~2e-6 of
    # an update of lr 1e-3 (measured), hence atol 1e-5 here against 1e-5 relative on losses and norms.
    ours, ref = (_safetensors(d / "hf" / "step-2") for d in (tmp_path / "ep2x2", tmp_path / "one"))
    assert ours.keys() == ref.keys() and all(torch.allclose(ours[k], ref[k], rtol=1e-4, atol=1e-5) for k in ref)
    resumed = _train(1, tmp_path / "ep2x2", *export, steps=6)  # the EP 2 x FSDP 2 run, continued on one rank
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed[3:], one[3:]):
        _close(a, b)


def test_impossible_expert_parallel_layouts_fail_with_one_line():
    from titan_sft.config import ConfigError, check_expert_parallel, check_layout, load_config

    with pytest.raises(ConfigError, match="'parallelism.ep': 3 must be a positive divisor of the FSDP shards"):
        check_layout(load_config(None, ["--parallelism.ep", "3"]), 4)
    with pytest.raises(ConfigError, match="must divide the model's 8 experts"):
        check_expert_parallel(16, 8)
    with pytest.raises(ConfigError, match="has no routed experts"):
        check_expert_parallel(2, 0)
    assert check_layout(load_config(None, ["--parallelism.ep", "2"]), 4) == (1, 4, 1, 2, 1, 1)
    with pytest.raises(ConfigError, match="'lora.experts': true, but the model has no routed experts"):
        check_expert_parallel(1, 0, lora_experts=True)
    from titan_sft.compat import PER_PARAM_MESH

    if PER_PARAM_MESH:  # routed experts compile (test_a_compiled_moe_equals_eager...), under ep and tp too
        check_expert_parallel(2, 8, compile=True)
        check_expert_parallel(1, 8, compile=True, tp=2)
    else:  # torch < 2.13: the experts' own FSDP modules break a fullgraph compile under ep or tp
        for ep, tp in ((2, 1), (1, 2)):
            with pytest.raises(ConfigError, match=r"'training.compile': compiled blocks with routed experts under tp "
                                                  r"or ep need torch >= 2.13 .*; this is torch 2\.11"):
                check_expert_parallel(ep, 8, compile=True, tp=tp)
    check_expert_parallel(1, 8, compile=True)  # one rank's experts stay in their block's FSDP module


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "ep2"])
def test_training_from_an_hf_moe_directory_matches_one_rank(tmp_path, layout):
    """Training starts from an HF qwen3_moe directory (under FSDP 2 or EP 2 each rank reads only the experts it
    holds); losses, grad norms and the aux loss of 3 steps equal one rank's within 1e-5. Under EP 2 the ranks read
    a copy with the experts stored fused (``gate_up_proj``/``down_proj``, as Qwen3.5-MoE's checkpoints hold them),
    one rank the per-expert original."""
    from safetensors.torch import save_file

    from titan_sft.models.hf_adapter import fuse_experts

    hf = tmp_path / "hf"
    _hf_moe(hf, vocab=512, mlp_only_layers=[0])
    for f in (ROOT / "titan_sft/assets/debug_tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    start = ["--model.hf_assets_path", str(hf), "--model.init_from_hf", "true"]
    one = _train(1, tmp_path / "one", *start)
    if layout == "ep2":
        shutil.copytree(hf, tmp_path / "fused")
        (tmp_path / "fused" / "model.safetensors").unlink()
        save_file(fuse_experts(_safetensors(hf), 8), str(tmp_path / "fused" / "model.safetensors"))
        start = ["--model.hf_assets_path", str(tmp_path / "fused"), "--model.init_from_hf", "true"]
    two = _train(2, tmp_path / "two", *start, *(["--parallelism.ep", "2"] if layout == "ep2" else []))
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(two, one):
        _close(a, b)
        assert a["expert_load_max"] == b["expert_load_max"]
    if layout == "ep2":
        return
    # model.freeze_router: the routers leave the run as they came; the experts train.
    _train(1, tmp_path / "frozen", *start, "--model.freeze_router", "true", "--checkpoint.hf_export_interval", "2",
           "--checkpoint.hf_export_dtype", "float32")
    base, after = _safetensors(hf), _safetensors(tmp_path / "frozen" / "hf" / "step-2")
    routers = [k for k in base if k.endswith("mlp.gate.weight")]
    assert routers and all(torch.equal(base[k], after[k]) for k in routers)
    assert not torch.equal(base["model.layers.1.mlp.experts.0.up_proj.weight"],
                           after["model.layers.1.mlp.experts.0.up_proj.weight"])


@pytest.mark.slow
def test_debug_moe_job_learns_the_task(tmp_path):
    """train_configs/debug_moe.toml end to end: exact match >= 90% on the held-out prompts through the HF export
    (transformers' Qwen3MoeForCausalLM runs the evaluation). Measured: 98% in ~36 s on 2 cores."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_moe.toml",
                        "--job.dump_folder", str(tmp_path / "run")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    em = [x["exact_match"] for x in records if "exact_match" in x]
    assert em and em[-1] >= 0.9
    train = [x for x in records if x["split"] == "train"]
    assert all("aux_loss" in x and "expert_load_max" in x for x in train)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = EventAccumulator(str(tmp_path / "run" / "tb")).Reload().Tags()["scalars"]
    assert {"train/aux_loss", "train/expert_load_max_by_layer/1", "train/expert_load_min_by_layer/3"} <= set(tags)


@pytest.mark.parametrize("name", ["qwen3_30b_a3b", "qwen3_30b_a3b_lora"])
def test_30b_a3b_configs_dry_run_with_active_parameters_and_the_ep_layout(name):
    env = {**os.environ, "WORLD_SIZE": "16"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", f"train_configs/{name}.toml", "--dry-run",
                        "--model.init_from_hf", "false"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "30,532.1M parameters" in r.stdout and "3,353.0M active parameters" in r.stdout  # as Qwen publishes
    assert "expert parallel 8: each rank holds 16 of the 128 experts" in r.stdout
    if name.endswith("lora"):
        assert "LoRA: rank 16" in r.stdout


def test_the_routing_bias_picks_experts_weights_none_and_balances_the_load():
    """Aux-loss-free balancing (model.router_bias_rate): the bias changes which experts a token reaches, never
    their weights (the chosen experts' router probabilities, renormalised); the update moves it by the rate
    against each expert's excess load, centred; repeated on a router that favours one expert, the step's highest
    load over the mean falls from 1.28 to 1.05 (measured; asserted > 1.25 and < 1.1)."""
    from titan_sft.models.moe import MoE, routing_bias_update

    update = routing_bias_update(torch.tensor([4.0, 1.0, 1.0, 2.0]), 0.1)  # mean 2: signs -1, 1, 1, 0; centred
    assert torch.allclose(update, torch.tensor([-0.125, 0.075, 0.075, -0.025]), atol=1e-7)
    torch.manual_seed(0)
    moe = MoE(32, 16, 8, 2, True, router_bias=True)
    moe.init_weights(0.02, 0.02)
    assert torch.equal(moe.router.expert_bias, torch.zeros(8))
    with torch.no_grad():
        moe.router.gate.weight.normal_(0, 0.3)
        moe.router.gate.weight[0] += 0.3  # expert 0 favoured
    x = torch.randn(4, 64, 32)
    moe.router.expert_bias.copy_(torch.tensor([-1.0, 0, 0, 0, 0, 0, 0, 1.0]))
    probs, top_p, top_i, _ = moe.router(x.view(-1, 32))
    assert (top_i == 7).any(1).all() and not (top_i == 0).any()  # the bias decides the experts...
    chosen = probs.gather(-1, top_i)
    assert torch.allclose(top_p, chosen / chosen.sum(-1, keepdim=True))  # ...their probabilities weight them
    moe.router.expert_bias.zero_()
    loads = []
    for _ in range(300):
        counts = moe(x)[1]
        loads.append((counts.max() / counts.mean()).item())
        moe.router.expert_bias.add_(routing_bias_update(counts.double(), 1e-3).float())
    assert loads[0] > 1.25 and loads[-1] < 1.1


@pytest.mark.slow
def test_the_routing_bias_trains_alike_on_ep2_resumes_and_travels_with_the_export(tmp_path):
    """model.router_bias_rate on debug_moe: EP 2 gives the 1-rank losses, grad norms and biases (every rank
    applies the same update from the step's all-reduced selections); an EP 2 checkpoint (the bias is in it)
    continues on one rank on the uninterrupted curve; the HF export keeps the bias in routing_bias.json, which
    titan_sft's loader reads back (the same logits as the run's model) and transformers ignores."""
    from transformers import AutoModelForCausalLM

    from titan_sft.models import load_hf

    bias = ["--model.router_bias_rate", "0.01", "--checkpoint.resume", "auto", "--checkpoint.hf_export_interval",
            "6", "--checkpoint.hf_export_dtype", "float32"]
    one = _train(1, tmp_path / "one", *bias, steps=6)
    plain = _train(1, tmp_path / "plain", steps=6)
    _train(2, tmp_path / "ep2", *bias, "--parallelism.ep", "2", "--training.stop_at_step", "3", steps=6)
    resumed = _train(1, tmp_path / "ep2", *bias, steps=6)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(resumed, one):
        _close(a, b, keys=("loss", "grad_norm", "aux_loss", "router_bias_max"))
        assert a["expert_load_max"] == b["expert_load_max"]
    assert one[0]["loss"] == plain[0]["loss"] and one[1]["loss"] != plain[1]["loss"]  # zero at first, then moving
    assert one[-1]["router_bias_max"] == pytest.approx(0.07, abs=0.02)
    export = tmp_path / "one" / "hf" / "step-5"
    biases = json.loads((export / "routing_bias.json").read_text())
    assert sorted(biases) == ["1", "2", "3"] and all(len(v) == 8 for v in biases.values())  # layer 0 is dense
    assert not any("bias" in k for k in _safetensors(export))
    ours = load_hf(export)
    assert torch.equal(ours.layers["1"].feed_forward.router.expert_bias, torch.tensor(biases["1"]))
    ids = torch.randint(0, 512, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = AutoModelForCausalLM.from_pretrained(export).float().eval()(ids).logits
        ours_logits = ours(ids)
    # transformers routes by the probabilities alone: some tokens reach other experts than in training
    assert not torch.allclose(ours_logits, theirs, atol=1e-4)
    ours.layers["1"].feed_forward.router.expert_bias = None
    for i in ("2", "3"):
        ours.layers[i].feed_forward.router.expert_bias = None
    with torch.no_grad():
        assert torch.allclose(ours(ids), theirs, atol=1e-4)  # without it, the two models agree


@pytest.mark.slow
def test_pipeline_stages_pass_router_statistics_and_match_one_rank(tmp_path):
    """pp 2 (1F1B), pp 2 x EP 2, pp 2 x TP 2 and pp 2 x cp 2 (each tp or cp rank's routers see its part of the
    rows; the rows of router statistics travel per rank and are summed over tp and cp on the last stage) on debug_moe with a large
    load-balancing and z-loss weight (so the gradient the last stage sends back through the travelling router
    statistics matters): losses, grad norms, aux losses and routing biases of 3 steps within 1e-5 of one rank; the pp 2 export (routing_bias.json included) starts a pp 2
    run that equals one rank started from it (each stage loads the biases of its own layers)."""
    loss = ["--objective.router_aux_loss_coef", "1.0", "--objective.router_z_loss_coef", "0.1",
            "--model.router_bias_rate", "0.01"]
    export = ["--checkpoint.hf_export_interval", "3", "--checkpoint.hf_export_dtype", "float32"]
    one = _train(1, tmp_path / "one", *loss)
    pp2 = _train(2, tmp_path / "pp2", *loss, *export, "--parallelism.pp", "2")
    pp2ep2 = _train(4, tmp_path / "pp2ep2", *loss, "--parallelism.pp", "2", "--parallelism.ep", "2")
    pp2tp2 = _train(4, tmp_path / "pp2tp2", *loss, "--parallelism.pp", "2", "--parallelism.tp", "2")
    pp2cp2 = _train(4, tmp_path / "pp2cp2", *loss, "--parallelism.pp", "2", "--parallelism.cp", "2")
    for run in (pp2, pp2ep2, pp2tp2, pp2cp2):
        assert [r["step"] for r in run] == [1, 2, 3]
        for a, b in zip(run, one):
            _close(a, b, keys=("loss", "grad_norm", "aux_loss", "router_bias_max"))
            assert a["expert_load_max"] == b["expert_load_max"]
    hf = tmp_path / "pp2" / "hf" / "step-2"  # labels count from 0
    assert sorted(json.loads((hf / "routing_bias.json").read_text())) == ["1", "2", "3"]
    for f in (ROOT / "titan_sft/assets/debug_tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    start = [*loss, "--model.hf_assets_path", str(hf), "--model.init_from_hf", "true"]
    ref, ours = _train(1, tmp_path / "one_hf", *start, steps=1), _train(2, tmp_path / "pp2_hf", *start,
                                                                      "--parallelism.pp", "2", steps=1)
    _close(ours[0], ref[0], keys=("loss", "grad_norm", "aux_loss", "router_bias_max"))
    assert ref[0]["router_bias_max"] > one[0]["router_bias_max"]  # it started from the trained biases


@pytest.mark.slow
def test_lora_on_an_moe_model_loads_in_peft_like_the_merged_export(tmp_path):
    """LoRA on Qwen3-MoE: adapters on the attention (experts and routers frozen); peft loads adapters/final onto
    transformers' Qwen3MoeForCausalLM and gives the merged export's logits; the routers did not move."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "hf"
    _hf_moe(hf, vocab=512, mlp_only_layers=[0])
    for f in (ROOT / "titan_sft/assets/debug_tokenizer").iterdir():
        shutil.copy(f, hf / f.name)
    _train(1, tmp_path / "run", "--model.hf_assets_path", str(hf), "--model.init_from_hf", "true",
           "--model.converters", "lora", "--lora.targets", "q_proj,k_proj,v_proj,o_proj", "--optimizer.lr", "1e-2",
           "--checkpoint.hf_export_interval", "2", "--checkpoint.hf_export_dtype", "float32")
    adapter = tmp_path / "run" / "adapters" / "final"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    ids = torch.randint(0, 512, (2, 20))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
        before = base(ids).logits
        peft_logits = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf" / "step-2", dtype=torch.float32).eval()
        merged_logits = merged(ids).logits
    assert (peft_logits - merged_logits).abs().max() < 1e-4
    assert (merged_logits - before).abs().max() > 1e-3  # the adapters did train
    start, end = _safetensors(hf), _safetensors(tmp_path / "run" / "hf" / "step-2")
    assert all(torch.equal(start[k], end[k]) for k in start if ".mlp." in k)  # experts, routers, dense MLP frozen


@pytest.mark.parametrize("impl", ["grouped", "loop"])
def test_lora_on_the_experts_equals_the_merged_weights(impl):
    """Stacked per-expert adapters: zero at init (the base model's outputs exactly), and after B moves the model's
    logits equal those of the base model with W_e + scale * B_e A_e merged in (merge_lora, as the HF export)."""
    import dataclasses

    from titan_sft.config import load_config
    from titan_sft.lora import apply_lora, merge_lora
    from titan_sft.models.qwen3_moe import QWEN3_MOE_FLAVORS
    from titan_sft.models.transformer import Transformer

    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], moe_impl=impl)
    torch.manual_seed(0)
    base = Transformer(args)
    base.init_weights()
    model = Transformer(args)
    model.load_state_dict(base.state_dict())
    cfg = load_config(None, ["--model.converters", "lora", "--lora.experts", "true", "--lora.rank", "8",
                             "--lora.targets", "q_proj,gate_proj,down_proj"])
    names = apply_lora(model, cfg)
    assert "layers.1.feed_forward.experts.w1" in names and "layers.1.feed_forward.experts.w3" not in names
    for m in model.modules():
        if hasattr(m, "reset_converter_parameters"):
            m.reset_converter_parameters(0)
    ids = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))
        for name, p in model.named_parameters():
            if name.endswith("lora_b"):
                p.normal_(std=0.05)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert "layers.1.feed_forward.experts.w2_lora_a" in trainable and not any("router" in n for n in trainable)
        merged = Transformer(args)
        merged.load_state_dict(merge_lora(model.state_dict(), cfg.lora.alpha / cfg.lora.rank))
        assert (model(ids) - merged(ids)).abs().max() < 1e-5
        assert (merged(ids) - base(ids)).abs().max() > 1e-3


@pytest.mark.slow
def test_lora_on_the_experts_under_expert_parallel_matches_one_rank_and_exports_merged(tmp_path):
    """Adapters on attention and on every expert's gate/up/down: EP 2 gives the 1-rank losses and grad norms (1e-5)
    over 3 steps; the merged HF export equals the 1-rank one and transformers reloads it; the adapter directory keeps the stacked expert adapters beside the PEFT files, read back by warm starts."""
    from transformers import AutoModelForCausalLM

    from titan_sft.lora import read_peft_adapter, vllm_lora_problems

    lora = ["--model.converters", "lora", "--lora.experts", "true", "--lora.rank", "8", "--optimizer.lr", "1e-2",
            "--checkpoint.hf_export_interval", "2", "--checkpoint.hf_export_dtype", "float32"]
    one = _train(1, tmp_path / "one", *lora)
    ep2 = _train(2, tmp_path / "ep2", *lora, "--parallelism.ep", "2")
    for a, b in zip(ep2, one):
        _close(a, b, keys=("loss", "grad_norm"))
    export = tmp_path / "ep2" / "hf" / "step-2"
    ours, ref = _safetensors(export), _safetensors(tmp_path / "one" / "hf" / "step-2")
    assert ours.keys() == ref.keys()
    # The merged weights: base (the same seed) + update; the updates compared as made (B @ A per module and
    # expert) within 1e-3 of their size, not element by element (tests/test_parallel.assert_same_adapter_updates)
    assert all((ours[k] - ref[k]).norm() <= 1e-4 * ref[k].norm() for k in ref)
    assert_same_adapter_updates(*(read_peft_adapter(tmp_path / d / "adapters" / "final")[1]
                                  for d in ("ep2", "one")), 1e-3)
    AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)  # loads: per-expert names, merged
    conf, state = read_peft_adapter(tmp_path / "ep2" / "adapters" / "final")
    assert conf["titan_sft_expert_adapters"] == "expert_adapters.safetensors"
    assert state["layers.1.feed_forward.experts.w1_lora_b"].shape == (8, 128, 8)  # [experts, out, r]
    assert state["layers.1.feed_forward.experts.w2_lora_b"].abs().max() > 0  # trained
    assert any("experts" in p for p in vllm_lora_problems(tmp_path / "ep2" / "adapters" / "final"))


def test_float8_for_the_experts_is_gated_and_high_precision_unwraps_it(caplog):
    """On CPU, float8 converts the block linears (emulated) and leaves the experts in the compute dtype with one
    notice; experts converted to torchao's float8 training weights (the GPU path) compute, inside
    high_precision_matmuls (validation, generation), exactly as the unconverted model."""
    import dataclasses
    import logging

    from titan_sft.config import load_config
    from titan_sft.converters import apply_float8_experts, float8_converter, high_precision_matmuls
    from titan_sft.models.qwen3_moe import QWEN3_MOE_FLAVORS
    from titan_sft.models.transformer import Transformer

    args = dataclasses.replace(QWEN3_MOE_FLAVORS["debug_moe"], moe_impl="grouped")
    torch.manual_seed(0)
    base = Transformer(args)
    base.init_weights()
    model = Transformer(args)
    model.load_state_dict(base.state_dict())
    cfg = load_config(None, ["--training.float8", "true"])
    with caplog.at_level(logging.WARNING):
        float8_converter(model, cfg, torch.device("cpu"))
    assert "float8 grouped GEMM for the routed experts needs CUDA" in caplog.text
    assert type(model.layers["1"].feed_forward.experts.w1.data) is torch.Tensor
    assert type(model.layers["1"].attention.wq).__name__ == "Float8Linear"
    names = apply_float8_experts(model)
    assert names[:3] == [f"layers.1.feed_forward.experts.{w}" for w in ("w1", "w2", "w3")]
    assert type(model.layers["1"].feed_forward.experts.w1.data).__name__ == "Float8TrainingWeightWrapperTensor"
    ids = torch.randint(0, args.vocab_size, (2, 16))
    with torch.no_grad(), high_precision_matmuls(model):
        assert torch.equal(model(ids), base(ids))


@pytest.mark.parametrize("targets,rslora", [("q_proj,gate_proj,up_proj,down_proj", False),
                                            ("gate_proj,down_proj", True), ("up_proj", False)])
def test_expert_adapters_load_in_peft_through_target_parameters(tmp_path, targets, rslora):
    """Expert adapters in PEFT's format (issue 37, item 4): PEFT loads the adapter directory onto transformers'
    Qwen3-MoE (fused gate_up_proj / down_proj through target_parameters) and its logits equal titan_sft's (1e-5);
    titan_sft reads its own factors back exactly."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from titan_sft.config import load_config
    from titan_sft.lora import apply_lora, is_adapter_key, read_peft_adapter, save_peft_adapter
    from titan_sft.models import load_hf
    from titan_sft.models.hf_adapter import native_to_hf_name

    _hf_moe(tmp_path / "base")
    model = load_hf(tmp_path / "base")
    cfg = load_config(None, ["--model.converters", "lora", "--lora.experts", "true", "--lora.rank", "8",
                             "--lora.alpha", "16", "--lora.targets", targets, "--lora.use_rslora", str(rslora).lower()])
    apply_lora(model, cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if is_adapter_key(n):
                p.normal_(std=0.1)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if is_adapter_key(n)}
    save_peft_adapter(state, cfg.lora, tmp_path / "adapter", None, False, native_to_hf_name)
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["target_parameters"]
    ids = torch.randint(0, 320, (2, 20))
    with torch.no_grad():
        ours = model(ids)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
        before = base(input_ids=ids).logits
        theirs = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()(input_ids=ids).logits
    assert (theirs - ours).abs().max().item() < 1e-5
    assert (theirs - before).abs().max().item() > 1e-2  # the expert adapters change the output
    _, back = read_peft_adapter(tmp_path / "adapter")
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    from titan_sft.generate import load_model

    again, _, _ = load_model(str(tmp_path / "adapter"), base=str(tmp_path / "base"))  # titan_sft's own reader
    with torch.no_grad():
        assert torch.equal(again(ids), ours)
