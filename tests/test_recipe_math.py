"""LR schedule, chunked cross-entropy, loss groups, decay mask: exact recipe semantics, no processes."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_sft.config import LRScheduler
from titan_sft.data.collator import collate
from titan_sft.data.dataset import PackedDataset
from titan_sft.loss import chunked_cross_entropy_sum, naive_cross_entropy_sum
from titan_sft.lr_schedule import Schedule, build_lr_scheduler
from titan_sft.models import build_model
from titan_sft.models.qwen3 import QWEN3_FLAVORS
from titan_sft.optimizer import build_optimizer, decay_groups
from titan_sft.config import Optimizer
from titan_sft.objectives.causal_lm import group_weights

DEBUG_DATA = "titan_sft/assets/debug_data/packed"


def reference_schedule(T, warmup, decay, a, shape):
    """The multipliers of all T updates as the recipe's text describes the schedule: three phases laid end to end
    (warmup ramp from 0, a flat stretch, the decay curve from 1 towards a), each phase's length from the rule "a
    value <= 1 is a fraction of T (rounded down), a larger one a step count; warmup at most T, decay at most what
    warmup leaves"."""
    def length(v, cap):
        return min(math.floor(v * T) if v <= 1 else round(v), cap)

    n_warm = length(warmup, T)
    n_decay = length(decay, T - n_warm)
    ramp = [k / n_warm for k in range(n_warm)]
    curve = {"cosine": lambda x: a + (1 - a) * (1 + math.cos(math.pi * x)) / 2,  # x: fraction of the decay done
             "linear": lambda x: 1 - (1 - a) * x, "constant": lambda x: 1.0}[shape]
    fall = [curve(k / n_decay) for k in range(n_decay)]
    return ramp + [1.0] * (T - n_warm - n_decay) + fall


def test_the_recipe_schedule_at_hand_computed_steps():
    """Qwen3-8B's numbers from the recipe table (T 2000, warmup 0.05, decay 0.9, min_lr_ratio 0.1, cosine): 100
    warmup steps, 100 flat, 1800 of decay; values worked out by hand."""
    sched = Schedule.from_config(LRScheduler(warmup=0.05, decay=0.9, min_lr_ratio=0.1, decay_type="cosine"), 2000)
    expect = {0: 0.0, 1: 0.01, 50: 0.5, 99: 0.99, 100: 1.0, 199: 1.0, 200: 1.0,
              1100: 0.55,  # half-way through the decay: cos(pi / 2) = 0, so 0.1 + 0.9 / 2
              1999: 0.1 + 0.45 * (1 + math.cos(math.pi * 1799 / 1800))}
    for step, value in expect.items():
        assert sched.multiplier(step) == pytest.approx(value, abs=1e-12), step


@pytest.mark.parametrize("T,warmup,decay,a,shape", [
    (2000, 0.05, 0.9, 0.1, "cosine"),   # qwen3-8b
    (100, 0.03, 0.9, 0.1, "cosine"),
    (50, 5, 20, 0.0, "linear"),         # whole steps
    (10, 0.5, 0.9, 0.2, "cosine"),      # decay clamped to T - warmup
    (10, 20, 0.5, 0.1, "cosine"),       # warmup clamped to T
    (30, 0.1, 0, 0.1, "cosine"),        # decay 0: 1 after warmup
    (30, 0.0, 1.0, 0.0, "constant"),
])
def test_lr_matches_recipe_every_step(T, warmup, decay, a, shape):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=2.0)
    sched = build_lr_scheduler(opt, LRScheduler(warmup=warmup, decay=decay, min_lr_ratio=a, decay_type=shape), T)
    reference = reference_schedule(T, warmup, decay, a, shape)
    assert len(reference) == T
    for s in range(T):
        assert opt.param_groups[0]["lr"] == pytest.approx(2.0 * reference[s], abs=1e-12)
        opt.step()
        sched.step()
    if warmup > 0:
        assert Schedule.from_config(LRScheduler(warmup=warmup, decay=decay, min_lr_ratio=a, decay_type=shape), T).multiplier(0) == 0.0


TRANSFORMERS_SCHEDULES = ["linear", "cosine", "cosine_with_restarts", "polynomial", "constant",
                          "constant_with_warmup", "inverse_sqrt", "cosine_with_min_lr"]


@pytest.mark.parametrize("name", TRANSFORMERS_SCHEDULES)
@pytest.mark.parametrize("warmup_steps", [0, 3])
def test_transformers_schedules_equal_get_scheduler_every_step(name, warmup_steps):
    """``lr_scheduler.name`` = a transformers scheduler and ``warmup_steps`` a count: the lr of every update equals
    transformers' ``get_scheduler(name, ...)`` stepped beside it (its defaults; cosine_with_min_lr at
    min_lr_ratio 0.1), exactly."""
    from transformers import get_scheduler

    T, lr = 23, 3e-4
    ours, theirs = (torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr) for _ in range(2))
    cfg = LRScheduler(name=name, warmup_steps=warmup_steps, min_lr_ratio=0.1 if name == "cosine_with_min_lr" else 0)
    sched = build_lr_scheduler(ours, cfg, T)
    ref = get_scheduler(name, theirs, num_warmup_steps=warmup_steps, num_training_steps=T,
                        scheduler_specific_kwargs={"min_lr_rate": 0.1} if name == "cosine_with_min_lr" else None)
    seen = set()
    for _ in range(T):
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
        seen.add(ours.param_groups[0]["lr"])
        for opt, s in ((ours, sched), (theirs, ref)):
            opt.step()
            s.step()
    flat = name == "constant" or (name == "constant_with_warmup" and not warmup_steps)  # constant ignores warmup
    assert (len(seen) == 1) == flat


def test_warmup_steps_is_a_count_and_warmup_one_is_the_whole_run():
    """``warmup_steps = 1`` is one step of warmup; ``warmup = 1`` (the fraction rule) is 100% of the steps."""
    assert Schedule.from_config(LRScheduler(warmup_steps=1, decay=0), 10).warmup == 1
    assert Schedule.from_config(LRScheduler(warmup=1, decay=0), 10).warmup == 10
    assert Schedule.from_config(LRScheduler(warmup_steps=4, decay=0.5), 10) == \
        Schedule.from_config(LRScheduler(warmup=4, decay=0.5), 10)


def test_schedule_settings_are_refused_where_they_do_not_apply():
    from titan_sft.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"'lr_scheduler.warmup_steps': got 5, allowed: -1 when lr_scheduler.warmup"):
        load_config(None, ["--lr_scheduler.warmup", "0.1", "--lr_scheduler.warmup_steps", "5"])
    with pytest.raises(ConfigError, match=r"'lr_scheduler.min_lr_ratio'.*0 with transformers' 'linear'"):
        load_config(None, ["--lr_scheduler.name", "linear", "--lr_scheduler.min_lr_ratio", "0.1"])
    with pytest.raises(ConfigError, match=r"'lr_scheduler.name': got 'cosine_annealing', expected one of"):
        load_config(None, ["--lr_scheduler.name", "cosine_annealing"])


def test_lr_rejects_bad_values():
    with pytest.raises(ValueError, match="warmup"):
        Schedule.from_config(LRScheduler(warmup=-1), 10)
    with pytest.raises(ValueError, match="decay"):
        Schedule.from_config(LRScheduler(decay=2.5), 10)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_chunked_ce_equals_naive(chunk):
    h = torch.randn(3, 50, 32, dtype=torch.float64, requires_grad=True)
    w = torch.randn(97, 32, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 97, (3, 50))
    y[0, :10] = -100
    weights = torch.rand(3, 50, dtype=torch.float64)
    for wts in (None, weights):
        h.grad = w.grad = None
        ref = naive_cross_entropy_sum(h, w, y) if wts is None else (
            F.cross_entropy((h @ w.T).float().flatten(0, 1), y.flatten(), reduction="none", ignore_index=-100)
            * wts.flatten().float()).sum()
        ref.backward()
        gh, gw = h.grad.clone(), w.grad.clone()
        h.grad = w.grad = None
        out = chunked_cross_entropy_sum(h, w, y, chunk, wts)
        out.backward()
        assert torch.allclose(out, ref, rtol=1e-6)
        assert (h.grad - gh).abs().max() <= 1e-6 * gh.abs().max()
        assert (w.grad - gw).abs().max() <= 1e-6 * gw.abs().max()


def test_chunked_ce_fp32_and_no_grad():
    h = torch.randn(200, 16, requires_grad=True)
    w = torch.randn(300, 16, requires_grad=True)
    y = torch.randint(0, 300, (200,))
    naive_cross_entropy_sum(h, w, y).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    chunked_cross_entropy_sum(h, w, y, 33).backward()
    assert (h.grad - gh).abs().max() <= 1e-6 * gh.abs().max()
    assert (w.grad - gw).abs().max() <= 1e-6 * gw.abs().max()
    with torch.no_grad():
        assert torch.allclose(chunked_cross_entropy_sum(h, w, y, 33), naive_cross_entropy_sum(h, w, y), rtol=1e-6)


@pytest.mark.parametrize("G,P", [(2, 1), (2, 2), (1, 4), (4, 1)])
def test_loss_groups_equal_mean_of_group_token_means(G, P):
    """Weighted chunked loss over microbatches == mean over groups of (group CE sum / group targets), with grads."""
    ds = PackedDataset(DEBUG_DATA)
    torch.manual_seed(0)
    model = build_model(QWEN3_FLAVORS["debug"], device="cpu").double()
    model.init_weights()
    B = 4
    ids = list(range(10, 10 + B))
    group_of = np.arange(B) // (B // G)
    # direct: per group, per-example logits, sum of CE / count
    direct = 0.0
    for g in range(G):
        num, den = 0.0, 0
        for i in np.nonzero(group_of == g)[0]:
            mb = collate([ds[ids[i]]], [g])
            logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions)
            num = num + F.cross_entropy(logits[0].float(), mb.labels[0], ignore_index=-100, reduction="sum")
            den += mb.n_loss_tokens
        direct = direct + num / den / G
    direct.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mbs = [collate([ds[ids[k]] for k in range(s, s + P)], group_of[s:s + P].tolist()) for s in range(0, B, P)]
    counts = torch.zeros(G, dtype=torch.float64)
    for mb in mbs:
        counts += torch.bincount(mb.groups[mb.labels != -100], minlength=G).double()
    assert counts.tolist() == np.bincount(group_of, weights=ds.assistant_counts[ids], minlength=G).tolist()
    total = 0.0
    for mb in mbs:
        hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
        loss = chunked_cross_entropy_sum(hidden, model.output.weight, mb.labels, 4096,
                                         group_weights(mb.labels, mb.groups, counts, G))
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(direct.item(), rel=1e-6)
    for n, p in model.named_parameters():
        assert torch.allclose(p.grad, ref_grads[n], rtol=1e-5, atol=1e-8), n


def test_g1_is_global_token_mean():
    labels = torch.tensor([[1, -100, 2, 3, -100, 4]])
    w = group_weights(labels, torch.zeros_like(labels), torch.tensor([4.0], dtype=torch.float64), 1)
    assert w.tolist() == [[0.25, 0.0, 0.25, 0.25, 0.0, 0.25]]


def test_decay_mask_tied_and_untied():
    for flavor in ("0.6B", "8B"):
        model = build_model(QWEN3_FLAVORS[flavor])
        decay, no_decay = decay_groups(model)
        assert "tok_embeddings.weight" in no_decay and "norm.weight" in no_decay
        assert "layers.0.attention.q_norm.weight" in no_decay and "layers.0.attention.k_norm.weight" in no_decay
        assert "layers.0.attention_norm.weight" in no_decay and "layers.0.ffn_norm.weight" in no_decay
        assert "layers.3.attention.wq.weight" in decay and "layers.3.feed_forward.w2.weight" in decay
        if flavor == "8B":
            assert "output.weight" in decay  # an untied head decays
        else:
            assert "output.weight" not in decay + no_decay  # tied: one tensor, the embedding
        assert len(decay) + len(no_decay) == len(list(model.parameters()))
    model = build_model(QWEN3_FLAVORS["debug"], device="cpu")
    opt = build_optimizer(model, Optimizer(weight_decay=0.1))
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]


def test_decay_mask_all_decays_every_trainable_parameter_like_the_reference():
    """``optimizer.decay_mask = "all"``: AdamW decays norms, the embedding and adapters alike, so one step equals
    torch's AdamW over the whole trainable list with one weight decay (the reference's optimizer), exactly; the
    recipe mask differs on the norms."""
    from titan_sft.config import load_config
    from titan_sft.lora import apply_lora

    torch.manual_seed(0)
    model = build_model(QWEN3_FLAVORS["debug"], device="cpu")
    apply_lora(model, load_config(None, ["--model.converters", "lora", "--lora.train_norms", "true"]))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.1)  # built on the CPU without init: any finite values
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert any(n.endswith("norm.weight") for n, p in model.named_parameters() if p.requires_grad)
    decay, no_decay = decay_groups(model, "all")
    assert no_decay == [] and len(decay) == len(trainable)
    for p in trainable:
        p.grad = torch.randn_like(p)
    ref = {id(p): p.detach().clone().requires_grad_() for p in trainable}
    for p in trainable:
        ref[id(p)].grad = p.grad.clone()
    ours = build_optimizer(model, Optimizer(weight_decay=0.1, decay_mask="all", lr=1e-2, foreach=False))
    theirs = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1, foreach=False)
    ours.step()
    theirs.step()
    assert all(torch.equal(p, ref[id(p)]) for p in trainable)
    recipe = decay_groups(model)[1]
    assert recipe and all("norm" in n for n in recipe)


@pytest.mark.parametrize("overrides", [["--optimizer.decay_mask", "all"], ["--lora.train_norms", "false"]])
def test_an_optimizer_with_nothing_outside_decay_restores_from_its_checkpoint_state(overrides):
    """decay_mask "all", and LoRA without trained norms, leave the no-decay group empty. Such a group is not built:
    the flattened optimizer state a checkpoint stores (``get_optimizer_state_dict``) could not be loaded back
    (an IndexError that sent every resume of such a run back to step 0), and the restored moments are the saved."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from titan_sft.config import load_config
    from titan_sft.lora import apply_lora

    def build():
        torch.manual_seed(0)
        model = build_model(QWEN3_FLAVORS["debug"], device="cpu")
        cfg = load_config(None, ["--model.converters", "lora", "--optimizer.weight_decay", "0.1", *overrides])
        apply_lora(model, cfg)
        return model, build_optimizer(model, cfg.optimizer)

    model, opt = build()
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1]
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    opt.step()
    saved = get_optimizer_state_dict(model, opt)
    model2, opt2 = build()
    set_optimizer_state_dict(model2, opt2, saved)
    params2 = dict(model2.named_parameters())
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert torch.equal(opt2.state[params2[n]]["exp_avg"], opt.state[p]["exp_avg"]), n
