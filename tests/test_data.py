"""Prepare (real Qwen3 tokenizer), dataset invariants, bad rows, collator and sampler."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_sft.data.chat import TEMPLATE_DIR, encoder_for, load_tokenizer
from titan_sft.data.collator import collate
from titan_sft.data.dataset import DatasetError, PackedDataset
from titan_sft.data.prepare import PrepareError, prepare
from titan_sft.data.sampler import RecipeSampler

from conftest import QWEN_DIR

CHATS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6"}],
    [{"role": "user", "content": "why?"},
     {"role": "assistant", "content": "because", "reasoning_content": "let me think\nabout it"}],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "<think>\nold thoughts\n</think>\n\nanswer one"},
     {"role": "user", "content": "q2"}, {"role": "assistant", "content": "<think>inline</think>answer two"}],
    [{"role": "user", "content": "Grüße, 你好 🙂"}, {"role": "assistant", "content": "Привет — こんにちは ✓"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "\n\nleading newlines"}],
]


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(QWEN_DIR)


def test_marked_template_renders_stock_text(qwen):
    enc, resolved = encoder_for(qwen)
    assert "shipped qwen3_marked.jinja" in resolved.source
    for chat in CHATS:
        stock = qwen.apply_chat_template(chat, tokenize=False)
        texts, _ = enc.render([chat])
        assert texts[0] == stock


def test_ids_equal_apply_chat_template_and_masks_cover_assistant_turns(qwen):
    enc, _ = encoder_for(qwen)
    im_start, im_end = qwen.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    for chat, (ids, mask) in zip(CHATS, enc.encode(CHATS)):
        ref = qwen.apply_chat_template(chat, tokenize=True)
        ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
        assert ids.tolist() == list(ref)
        # Reconstruct the masked text: exactly the assistant bodies, each ending in <|im_end|>\n.
        runs, cur = [], []
        for t, m in zip(ids.tolist(), mask.tolist()):
            if m:
                cur.append(t)
            elif cur:
                runs.append(cur); cur = []
        if cur:
            runs.append(cur)
        n_assist = sum(m["role"] == "assistant" for m in chat)
        assert len(runs) == n_assist
        for run in runs:
            assert run[-2:] == [im_end, qwen.convert_tokens_to_ids("Ċ")]
            assert im_start not in run
        text = qwen.decode([t for t, m in zip(ids, mask) if m])
        assert "user" not in text.replace("because", "") or chat is CHATS[0]
        for m in chat:
            if m["role"] != "assistant":
                assert m["content"] not in qwen.decode([t for t, k in zip(ids, mask) if k]) or m["content"] in ("a",)
    # reasoning_content and the last turn's think block are inside the mask
    ids, mask = enc.encode([CHATS[2]])[0]
    assert "<think>\nlet me think\nabout it\n</think>\n\nbecause<|im_end|>\n" == qwen.decode(ids[mask == 1])
    # an earlier turn's think block is dropped by the template; the final one is kept
    ids, mask = enc.encode([CHATS[3]])[0]
    assert qwen.decode(ids[mask == 1]) == "answer one<|im_end|>\n<think>\ninline\n</think>\n\nanswer two<|im_end|>\n"


def write_jsonl(path, chats, gz=False):
    data = "".join(json.dumps({"messages": c}, ensure_ascii=False) + "\n" for c in chats)
    if gz:
        with gzip.open(path, "wt") as f:
            f.write(data)
    else:
        Path(path).write_text(data)
    return path


def many_chats(n, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join(["word"] * int(rng.integers(1, 60)))
        out.append([{"role": "user", "content": f"q{i} {words}"}, {"role": "assistant", "content": f"a{i} " + words[: int(rng.integers(1, 200))]}])
    return out


@pytest.mark.parametrize("packing", ["greedy", "bfd"])
def test_written_dataset_invariants(tmp_path, qwen, packing):
    chats = many_chats(120)
    src = write_jsonl(tmp_path / "a.jsonl.gz", chats, gz=True)
    m = prepare([str(src)], str(QWEN_DIR), 256, str(tmp_path / "out"), packing=packing, workers=2, progress=False)
    ds = PackedDataset(tmp_path / "out")
    assert len(ds) == m["n_packs"] and ds.doc_lens.sum() == m["n_tokens"]
    enc, _ = encoder_for(qwen)
    expected = enc.encode(chats)
    assert m["n_documents"] == len(chats)
    d = 0
    seen = []
    for p in range(len(ds)):
        tokens, mask, lens = ds[p]
        assert lens.sum() <= 256 and len(lens) <= 64
        assert ds.assistant_counts[p] == mask[1:].sum()
        pos = 0
        for n in lens:
            # every document is one whole conversation, inside one pack
            match = [k for k, (ids, _) in enumerate(expected) if len(ids) == n and np.array_equal(ids, tokens[pos:pos + n])]
            assert match
            seen.append(match[0])
            pos += n
        assert (tokens[pos:] == qwen.pad_token_id).all() and not mask[pos:].any()
    assert sorted(seen) == list(range(len(chats)))
    if packing == "greedy":
        assert seen == list(range(len(chats)))  # input order kept
    greedy_packs = prepare([str(src)], str(QWEN_DIR), 256, str(tmp_path / "g"), workers=1, progress=False)["n_packs"]
    assert m["n_packs"] <= greedy_packs


def test_byte_identical_across_worker_counts(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", many_chats(600))
    prepare([str(src)], str(QWEN_DIR), 512, str(tmp_path / "w1"), workers=1, progress=False)
    prepare([str(src)], str(QWEN_DIR), 512, str(tmp_path / "w2"), workers=2, progress=False)
    for name in PackedDataset.FILES + ("manifest.json",):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_overlength_truncate_and_drop(tmp_path):
    long = [{"role": "user", "content": "x " * 10}, {"role": "assistant", "content": "y " * 300}]
    short_user_long = [{"role": "user", "content": "z " * 400}, {"role": "assistant", "content": "ok"}]
    src = write_jsonl(tmp_path / "a.jsonl", [CHATS[0], long, short_user_long])
    m = prepare([str(src)], str(QWEN_DIR), 128, str(tmp_path / "t"), progress=False)
    assert m["overlength"]["truncated"] == 1 and m["overlength"]["dropped_no_loss_after_truncation"] == 1
    ds = PackedDataset(tmp_path / "t")
    assert m["n_documents"] == 2 and list(ds.doc_lens)[1] == 128
    m = prepare([str(src)], str(QWEN_DIR), 128, str(tmp_path / "d"), overlength="drop", progress=False)
    assert m["overlength"]["dropped"] == 2 and m["n_documents"] == 1


BAD = [
    ("not json at all", "not JSON"),
    (json.dumps({"msgs": []}), "no 'messages'"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "unknown role 'robot'"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}]}), "no assistant turn"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "  "}]}), "empty content"),
]


@pytest.mark.parametrize("line,reason", BAD)
def test_bad_rows_report_file_line(tmp_path, line, reason):
    good = json.dumps({"messages": CHATS[0]})
    src = tmp_path / "in.jsonl"
    src.write_text(good + "\n" + good + "\n" + line + "\n")
    with pytest.raises(PrepareError, match=rf"in.jsonl:3: .*{reason}"):
        prepare([str(src)], str(QWEN_DIR), 64, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]
    m = prepare([str(src)], str(QWEN_DIR), 64, str(tmp_path / "out"), on_bad_row="skip", progress=False)
    assert m["bad_rows"]["skipped"] == 1 and m["n_documents"] == 2


def test_template_and_seq_len_errors(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", CHATS[:1])
    with pytest.raises(PrepareError, match="at least 2"):
        prepare([str(src)], str(QWEN_DIR), 1, str(tmp_path / "o"), progress=False)
    plain = tmp_path / "plain.jinja"
    plain.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(PrepareError, match="--chat-template"):
        prepare([str(src)], str(QWEN_DIR), 64, str(tmp_path / "o"), chat_template=str(plain), progress=False)
    marked = TEMPLATE_DIR / "qwen3_marked.jinja"
    m = prepare([str(src)], str(QWEN_DIR), 64, str(tmp_path / "o"), chat_template=str(marked), progress=False)
    assert m["n_documents"] == 1
    assert not (tmp_path / "o2").exists()


def test_reader_rejects_inconsistent_files(tmp_path):
    src = write_jsonl(tmp_path / "a.jsonl", many_chats(20))
    prepare([str(src)], str(QWEN_DIR), 256, str(tmp_path / "ds"), progress=False)
    PackedDataset(tmp_path / "ds")
    f = tmp_path / "ds" / "assistant_counts.npy"
    good = f.read_bytes()
    f.write_bytes(good[:-8])
    with pytest.raises(DatasetError, match="assistant_counts.npy"):
        PackedDataset(tmp_path / "ds")
    f.write_bytes(good)
    man = json.loads((tmp_path / "ds" / "manifest.json").read_text())
    (tmp_path / "ds" / "manifest.json").write_text(json.dumps({**man, "n_packs": man["n_packs"] + 1}))
    with pytest.raises(DatasetError, match="tokens.npy"):
        PackedDataset(tmp_path / "ds")


def test_collator_hand_worked_example():
    # one pack of L=8: doc A (3 tokens), doc B (4 tokens), 1 padding
    tokens = np.array([10, 11, 12, 20, 21, 22, 23, 0], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 0, 1, 1, 0], dtype=np.uint8)
    # a second pack: doc C (4 tokens), 4 padding
    pack2 = (np.array([30, 31, 32, 33, 0, 0, 0, 0], dtype=np.int32), np.array([0, 0, 1, 1, 0, 0, 0, 0], dtype=np.uint8),
             np.array([4]))
    mb = collate([(tokens, mask, np.array([3, 4])), pack2], groups=[0, 1])
    assert mb.input_ids.tolist() == [[10, 11, 12, 20, 21, 22, 23, 0], [30, 31, 32, 33, 0, 0, 0, 0]]
    assert mb.labels.tolist() == [[11, 12, -100, -100, 22, 23, -100, -100], [-100, 32, 33, -100, -100, -100, -100, -100]]
    assert mb.cu_seqlens.tolist() == [0, 3, 7, 8, 12, 16]  # over the flattened rows; row ends are boundaries
    assert mb.positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert mb.groups.tolist() == [[0] * 8, [1] * 8]
    assert mb.n_loss_tokens == 6 and mb.max_seqlen == 4
    mb = collate([(tokens, mask, np.array([3, 4])), pack2], groups=[0, 0], reset_positions=True)
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 0, 1, 2, 3]]


def test_sampler_recipe_order_sharding_and_resume():
    s = RecipeSampler(n_packs=10, global_batch=4)
    got = [s.next()[1].tolist() for _ in range(4)]
    assert got == [[(k * 4 + i) % 10 for i in range(4)] for k in range(4)]
    assert got[2] == [8, 9, 0, 1]  # wraparound
    r0, r1 = RecipeSampler(10, 4, 0, 2), RecipeSampler(10, 4, 1, 2)
    for k in range(5):
        _, g0, p0 = r0.next()
        _, g1, p1 = r1.next()
        assert g0[p0].tolist() + g1[p1].tolist() == s.global_indices(k).tolist()
    state = r0.state_dict()
    fresh = RecipeSampler(10, 4, 0, 2)
    fresh.load_state_dict(state)
    assert fresh.next()[1].tolist() == r0.next()[1].tolist()
    a, b = RecipeSampler(10, 4, shuffle=True, seed=3), RecipeSampler(10, 4, shuffle=True, seed=3)
    assert a.global_indices(7).tolist() == b.global_indices(7).tolist()
    assert sorted(np.concatenate([a.global_indices(k) for k in range(5)]).tolist()) == sorted(list(range(10)) * 2)
    with pytest.raises(ValueError, match="global_batch_size"):
        RecipeSampler(10, 5, 0, 2)


def test_llama3_marked_template_masks_assistant_content_and_eot():
    from transformers.utils.chat_template_utils import render_jinja_template

    template = (TEMPLATE_DIR / "llama3_marked.jinja").read_text()
    chat = [{"role": "system", "content": "S"}, {"role": "user", "content": " hi "},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a2\n"}]
    texts, spans = render_jinja_template(conversations=[chat], chat_template=template,
                                         return_assistant_tokens_mask=True, bos_token="<|begin_of_text|>")
    h = lambda r: f"<|start_header_id|>{r}<|end_header_id|>\n\n"  # noqa: E731
    assert texts[0] == ("<|begin_of_text|>" + h("system") + "S<|eot_id|>" + h("user") + "hi<|eot_id|>"
                        + h("assistant") + "yo<|eot_id|>" + h("user") + "q<|eot_id|>" + h("assistant") + "a2<|eot_id|>")
    assert [texts[0][s:e] for s, e in spans[0]] == ["yo<|eot_id|>", "a2<|eot_id|>"]


def test_batch_loader_prefetches_the_recipe_order(tmp_path):
    from titan_sft.data.loader import BatchLoader

    ds = PackedDataset("titan_sft/assets/debug_data/packed")
    sampler = RecipeSampler(len(ds), 4, dp_rank=1, dp_world=2)
    loader = BatchLoader(ds, sampler, per_device_batch=1, loss_groups=2)
    first = len(ds) // 4 - 1
    loader.start(first_step=first)
    try:
        for step in range(first, first + 4):  # crosses the wraparound at n_packs
            got = loader.next()
            assert got.step == step
            ids = sampler.global_indices(step)
            assert got.global_ids.tolist() == ids.tolist()
            want = [collate([ds[int(ids[i])]], [i // 2]) for i in (2, 3)]  # rank 1 of 2: positions 2, 3 = group 1
            for a, b in zip(got.microbatches, want):
                assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
                assert a.groups.unique().tolist() == [1]
    finally:
        loader.close()
    bad = BatchLoader(ds, RecipeSampler(len(ds), 4), per_device_batch=1, loss_groups=2)
    bad.dataset = None
    bad.start(0)
    with pytest.raises(TypeError):
        bad.next()
    bad.close()


def test_python_qwen3_renderer_equals_the_stock_template(qwen):
    import random

    from transformers.utils.chat_template_utils import render_jinja_template

    from titan_sft.data.chat import render_qwen3

    rng = random.Random(0)
    pieces = ["hi", "\n\nlead", "trail\n\n", "<think>t1</think>ans", "<think>\nx\n</think>\n\ny", "a</think>b",
              "<tool_response>r</tool_response>", "ünï 🙂", "  spaced  "]
    for _ in range(300):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": rng.choice(pieces)})
        for _ in range(rng.randint(1, 4)):
            msgs.append({"role": rng.choice(["user", "user", "system"]), "content": rng.choice(pieces)})
            m = {"role": "assistant", "content": rng.choice(pieces)}
            if rng.random() < 0.3:
                m[rng.choice(["reasoning_content", "reasoning"])] = rng.choice(pieces)
            msgs.append(m)
        stock, _ = render_jinja_template(conversations=[msgs], chat_template=qwen.chat_template)
        marked, spans = render_jinja_template(conversations=[msgs], chat_template=(TEMPLATE_DIR / "qwen3_marked.jinja").read_text(),
                                              return_assistant_tokens_mask=True)
        text, mine = render_qwen3(msgs)
        assert text == stock[0] == marked[0], msgs
        assert [tuple(s) for s in spans[0]] == mine, msgs
