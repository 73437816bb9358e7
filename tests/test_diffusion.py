"""Masked-diffusion SFT: data, noising, loss, attention, sampler, LoRA/PEFT, layouts, resume, the debug job."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_sft.config import ConfigError, load_config
from titan_sft.registry import get_train_spec

ROOT = Path(__file__).resolve().parent.parent
DEBUG_TOK = str(ROOT / "titan_sft/assets/debug_tokenizer")
MASK = 280  # first embedding row past the 280-token debug tokenizer


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model(causal=False, seed=0):
    spec = get_train_spec("qwen3")
    torch.manual_seed(seed)
    model = spec.model_cls(dataclasses.replace(spec.flavors["debug"], causal=causal))
    model.init_weights()
    return model


# ---------------------------------------------------------------------------------------------------------------
# data


def test_prepare_diffusion_examples_splits_and_eos_padding(tmp_path):
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare_diffusion import prepare_diffusion

    rows = [
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "upper: ab"},
                      {"role": "assistant", "content": "AB"}, {"role": "user", "content": "upper: cd"},
                      {"role": "assistant", "content": "CD"}]},  # two examples
        {"instruction": "upper", "input": "ef", "output": "EF"},
        {"instruction": "upper", "output": ""},  # empty answer: skipped, counted
        {"messages": [{"role": "user", "content": "upper: gh"}, {"role": "assistant", "content": ""}]},  # same
    ] + [{"instruction": "upper", "input": c * 2, "output": c.upper() * 2} for c in "ijklmnop"]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ds"
    m = prepare_diffusion([str(src)], DEBUG_TOK, 64, str(out), eos_pad=True, validation_size=2, split_seed=3)
    tok = load_tokenizer(DEBUG_TOK)
    train, val = PackedDataset(out / "train"), PackedDataset(out / "validation")
    assert m["splits"]["validation"]["rows"] == 2 and m["splits"]["train"]["rows"] == 10
    assert json.loads((out / "train" / "manifest.json").read_text())["skipped_empty_answer"] == 2
    assert len(train) + len(val) == 2 + 1 + 8  # the multi-turn row gave two examples
    texts = [tok.decode(train[i][0]) for i in range(len(train))]
    for i in range(len(train)):
        tokens, mask, doc_lens, answer_lens = train[i]
        assert list(doc_lens) == [64]  # one example per pack, padded to the end
        on = np.flatnonzero(mask)
        n_ans = int(answer_lens[0])
        assert on[-1] == 63 and np.all(np.diff(on) == 1)  # answer + padding are contiguous to the end
        answer = tokens[on[0] : on[0] + n_ans]
        assert answer[-1] == tok.eos_token_id and np.all(tokens[on[0] + n_ans :] == tok.eos_token_id)
        assert tok.decode(tokens[: on[0]]).endswith("<|im_start|>assistant\n")  # the prompt ends at the header
    second_turn = [t for t in texts if "upper: cd" in t]
    if second_turn:  # history kept: the earlier turn and the system prompt are part of this prompt
        assert "upper: ab" in second_turn[0] and "be brief" in second_turn[0] and "CD" in second_turn[0]
    # Without EOS padding: examples are packed, documents recorded, answers only in the mask.
    out2 = tmp_path / "packed"
    prepare_diffusion([str(src)], DEBUG_TOK, 128, str(out2))
    ds = PackedDataset(out2 / "train")
    tokens, mask, doc_lens, answer_lens = ds[0]
    assert len(doc_lens) > 1 and int(mask.sum()) == int(answer_lens.sum())
    # include_answer_eos false (the reference's switch): each answer is one token shorter, without its end-of-turn.
    out3 = tmp_path / "no_eos"
    assert prepare_diffusion([str(src)], DEBUG_TOK, 128, str(out3), include_answer_eos=False)["include_answer_eos"] \
        is False
    bare = PackedDataset(out3 / "train")
    assert np.array_equal(bare.answer_lens, ds.answer_lens - 1)
    tokens, mask, doc_lens, _ = bare[0]
    ends = np.flatnonzero(np.diff(np.concatenate([mask, [0]]).astype(int)) == -1)  # last answer token of each doc
    assert len(ends) == len(doc_lens) and not np.isin(tokens[ends], [tok.eos_token_id]).any()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    from titan_sft.data.prepare import PrepareError

    with pytest.raises(PrepareError, match=r"bad.jsonl:1: no assistant turn"):
        prepare_diffusion([str(bad)], DEBUG_TOK, 64, str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def _docs(ds):
    """Every document of ``ds`` as (tokens, mask, answer length)."""
    out = []
    for i in range(len(ds)):
        tokens, mask, doc_lens, answer_lens = ds[i][:4]
        start = 0
        for n, a in zip(doc_lens, answer_lens):
            out.append((tokens[start : start + n], mask[start : start + n], int(a)))
            start += int(n)
    return out


@pytest.mark.parametrize("eos_pad", [True, False])
def test_history_drawn_per_batch_equals_prepared_with_and_without_it(tmp_path, eos_pad):
    """``--history-draw batch`` (the reference's multi_turn_prob, drawn at collate time): a training example with
    its history cut out equals the example prepared without history, kept it equals the example prepared with its
    last ``max_history_turns`` pairs (both rendered by the chat template from the messages); the draw follows
    (seed, key, document), differs between keys at the given rate, never keeps history in held-out streams, and
    held-out splits are prepared without it."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare_diffusion import prepare_diffusion
    from titan_sft.objectives.causal_lm import CausalLM
    from titan_sft.objectives.masked_diffusion import (HISTORY_STREAM, TRAIN_STREAM, VALIDATION_STREAM,
                                                       collate_diffusion, noise_rng)

    turns = lambda c, n: [m for i in range(n) for m in ({"role": "user", "content": f"upper: {c * (i + 1)}"},  # noqa: E731
                                                         {"role": "assistant", "content": c.upper() * (i + 1)})]
    rows = [{"messages": turns(c, 3)} for c in "abcdef"] + [{"instruction": "upper", "input": c, "output": c.upper()}
                                                             for c in "ghij"]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = dict(eos_pad=eos_pad, max_history_turns=1, validation_size=2, split_seed=1)
    prepare_diffusion([str(src)], DEBUG_TOK, 96, str(tmp_path / "batch"), history_draw="batch", history_prob=0.5,
                      **common)
    prepare_diffusion([str(src)], DEBUG_TOK, 96, str(tmp_path / "kept"), history_prob=1.0, **common)
    prepare_diffusion([str(src)], DEBUG_TOK, 96, str(tmp_path / "none"), **{**common, "max_history_turns": 0})
    ds = PackedDataset(tmp_path / "batch" / "train")
    assert ds.manifest["history_draw"] == {"prob": 0.5, "max_turns": 1}
    spans = ds.history_spans
    assert (spans[:, 1] > 0).sum() >= 8  # the second and third turns of each training conversation
    kept, none = _docs(PackedDataset(tmp_path / "kept" / "train")), _docs(PackedDataset(tmp_path / "none" / "train"))
    for i in range(len(ds)):
        pack = ds[i]
        for keep, ref in ((True, kept), (False, none)):
            out = pack[4].apply(pack[:4], np.full(len(pack[2]), keep))
            assert len(out[0]) == 96 and int(np.sum(out[2])) <= 96
            got = _docs([out])
            first = int(ds.pack_offsets[i]) if eos_pad else None
            for j, (t, m, a) in enumerate(got):
                want = ref[first + j] if eos_pad else next(r for r in ref if len(r[0]) == len(t) and
                                                          np.array_equal(r[0], t))
                assert np.array_equal(t, want[0]) and np.array_equal(m, want[1]) and a == want[2]
    val = PackedDataset(tmp_path / "batch" / "validation")
    assert val.history_spans is None and "history_draw" not in val.manifest
    assert [d[0].tolist() for d in _docs(val)] == [d[0].tolist() for d in _docs(
        PackedDataset(tmp_path / "none" / "validation"))]  # held out: no history, as the reference evaluates

    # The collator draws per (seed, key, document): repeatable, different across keys at ~prob, none held out.
    with_history = [i for i in range(len(ds)) if ds[i][4].spans[:, 1].any()]
    p = with_history[0]
    kw = dict(mask_id=MASK, t_min=0.1, shift=False, split=False, answer_weight=1.0, padding_weight=0.0,
              per_example=True, seed=5)
    tokens, _, doc_lens, _, history = ds[p]
    d0 = int(np.flatnonzero(history.spans[:, 1])[0])  # documents before it have no history: nothing shifts them
    a = int(np.sum(doc_lens[:d0])) + int(history.spans[d0, 0])
    h = int(history.spans[d0, 1])
    draws = []
    for key in range(200):
        mb = collate_diffusion([ds[p]], [key], **kw)
        assert torch.equal(mb.input_ids, collate_diffusion([ds[p]], [key], **kw).input_ids)
        draws.append(not np.array_equal(mb.input_ids[0, a : a + h].numpy(), tokens[a : a + h]))  # prompts stay clean
        if key < 3:  # equal to collating the pack with the same draw made explicitly
            keep = np.array([noise_rng(5, HISTORY_STREAM, key, d).random() < 0.5 for d in range(len(doc_lens))])
            ref = collate_diffusion([history.apply(ds[p][:4], keep)], [key], **kw)
            assert torch.equal(mb.input_ids, ref.input_ids) and torch.equal(mb.targets, ref.targets)
            assert torch.equal(mb.cu_seqlens, ref.cu_seqlens)
    assert 0.35 < np.mean(draws) < 0.65
    held = collate_diffusion([ds[p]], [0], **kw, stream=VALIDATION_STREAM)
    ref = collate_diffusion([ds[p][4].apply(ds[p][:4], np.zeros(len(ds[p][2]), bool))], [0], **kw,
                            stream=VALIDATION_STREAM)
    assert torch.equal(held.input_ids, ref.input_ids) and TRAIN_STREAM != VALIDATION_STREAM
    with pytest.raises(ConfigError, match="causal_lm does not draw the per-batch history"):
        CausalLM.check_dataset(object.__new__(CausalLM), ds)


def test_validation_examples_are_counted_in_examples_whatever_the_packing(one_rank_group, tmp_path):
    """``validation.max_loss_examples`` (the reference's validation_samples) evaluates the first N examples of a
    greedily packed held-out set: N examples are counted, a pack cut after its r-th document gives the loss of that
    pack with the rest blanked to padding, all documents equal no limit, and the test split is never cut."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare_diffusion import prepare_diffusion
    from titan_sft.objectives.masked_diffusion import (TEST_STREAM, VALIDATION_STREAM, DenoisingValidator,
                                                       MaskedDiffusion)

    prepare_diffusion([str(ROOT / "titan_sft/assets/debug_data/heldout.jsonl")], DEBUG_TOK, 96, str(tmp_path / "d"))
    ds = PackedDataset(tmp_path / "d" / "train")
    per_pack = [len(ds[i][2]) for i in range(len(ds))]
    assert per_pack[0] > 2 and len(ds) > 2
    model = _model()

    def evaluate(n, dataset=ds, stream=VALIDATION_STREAM):
        cfg = load_config(None, ["--objective.name", "masked_diffusion", "--data.path", str(tmp_path / "d/train"),
                                 "--validation.path", str(tmp_path / "d/train"), "--validation.batch_size", "2",
                                 "--validation.max_loss_examples", str(n)])
        obj = MaskedDiffusion(cfg)
        obj.mask_id = MASK
        return DenoisingValidator(obj).evaluate(model, dataset, stream)

    r = 2
    n = per_pack[0] + r  # the first pack whole, the second cut after its r-th document
    got = evaluate(n)
    assert got["n_examples"] == n
    tokens, mask, doc_lens, answer_lens = ds[1]
    used = int(np.sum(doc_lens[:r]))
    blank = (np.concatenate([tokens[:used], np.full(len(tokens) - used, ds.manifest["pad_id"], tokens.dtype)]),
             np.concatenate([mask[:used], np.zeros(len(mask) - used, mask.dtype)]), doc_lens[:r], answer_lens[:r])
    want = evaluate(0, [ds[0], blank])
    assert got["n_examples"] == want["n_examples"] and got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert evaluate(sum(per_pack))["loss"] == pytest.approx(evaluate(0)["loss"], rel=1e-9)
    assert evaluate(n, stream=TEST_STREAM)["n_examples"] == sum(per_pack)
    with pytest.raises(ConfigError, match="'validation.max_loss_examples'"):
        load_config(None, ["--validation.max_loss_examples", "5"])  # causal_lm: validation.max_packs


# ---------------------------------------------------------------------------------------------------------------
# noising and loss


def _packs():
    """An EOS-padded pack (prompt 4, answer 3, padding 5) and a pack of two examples plus trailing padding."""
    a_tok = np.array([1, 40, 41, 42, 60, 61, 2, 2, 2, 2, 2, 2], dtype=np.int32)
    a_mask = np.array([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=np.uint8)
    b_tok = np.array([1, 43, 44, 62, 63, 1, 45, 64, 65, 66, 0, 0], dtype=np.int32)
    b_mask = np.array([0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 0, 0], dtype=np.uint8)
    return [(a_tok, a_mask, np.array([12]), np.array([3])), (b_tok, b_mask, np.array([5, 5]), np.array([2, 3]))]


def _expected_loss(model, packs, keys, cfg, mb):
    """The loss by hand: per example draw t and the mask again, CE from the full logits, then normalise."""
    from titan_sft.objectives.masked_diffusion import noise_rng

    o = cfg.objective
    logits = model(mb.input_ids, cu_seqlens=mb.cu_seqlens).double()
    terms = []  # (t, ce of masked answer positions, ce of masked padding positions, n_answer, n_padding)
    for p, ((tok, mask, doc_lens, ans_lens), key) in enumerate(zip(packs, keys)):
        start = 0
        for d, n in enumerate(doc_lens):
            sup = [i for i in range(start, start + n) if mask[i]]
            if not o.eos_padding_loss:  # the reference's default: the answer alone; its padding stays clean
                assert all(mb.input_ids[p, i].item() == tok[i] for i in sup[ans_lens[d]:])
                sup = sup[: ans_lens[d]]
            rng = noise_rng(cfg.job.seed, 0, key, d)
            t = o.t_min + (1 - o.t_min) * rng.random()
            hit = rng.random(len(sup)) < t
            ce_a, ce_p = [], []
            for j, (i, h) in enumerate(zip(sup, hit)):
                assert (mb.input_ids[p, i].item() == MASK) == bool(h)
                if h:
                    ce = F.cross_entropy(logits[p, i][None], torch.tensor([int(tok[i])])).item()
                    (ce_p if j >= ans_lens[d] else ce_a).append(ce)
            terms.append((t, ce_a, ce_p, int(ans_lens[d]), len(sup) - int(ans_lens[d])))
            start += n
    E = len(terms)
    if o.normalization == "per_example" and not o.split_loss:
        return sum((sum(a) + sum(b)) / (t * (na + npad)) for t, a, b, na, npad in terms) / E
    if o.normalization == "per_example":
        return sum(o.answer_weight * sum(a) / (t * na) + (o.padding_weight * sum(b) / (t * npad) if npad else 0.0)
                   for t, a, b, na, npad in terms) / E
    if not o.split_loss:
        return sum((sum(a) + sum(b)) / t for t, a, b, _, _ in terms) / sum(na + npad for _, _, _, na, npad in terms)
    n_a, n_p = sum(x[3] for x in terms), sum(x[4] for x in terms)
    return (o.answer_weight * sum(sum(a) / t for t, a, _, _, _ in terms) / n_a
            + o.padding_weight * sum(sum(b) / t for t, _, b, _, _ in terms) / n_p)


PAD = ["--objective.eos_padding_loss", "true"]


@pytest.mark.parametrize("overrides", [
    [],  # the reference's default: per example, 1/t, the answer with its one end-of-turn token; padding unsupervised
    PAD,  # LLaDA with EOS padding: per example, 1/t, answer + padding
    [*PAD, "--objective.split_loss", "true", "--objective.answer_weight", "0.7", "--objective.padding_weight", "0.3"],
    ["--objective.normalization", "per_token"],
    [*PAD, "--objective.normalization", "per_token"],
    [*PAD, "--objective.normalization", "per_token", "--objective.split_loss", "true"],
])
def test_loss_equals_hand_computation(one_rank_group, overrides):
    from titan_sft.data.loader import StepBatch
    from titan_sft.objectives.masked_diffusion import MaskedDiffusion

    cfg = load_config(None, ["--objective.name", "masked_diffusion", "--objective.t_min", "0.3",
                             "--training.loss_chunk_size", "3", *overrides])
    obj = MaskedDiffusion(cfg)
    obj.mask_id = MASK
    packs, keys = _packs(), [7, 8]
    mb = obj.collate(packs, [0, 0], keys)
    model = _model()
    obj.begin_step(StepBatch(0, np.arange(2), [mb]), None, first=True)
    got = obj.loss(model, mb).item()
    assert got == pytest.approx(_expected_loss(model, packs, keys, cfg, mb), rel=1e-5)
    assert obj.step_metrics()["n_examples"] == 3
    if not cfg.objective.split_loss:
        assert obj.step_sums() == []
        return
    # The component losses of the train record: they add up to the loss, and the answer part is the hand
    # computation's answer term (its padding weight set to 0).
    answer, padding = (x.item() for x in obj.step_sums())
    assert answer + padding == pytest.approx(got, rel=1e-6) and padding > 0
    cfg.objective.padding_weight = 0.0
    assert answer == pytest.approx(_expected_loss(model, packs, keys, cfg, mb), rel=1e-5)
    assert obj.step_metrics([answer, padding])["loss_answer"] == answer


def test_reference_config_first_step_loss_is_the_reference_default_loss(one_rank_group):
    """train_configs/qwen3_8b_diffusion_lora_reference.toml on the debug data (EOS-padded, the debug model): the
    first step's loss over its 8 examples (the sampler's first global batch, keys 0..7) is the reference's default
    loss by hand: per example, 1/t-weighted CE at the masked positions of the answer and its one end-of-turn token,
    over that answer length, mean over examples; the padding is neither noised nor supervised."""
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.loader import StepBatch
    from titan_sft.data.sampler import RecipeSampler
    from titan_sft.objectives.masked_diffusion import MaskedDiffusion

    data = ROOT / "titan_sft/assets/debug_data/diffusion/train"
    cfg = load_config(ROOT / "train_configs/qwen3_8b_diffusion_lora_reference.toml",
                      ["--model.flavor", "debug", "--model.init_from_hf", "false", "--data.path", str(data)])
    o, t = cfg.objective, cfg.training
    assert (o.eos_padding_loss, o.split_loss, o.normalization, o.shift) == (False, False, "per_example", False)
    ds = PackedDataset(data)
    assert ds.manifest["eos_pad"]
    B = t.global_batch_size
    ids = RecipeSampler(len(ds), B, 0, 1, cfg.data.shuffle, cfg.data.shuffle_seed,
                        reshuffle=cfg.data.reshuffle_each_epoch).global_indices(0)
    packs, keys = [ds[int(i)] for i in ids], list(range(B))
    for tok, mask, _, ans in packs:  # each answer ends with its one end-of-turn token, then padding
        end = int(np.flatnonzero(mask)[0]) + int(ans[0])
        assert tok[end - 1] == ds.manifest["eos_id"] and (tok[end:] == ds.manifest["eos_id"]).all()
    obj = MaskedDiffusion(cfg)
    obj.mask_id = MASK
    mb = obj.collate(packs, [0] * B, keys)
    model = _model()
    obj.begin_step(StepBatch(0, np.asarray(ids), [mb]), None, first=True)
    got = obj.loss(model, mb).item()
    assert got == pytest.approx(_expected_loss(model, packs, keys, cfg, mb), rel=1e-5)
    assert obj.step_metrics()["n_examples"] == B


def test_prompt_never_masked_and_mask_fraction_tracks_t():
    from titan_sft.objectives.masked_diffusion import collate_diffusion

    L, prompt = 220, 20
    tok = np.arange(L, dtype=np.int32) % 200 + 10
    mask = np.r_[np.zeros(prompt), np.ones(L - prompt)].astype(np.uint8)
    pack = (tok, mask, np.array([L]), np.array([L - prompt]))
    fracs, ts = [], []
    for key in range(0, 1500, 4):
        mb = collate_diffusion([pack] * 4, list(range(key, key + 4)), mask_id=MASK, t_min=0.1, shift=False,
                               split=False, answer_weight=0.9, padding_weight=0.1, per_example=True, seed=0)
        assert torch.equal(mb.input_ids[:, :prompt], torch.from_numpy(tok[:prompt]).long().expand(4, -1))
        masked = (mb.input_ids[:, prompt:] == MASK).double().mean(1)
        # weights are w / t with w = 1 / n_answer: recover t per row from the first masked position
        rows = mb.rows // L
        for r in range(4):
            w = mb.weights[rows == r]
            if len(w):
                ts.append(1.0 / (w[0].item() * (L - prompt)))
                fracs.append(masked[r].item())
    fracs, ts = np.array(fracs), np.array(ts)
    assert ts.min() >= 0.1 and ts.max() <= 1.0
    assert np.abs(fracs - ts).mean() < 0.03  # Binomial(200, t) / 200 is within a few percent of t
    assert np.corrcoef(fracs, ts)[0, 1] > 0.98
    assert abs(fracs.mean() - 0.55) < 0.02  # E[t] for t ~ U(0.1, 1)


def test_mask_token_checks():
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.objectives.masked_diffusion import resolve_mask_token

    from conftest import QWEN_DIR

    tok = load_tokenizer(DEBUG_TOK)
    assert resolve_mask_token(-1, 512, tok) == 280
    assert resolve_mask_token(2, 512, tok) == 2  # a special token is fine
    with pytest.raises(ConfigError, match=r"objective.mask_token_id': 600 is outside the embedding table"):
        resolve_mask_token(600, 512, tok)
    with pytest.raises(ConfigError, match=r"objective.mask_token_id': 70 is the text token"):
        resolve_mask_token(70, 512, tok)
    assert resolve_mask_token(-1, 151936, load_tokenizer(QWEN_DIR)) == 151669  # Qwen3: a reserved row

    class Full:  # Llama 3 fills its table; its reserved special tokens are the candidates
        added_tokens_decoder = {128000: "<|begin_of_text|>", 128250: "<|reserved_special_token_242|>",
                                128255: "<|reserved_special_token_247|>"}

        def __len__(self):
            return 128256

    assert resolve_mask_token(-1, 128256, Full()) == 128255
    with pytest.raises(ConfigError, match="objective.padding_weight"):
        load_config(None, ["--objective.split_loss", "true", "--objective.padding_weight", "0.5"])
    with pytest.raises(ConfigError, match="objective.answer_weight"):
        load_config(None, ["--objective.answer_weight", "nan"])


# ---------------------------------------------------------------------------------------------------------------
# attention


def test_bidirectional_within_documents():
    model = _model(causal=False).double()
    ids = torch.randint(3, 250, (1, 16))
    cu = torch.tensor([0, 9, 16], dtype=torch.int32)  # two documents
    base = model(ids, cu_seqlens=cu)
    later = ids.clone()
    later[0, 7] = 251  # a later token of document 1
    out = model(later, cu_seqlens=cu)
    assert (out[0, 2] - base[0, 2]).abs().max() > 1e-6  # an earlier position sees it
    assert torch.equal(out[0, 9:], base[0, 9:])  # document 2 does not
    first = ids.clone()
    first[0, 12] = 251  # a token of document 2
    assert torch.equal(model(first, cu_seqlens=cu)[0, :9], base[0, :9])  # document 1 does not see it
    causal = _model(causal=True).double()
    assert torch.equal(causal(later, cu_seqlens=cu)[0, :7], causal(ids, cu_seqlens=cu)[0, :7])


def test_whole_row_logits_pad_rows_for_sequence_parallel_without_changing_them():
    """Generation and scoring under tensor parallel pad each row to a multiple of tp with a separate filler
    document: the row's logits equal the unpadded ones (bidirectional and causal, two rows), and a row that
    already splits evenly is passed as is."""
    from titan_sft.diffusion_sampler import whole_row_logits

    ids = torch.randint(3, 250, (2, 13))
    for causal in (False, True):
        model = _model(causal=causal).double()
        ref = model(ids)
        for multiple in (2, 4, 13):
            out = whole_row_logits(model, ids, multiple)
            assert out.shape == ref.shape and torch.allclose(out, ref, rtol=0, atol=1e-12), (causal, multiple)


# ---------------------------------------------------------------------------------------------------------------
# sampler


def test_sampler_schedule_blocks_determinism_and_eos():
    from titan_sft.diffusion_sampler import generate, reveal_schedule

    assert reveal_schedule(10, 4) == [3, 3, 2, 2] and reveal_schedule(8, 4) == [2, 2, 2, 2]
    model = _model(causal=False).eval()
    prompt = torch.tensor([1, 40, 41, 42, 43, 2, 1, 44])
    kw = dict(mask_id=MASK, gen_length=12, block_length=6, steps=8)
    trace = []
    out = generate(lambda x: model(x), prompt, **kw, trace=trace)
    assert len(out) == 12 and (out != MASK).all()
    lp = len(prompt)
    for step, picked in trace:
        block = step // 4  # 8 steps over 2 blocks
        assert len(picked) == reveal_schedule(6, 4)[step % 4]
        assert all(lp + 6 * block <= p < lp + 6 * (block + 1) for p in picked)  # never a later block early
    assert sorted(p for _, ps in trace for p in ps) == list(range(lp, lp + 12))
    assert torch.equal(out, generate(lambda x: model(x), prompt, **kw, seed=5))  # temperature 0: deterministic
    hot = dict(kw, temperature=1.0)
    a = generate(lambda x: model(x), prompt, **hot, seed=1)
    assert torch.equal(a, generate(lambda x: model(x), prompt, **hot, seed=1))  # seeded
    assert any(not torch.equal(a, generate(lambda x: model(x), prompt, **hot, seed=s)) for s in range(2, 6))
    rnd = generate(lambda x: model(x), prompt, **kw, remasking="random", trace=(tr := []))
    assert len(rnd) == 12 and [len(p) for _, p in tr] == [len(p) for _, p in trace]

    eos = 2

    def loves_eos(x):
        logits = torch.zeros(x.shape[0], x.shape[1], 512)
        logits[..., eos] = 10.0
        return logits

    assert (generate(loves_eos, prompt, **kw) == eos).all()
    assert not (generate(loves_eos, prompt, **kw, forbid_ids=[eos]) == eos).any()
    assert not (generate(loves_eos, prompt, **dict(kw, temperature=1.0), forbid_ids=[eos]) == eos).any()
    guided = generate(lambda x: model(x), prompt, **kw, cfg_scale=1.0)
    assert len(guided) == 12 and (guided != MASK).all()

    # late_ids (the reference's confidence_eos_eot_inf): the first half of each block draws EOS with the highest
    # confidence, the second half token 7 with less; EOS positions are then revealed after the others, and kept
    def eos_first_half(x):
        logits = torch.zeros(x.shape[0], x.shape[1], 512)
        first = ((torch.arange(x.shape[1]) - lp) % 6) < 3
        logits[:, first, eos] = 10.0
        logits[:, ~first, 7] = 5.0
        return logits

    for late, order in ((None, "eos first"), ([eos], "eos last")):
        out = generate(eos_first_half, prompt, **kw, late_ids=late, trace=(tr := []))
        assert (out == torch.tensor([eos] * 3 + [7] * 3 + [eos] * 3 + [7] * 3)).all()
        when = {p: step for step, ps in tr for p in ps}  # the step that revealed each position
        for block in range(2):
            eos_steps = [when[lp + 6 * block + j] for j in range(3)]
            other_steps = [when[lp + 6 * block + j] for j in range(3, 6)]
            if order == "eos first":
                assert max(eos_steps) <= min(other_steps), tr
            else:
                assert max(other_steps) <= min(eos_steps) and max(eos_steps) > min(eos_steps), tr


# ---------------------------------------------------------------------------------------------------------------
# LoRA


def _lora_model(rank=4):
    from titan_sft.lora import apply_lora

    cfg = load_config(None, ["--model.converters", "lora", "--lora.rank", str(rank)])
    model = _model()
    apply_lora(model, cfg)
    for m in model.modules():
        if hasattr(m, "reset_converter_parameters"):
            m.reset_converter_parameters(0)
    return model, cfg


def test_lora_trains_only_adapters_and_norms(one_rank_group):
    from titan_sft.data.loader import StepBatch
    from titan_sft.objectives.masked_diffusion import MaskedDiffusion
    from titan_sft.optimizer import build_optimizer

    model, cfg = _lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert torch.equal(model(torch.tensor([[1, 2, 3]])), _model()(torch.tensor([[1, 2, 3]])))  # B = 0: the base
    cfg.optimizer.lr = 1e-2
    opt = build_optimizer(model, cfg.optimizer)
    obj = MaskedDiffusion(dataclasses.replace(cfg, objective=dataclasses.replace(cfg.objective, t_min=0.5)))
    obj.mask_id = MASK
    mb = obj.collate(_packs(), [0, 0], [1, 2])
    for _ in range(2):
        obj.begin_step(StepBatch(0, np.arange(2), [mb]), None, first=False)
        obj.loss(model, mb).backward()
        opt.step()
        opt.zero_grad()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n in before if n.endswith(("lora_a", "lora_b")) or "norm" in n}
    for n, p in model.named_parameters():
        changed = not torch.equal(p, before[n])
        assert changed == (n in trainable), n
    assert {id(p) for p in opt.state} == {id(p) for n, p in model.named_parameters() if n in trainable}


def test_peft_loads_the_adapter_and_merged_export_equals_base_plus_adapter(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from titan_sft.hf_io import export_hf
    from titan_sft.lora import merge_lora

    spec = get_train_spec("qwen3")
    base = _model()
    export_hf(base, base.args, tmp_path / "base", "float32", DEBUG_TOK, spec=spec)
    model, cfg = _lora_model()
    with torch.no_grad():  # a trained-looking adapter and norms
        for n, p in model.named_parameters():
            if n.endswith("lora_b"):
                p.normal_(std=0.05)
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.1)
    export_hf(model, model.args, tmp_path / "merged", "float32", DEBUG_TOK, spec=spec, lora=cfg.lora,
              adapter_dir=tmp_path / "adapter", base_model=str(tmp_path / "base"))
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["base_model_name_or_path"] == str(tmp_path / "base")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32, attn_implementation="sdpa")
    peft_model = PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(3, 280, (2, 20))
    full = torch.ones(2, 1, 20, 20, dtype=torch.bool)  # bidirectional attention mask
    with torch.no_grad():
        ours = model(ids)
        assert (peft_model(input_ids=ids, attention_mask=full).logits - ours).abs().max() < 1e-5
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        assert (merged(input_ids=ids, attention_mask=full).logits - ours).abs().max() < 1e-5
    from safetensors.torch import load_file

    sd = model.state_dict()
    want = merge_lora(sd, cfg.lora.alpha / cfg.lora.rank)["layers.1.attention.wq.weight"]
    a, b = sd["layers.1.attention.wq.lora_a"], sd["layers.1.attention.wq.lora_b"]
    assert torch.allclose(want, sd["layers.1.attention.wq.weight"] + (cfg.lora.alpha / cfg.lora.rank) * b @ a)
    got = load_file(str(tmp_path / "merged" / "model.safetensors"))["model.layers.1.self_attn.q_proj.weight"]
    assert torch.equal(got, want)


# ---------------------------------------------------------------------------------------------------------------
# runs: layouts, resume, best checkpoint and test split, the debug job, generate


def _train(dump, *overrides, nproc=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", "train_configs/debug_diffusion.toml", "--job.dump_folder", str(dump),
           "--metrics.log_freq", "1", *overrides]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(line) for line in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


SHORT = ["--training.steps", "4", "--validation.interval", "2", "--validation.generation_every", "0",
         "--training.per_device_batch", "4", "--checkpoint.interval", "2"]


@pytest.mark.slow
def test_world_size_invariance_and_bit_exact_resume(tmp_path):
    one = _train(tmp_path / "one", *SHORT)
    two = _train(tmp_path / "two", *SHORT, nproc=2)
    train1 = [r for r in one if r["split"] == "train"]
    train2 = [r for r in two if r["split"] == "train"]
    assert len(train1) == 4
    for a, b in zip(train1, train2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
        assert (a["n_loss_tokens"], a["n_examples"]) == (b["n_loss_tokens"], b["n_examples"])  # same masks
    for a, b in zip([r for r in one if r["split"] != "train"], [r for r in two if r["split"] != "train"]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5) and a["n_masked"] == b["n_masked"]
    # Stopped after step 2 and resumed: the same masks and the same numbers, bit for bit.
    _train(tmp_path / "resumed", *SHORT, "--training.stop_at_step", "2")
    resumed = _train(tmp_path / "resumed", *SHORT, "--checkpoint.resume", "auto")
    got = [r for r in resumed if r["split"] == "train"]
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert [(r["loss"], r["grad_norm"], r["n_loss_tokens"]) for r in got] == \
        [(r["loss"], r["grad_norm"], r["n_loss_tokens"]) for r in train1]


@pytest.mark.slow
def test_best_checkpoint_and_test_split(tmp_path):
    records = _train(tmp_path / "run", "--training.steps", "6", "--validation.interval", "2",
                     "--validation.generation_every", "0", "--training.per_device_batch", "8",
                     "--validation.best_only", "true", "--optimizer.lr", "2e-2")
    val = [r for r in records if r["split"] == "validation"]
    test = [r for r in records if r["split"] == "test"]
    assert [r["step"] for r in val] == [2, 4, 6] and len(test) == 1
    best = min(val, key=lambda r: r["loss"])
    running = math.inf
    for r in val:  # flagged exactly when the loss improves
        assert r.get("best", False) == (r["loss"] < running)
        running = min(running, r["loss"])
    meta = json.loads((tmp_path / "run" / "checkpoints-best" / "meta.json").read_text())
    assert meta["step"] == best["step"] and meta["validation_loss"] == best["loss"]
    assert test[0]["weights"] == f"best (step {best['step']})"
    assert json.loads((tmp_path / "run" / "test_metrics.json").read_text()) == test[0]
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))  # best_only: no regular checkpoints
    assert 0.4 < test[0]["mask_fraction"] < 0.7 and test[0]["n_examples"] == 100
    assert (tmp_path / "run" / "objective.json").is_file()
    assert json.loads((tmp_path / "run" / "objective.json").read_text())["mask_token_id"] == MASK


@pytest.mark.slow
def test_debug_diffusion_job_learns_and_generate_cli(tmp_path):
    """The shipped debug job reaches >= 80% exact match on its held-out prompts; generate runs on its outputs."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run(["./run_train.sh", "train_configs/debug_diffusion.toml", "--job.dump_folder",
                        str(tmp_path / "job")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    gen = [x for x in records if x["split"] == "generation"]
    assert len(gen) == 1 and gen[0]["exact_match"] >= 0.8, gen
    assert gen[0]["perplexity_pooled"] > 0 and 0 < gen[0]["distinct_1"] <= 1
    texts = [json.loads(x) for x in (tmp_path / "job" / "generation_metrics.jsonl").read_text().splitlines()]
    assert len(texts) == 100 and {"text", "perplexity", "exact_match", "reference"} <= set(texts[0])
    hf = tmp_path / "job" / "hf" / "step-149"
    adapter = tmp_path / "job" / "adapters" / "step-149"
    assert (hf / "objective.json").is_file() and (adapter / "adapter_config.json").is_file()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(x for x in (ROOT / "titan_sft/assets/debug_data/heldout.jsonl").open()
                               .readlines()[:5]))
    outs = {}
    for name, model in (("hf", hf), ("adapter", adapter), ("checkpoint", tmp_path / "job" / "checkpoints-best")):
        g = subprocess.run([sys.executable, "-m", "titan_sft.generate", "--model", str(model), "--prompts",
                            str(prompts), "--gen-length", "16", "--block-length", "8", "--steps", "16",
                            "--tokenizer", DEBUG_TOK], cwd=ROOT, env=env, capture_output=True, text=True)
        assert g.returncode == 0, g.stderr[-2000:]
        outs[name] = [json.loads(x) for x in g.stdout.splitlines()]
        assert sum(o["text"].strip() == o["reference"] for o in outs[name]) >= 4, outs[name]
    assert [o["text"] for o in outs["hf"]] == [o["text"] for o in outs["adapter"]]


# ---------------------------------------------------------------------------------------------------------------
# operational features carried over from the reference trainer


def test_lr_scaling_8bit_adamw_error_and_run_folder_suffix(tmp_path):
    from titan_sft.checkpoint import run_folder
    from titan_sft.optimizer import build_optimizer, scaled_lr

    o = load_config(None, ["--optimizer.lr", "1e-4", "--optimizer.reference_batch", "16"]).optimizer
    assert scaled_lr(o, 64) == 1e-4
    o.lr_scaling = "sqrt"
    assert scaled_lr(o, 64) == pytest.approx(2e-4)
    o.lr_scaling = "linear"
    assert scaled_lr(o, 64) == pytest.approx(4e-4)
    assert build_optimizer(_model(), o, 64).param_groups[0]["lr"] == pytest.approx(4e-4)
    o.name = "adamw8bit"
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="'adamw8bit' needs bitsandbytes"):
            build_optimizer(_model(), o, 64)
    # An earlier run's folder is never reused unless this run resumes from it.
    run = tmp_path / "run"
    assert run_folder(str(run), "none") == str(run)  # nothing there yet
    run.mkdir()
    (run / "metrics.jsonl").write_text("{}\n")
    assert run_folder(str(run), "none") == f"{run}-1"
    assert run_folder(str(run), "auto") == str(run)  # its home: nothing to resume, so it starts over there
    assert run_folder(str(run), "auto", checkpoint_enabled=False) == f"{run}-1"
    (run / "checkpoints-best").mkdir()
    assert run_folder(str(run), "auto") == f"{run}-1"  # a finished best_only run is kept
    (tmp_path / "run-1").mkdir()
    assert run_folder(str(run), "none") == f"{run}-2"
    ckpt = run / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    (ckpt / ".metadata").write_text("")
    (ckpt / "meta.json").write_text('{"step": 4}')
    assert run_folder(str(run), "auto") == str(run)  # resuming: the same folder


def test_8b_diffusion_recipe_dry_runs():
    cfg = load_config(ROOT / "train_configs" / "qwen3_8b_diffusion_lora.toml", ["--model.init_from_hf", "false"])
    assert (cfg.objective.name, cfg.model.converters, cfg.objective.t_min) == ("masked_diffusion", ["lora"], 0.001)
    env = {**os.environ, "WORLD_SIZE": "8"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/qwen3_8b_diffusion_lora.toml",
                        "--dry-run", "--model.init_from_hf", "false"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "LoRA: rank 64" in r.stdout and "unshifted (LLaDA)" in r.stdout
    # state for the adapters and norms only; the frozen base stored in bf16 (8.19B x 2 bytes / 8 ranks + adapters)
    assert "parameters 1.99 GiB, gradients 0.08 GiB, AdamW state 0.16 GiB" in r.stdout


def test_lora_with_causal_lm(tmp_path):
    """LoRA is a converter of its own: the causal recipe trains adapters too; the frozen embedding is exported
    unchanged and the merged projections differ from the base."""
    from safetensors.torch import load_file

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1", "-m",
           "titan_sft.train", "--config", "train_configs/debug_model.toml", "--job.dump_folder", str(tmp_path / "c"),
           "--model.converters", "lora", "--model.init_from_hf", "true", "--model.hf_assets_path",
           "titan_sft/assets/debug_base", "--training.steps", "3", "--checkpoint.hf_export_interval", "0",
           "--validation.generation_eval_path", ""]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    base = load_file(str(ROOT / "titan_sft/assets/debug_base/model.safetensors"))
    merged = load_file(str(tmp_path / "c" / "hf" / "step-2" / "model.safetensors"))
    assert torch.equal(merged["model.embed_tokens.weight"], base["model.embed_tokens.weight"].float())
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           base["model.layers.0.self_attn.q_proj.weight"].float())
    assert (tmp_path / "c" / "adapters" / "step-2" / "adapter_model.safetensors").is_file()


def test_frozen_base_stored_in_bf16_gives_the_same_numbers(one_rank_group):
    """With bf16 compute, LoRA's frozen base is stored in bf16 (half the memory; FSDP casts fp32 storage to bf16
    for every forward anyway): loss and adapter gradients are bit-identical to fp32 storage."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from titan_sft.config import JobConfig
    from titan_sft.lora import apply_lora
    from titan_sft.parallel.parallelize import apply_fsdp, store_frozen_params

    cfg = JobConfig()
    cfg.model.converters = ["lora"]
    base = _model(causal=True)
    apply_lora(base, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    fp32_store, bf16_store = base, copy.deepcopy(base)
    frozen = sum(p.numel() for p in base.parameters() if not p.requires_grad)
    assert store_frozen_params(bf16_store, torch.bfloat16) == frozen > 0
    mesh = init_device_mesh("cpu", (1,))
    x = torch.randint(0, 280, (2, 24), generator=g)
    results = []
    for m in (fp32_store, bf16_store):
        apply_fsdp(m, mesh, torch.bfloat16, torch.float32)
        loss = m(x).float().logsumexp(-1).mean()
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in m.named_parameters() if p.requires_grad}
        dtypes = {p.to_local().dtype for p in m.parameters() if not p.requires_grad}
        results.append((loss.item(), grads, dtypes))
    (l0, g0, d0), (l1, g1, d1) = results
    assert (d0, d1) == ({torch.float32}, {torch.bfloat16})
    assert l0 == l1 and g0.keys() == g1.keys() and len(g0) > 0
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
