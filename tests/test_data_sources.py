"""Inputs from the datasets library, the prepared-data cache and the tokenizer check (issue 19, item 5).

The same rows as JSON Lines, as a parquet directory, as a saved dataset and as a hub dataset found in the datasets
cache prepare to byte-identical arrays; split expressions select the rows ``datasets`` says they do; a cache hit
tokenizes nothing and a template change misses; a dataset from another tokenizer stops training with one line.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_sft.data.prepare import PrepareError, prepare
from titan_sft.data.prepare_diffusion import prepare_diffusion

datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parent.parent
DEBUG_TOK = str(ROOT / "titan_sft/assets/debug_tokenizer")
ARRAYS = ("tokens.npy", "assistant_mask.npy", "doc_lens.npy", "pack_offsets.npy", "assistant_counts.npy",
          "doc_sources.npy")


def _rows(n=40):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, 50, 2))
        row = {"messages": [{"role": "user", "content": f"what is {a} plus {b}?"},
                            {"role": "assistant", "content": f"{a + b}"}]}
        if i % 3 == 0:  # a field only some rows have: Arrow fills it with null elsewhere, which must not leak
            row["messages"].insert(0, {"role": "system", "content": "be brief"})
            row["id"] = f"row-{i}"
        out.append(row)
    return out


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _same_arrays(a, b):
    for name in ARRAYS:
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))


def test_parquet_directory_and_saved_dataset_prepare_like_the_same_jsonl(tmp_path):
    rows = _rows()
    ds = datasets.Dataset.from_list(rows)
    (tmp_path / "pq").mkdir()
    ds.select(range(25)).to_parquet(str(tmp_path / "pq" / "part-0.parquet"))
    ds.select(range(25, 40)).to_parquet(str(tmp_path / "pq" / "part-1.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    jsonl = _jsonl(tmp_path / "rows.jsonl", rows)

    prepare([str(jsonl)], DEBUG_TOK, 64, str(tmp_path / "from_jsonl"), workers=1, progress=False)
    m = prepare([str(tmp_path / "pq")], DEBUG_TOK, 64, str(tmp_path / "from_pq"), workers=2, progress=False)
    prepare([str(tmp_path / "saved")], DEBUG_TOK, 64, str(tmp_path / "from_saved"), workers=1, progress=False)
    _same_arrays(tmp_path / "from_jsonl", tmp_path / "from_pq")
    _same_arrays(tmp_path / "from_jsonl", tmp_path / "from_saved")
    assert m["n_documents"] == 40 and m["input_files"] == [str(tmp_path / "pq")]

    # Split expressions select what datasets says they select: the first 8 rows; the last 90%.
    prepare([f"{tmp_path / 'pq'}@train[:8]"], DEBUG_TOK, 64, str(tmp_path / "pq8"), workers=1, progress=False)
    prepare([str(_jsonl(tmp_path / "first8.jsonl", rows[:8]))], DEBUG_TOK, 64, str(tmp_path / "j8"), workers=1,
            progress=False)
    _same_arrays(tmp_path / "pq8", tmp_path / "j8")
    prepare([f"{tmp_path / 'saved'}@train[10%:]"], DEBUG_TOK, 64, str(tmp_path / "s90"), workers=1, progress=False)
    prepare([str(_jsonl(tmp_path / "last.jsonl", rows[4:]))], DEBUG_TOK, 64, str(tmp_path / "j90"), workers=1,
            progress=False)
    _same_arrays(tmp_path / "s90", tmp_path / "j90")

    with pytest.raises(PrepareError, match="split expression"):
        prepare([f"{jsonl}@train[:2]"], DEBUG_TOK, 64, str(tmp_path / "x"), progress=False)
    with pytest.raises(PrepareError, match="nosuch"):
        prepare([f"{tmp_path / 'saved'}@nosuch"], DEBUG_TOK, 64, str(tmp_path / "x"), progress=False)


def test_prepare_diffusion_reads_a_saved_dataset_dict_with_splits_and_workers(tmp_path):
    rows = _rows(60)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:50]),
                          "test": datasets.Dataset.from_list(rows[50:])}).save_to_disk(str(tmp_path / "dd"))
    train, test = _jsonl(tmp_path / "train.jsonl", rows[:50]), _jsonl(tmp_path / "test.jsonl", rows[50:])
    common = dict(eos_pad=True, validation_size=5, split_seed=3)
    prepare_diffusion([str(train)], DEBUG_TOK, 48, str(tmp_path / "j"), test=[str(test)], **common)
    m = prepare_diffusion([f"{tmp_path / 'dd'}@train"], DEBUG_TOK, 48, str(tmp_path / "d"),
                          test=[f"{tmp_path / 'dd'}@test"], workers=2, **common)
    for split in ("train", "validation", "test"):
        _same_arrays(tmp_path / "j" / split, tmp_path / "d" / split)
        assert (tmp_path / "j" / split / "answer_lens.npy").read_bytes() == \
            (tmp_path / "d" / split / "answer_lens.npy").read_bytes()
    assert m["splits"]["test"]["rows"] == 10 and m["input_files"] == [f"{tmp_path / 'dd'}@train",
                                                                      f"{tmp_path / 'dd'}@test"]
    # A sample limit keeps the first rows.
    m = prepare_diffusion([str(train)], DEBUG_TOK, 48, str(tmp_path / "lim"), eos_pad=True, max_rows=7)
    assert m["splits"]["train"]["rows"] == 7


def test_a_hub_dataset_is_read_from_the_datasets_cache_offline(tmp_path):
    rows = _rows(20)
    pq = tmp_path / "pq"
    pq.mkdir()
    datasets.Dataset.from_list(rows).to_parquet(str(pq / "part-0.parquet"))
    cache = tmp_path / "hf" / "datasets"
    # What load_dataset("acme/chat") leaves in the cache: datasets' parquet build, filed under the repo's name.
    datasets.load_dataset("parquet", data_files=[str(pq / "part-0.parquet")], cache_dir=str(cache))
    built = next((cache / "parquet").glob("*/*/*/dataset_info.json")).parent
    entry = cache / "acme___chat" / "default" / "0.0.0" / "0123abcd"
    shutil.copytree(built, entry)
    (entry / "parquet-train.arrow").rename(entry / "chat-train.arrow")
    info = json.loads((entry / "dataset_info.json").read_text())
    (entry / "dataset_info.json").write_text(json.dumps({**info, "config_name": "default"}))

    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.data.prepare", "--input", "acme/chat@train[:12]",
                        "--tokenizer", DEBUG_TOK, "--seq-len", "64", "--out", str(tmp_path / "hub"), "--workers", "1",
                        "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    prepare([str(_jsonl(tmp_path / "r.jsonl", rows[:12]))], DEBUG_TOK, 64, str(tmp_path / "j"), workers=1,
            progress=False)
    _same_arrays(tmp_path / "hub", tmp_path / "j")


def test_the_cache_is_reused_and_a_template_change_misses_it(tmp_path, monkeypatch):
    from titan_sft.data import chat

    src = _jsonl(tmp_path / "rows.jsonl", _rows())
    calls = []
    real = chat.ChatEncoder.encode
    monkeypatch.setattr(chat.ChatEncoder, "encode", lambda self, c: calls.append(len(c)) or real(self, c))
    cache = tmp_path / "cache"
    prepare([str(src)], DEBUG_TOK, 64, str(tmp_path / "a"), workers=1, progress=False, cache_dir=str(cache))
    assert calls and len(list(cache.iterdir())) == 1
    calls.clear()
    prepare([str(src)], DEBUG_TOK, 64, str(tmp_path / "b"), workers=1, progress=False, cache_dir=str(cache))
    assert calls == []  # a hit: nothing rendered or tokenized
    _same_arrays(tmp_path / "a", tmp_path / "b")
    assert json.loads((tmp_path / "b" / "manifest.json").read_text()) == \
        json.loads((tmp_path / "a" / "manifest.json").read_text())

    template = chat.load_tokenizer(DEBUG_TOK).chat_template
    (tmp_path / "t.jinja").write_text(template + "{# changed #}")
    prepare([str(src)], DEBUG_TOK, 64, str(tmp_path / "c"), workers=1, progress=False, cache_dir=str(cache),
            chat_template=str(tmp_path / "t.jinja"))
    assert calls and len(list(cache.iterdir())) == 2  # a new entry
    calls.clear()
    src.write_text(src.read_text() + json.dumps(_rows(1)[0]) + "\n")  # the input changed: its size and mtime
    prepare([str(src)], DEBUG_TOK, 64, str(tmp_path / "d"), workers=1, progress=False, cache_dir=str(cache))
    assert calls and len(list(cache.iterdir())) == 3

    # prepare_diffusion shares the cache: a hit there tokenizes nothing either.
    prepare_diffusion([str(src)], DEBUG_TOK, 48, str(tmp_path / "e"), eos_pad=True, cache_dir=str(cache))
    calls.clear()
    prepare_diffusion([str(src)], DEBUG_TOK, 48, str(tmp_path / "f"), eos_pad=True, cache_dir=str(cache))
    assert calls == []
    _same_arrays(tmp_path / "e" / "train", tmp_path / "f" / "train")


def test_a_dataset_from_another_tokenizer_or_template_stops_training(tmp_path):
    from conftest import QWEN_DIR
    from titan_sft.data.chat import load_tokenizer
    from titan_sft.data.dataset import DatasetError, PackedDataset, check_tokenizer

    ds = PackedDataset(ROOT / "titan_sft/assets/debug_data/packed")
    debug, qwen = load_tokenizer(DEBUG_TOK), load_tokenizer(QWEN_DIR)
    check_tokenizer(ds, debug, False, DEBUG_TOK)
    check_tokenizer(ds, load_tokenizer(ROOT / "titan_sft/assets/debug_base"), False, "debug_base")  # an HF export
    with pytest.raises(DatasetError, match="another tokenizer .*allow_tokenizer_mismatch"):
        check_tokenizer(ds, qwen, False, str(QWEN_DIR))
    check_tokenizer(ds, qwen, True, str(QWEN_DIR))  # accepted when asked
    debug.chat_template = debug.chat_template + "{# changed #}"
    with pytest.raises(DatasetError, match="another chat template"):
        check_tokenizer(ds, debug, False, DEBUG_TOK)

    # End to end: one line, before any model is built.
    tok = tmp_path / "tok"
    shutil.copytree(DEBUG_TOK, tok)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    if "chat_template" in cfg:
        cfg["chat_template"] += "{# changed #}"
        (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    else:
        (tok / "chat_template.jinja").write_text((tok / "chat_template.jinja").read_text() + "{# changed #}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_model.toml",
                        "--job.dump_folder", str(tmp_path / "run"), "--model.tokenizer_path", str(tok)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [x for x in r.stderr.splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and "another chat template" in errors[0] and "allow_tokenizer_mismatch" in errors[0]
