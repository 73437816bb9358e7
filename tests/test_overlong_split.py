"""Over-long conversations split at assistant turns (issue 23, item 4): every document fits, every assistant turn
is trained in exactly one document, and each document's context stays within the history budget."""

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEBUG_TOK = str(ROOT / "titan_sft/assets/debug_tokenizer")


def _long_chat(n_turns, seed):
    rng = np.random.default_rng(seed)
    msgs = [{"role": "system", "content": "be exact"}]
    answers = []
    for t in range(n_turns):
        word = "".join(rng.choice(list("abcdefgh"), size=int(rng.integers(3, 9))))
        msgs += [{"role": "user", "content": f"upper: {word}"}, {"role": "assistant", "content": f"{word.upper()} #{t}"}]
        answers.append(f"{word.upper()} #{t}")
    return {"messages": msgs}, answers


def _masked_runs(tok, ids, mask):
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append(tok.decode(ids[start:i]))
            start = None
    return runs


@pytest.mark.parametrize("history", [-1, 1])
def test_split_documents_fit_keep_every_turn_once_and_their_history_budget(tmp_path, history):
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare import prepare

    rows = [_long_chat(12, 0), _long_chat(2, 1)]  # one over-long (364 tokens), one short (~80)
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r, _ in rows))
    seq_len = 96
    m = prepare([str(src)], DEBUG_TOK, seq_len, str(tmp_path / "out"), overlength="split", split_history=history,
                workers=1, progress=False, packing="greedy", max_docs_per_pack=1)
    assert m["overlength"]["split"] == 1 and m["overlength"]["truncated"] == 0
    ds = PackedDataset(tmp_path / "out")
    tok = load_tokenizer(DEBUG_TOK)
    assert m["n_documents"] == m["overlength"]["split_documents"] + 1 == len(ds)
    trained = []
    for p in range(len(ds)):
        tokens, mask, doc_lens = ds[p]
        n = int(doc_lens[0])
        assert n <= seq_len
        ids, amask = tokens[:n], mask[:n]
        text = tok.decode(ids)
        runs = _masked_runs(tok, ids, amask)
        trained += [a for a in rows[0][1] + rows[1][1] for r in runs if a in r]
        context_turns = text.count("<|im_start|>assistant") - len(runs)
        assert context_turns >= 0 and (history < 0 or context_turns <= history)
        assert text.startswith("<|im_start|>system\nbe exact")  # the system message leads every piece
        if p > 0 and history != 0 and p < m["overlength"]["split_documents"]:
            assert context_turns >= 1  # later pieces carry earlier turns as context
    assert sorted(trained) == sorted(rows[0][1] + rows[1][1])  # every assistant turn exactly once


def test_sharded_prepare_output_reads_identically_to_unsharded(tmp_path):
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.data.prepare import prepare

    src = tmp_path / "rows.jsonl"
    src.write_text("\n".join((ROOT / "titan_sft/assets/debug_data/train.jsonl").read_text().splitlines()[:700]))
    one = prepare([str(src)], DEBUG_TOK, 128, str(tmp_path / "one"), workers=1, progress=False)
    many = prepare([str(src)], DEBUG_TOK, 128, str(tmp_path / "many"), workers=2, progress=False, shard_packs=37)
    assert len(many["shards"]) == -(-one["n_packs"] // 37) and (tmp_path / "many" / "shard-00000" / "tokens.npy").is_file()
    a, b = PackedDataset(tmp_path / "one"), PackedDataset(tmp_path / "many")
    assert len(a) == len(b) == one["n_packs"]
    for i in range(len(a)):
        for x, y in zip(a[i], b[i]):
            assert np.array_equal(x, y), i
    for attr in ("doc_lens", "pack_offsets", "assistant_counts", "used"):
        assert np.array_equal(getattr(a, attr), getattr(b, attr)), attr
    assert a.describe_sources([0, len(a) - 1]) == b.describe_sources([0, len(b) - 1])
