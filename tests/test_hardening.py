"""Day-one user problems: the document-isolation check can fail (and does on a leaking backend), the HF export
hands vLLM the chat end-of-turn token, and the start-up banner says what the run is."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_sft.models import build_model
from titan_sft.models.attention import AttentionMask
from titan_sft.registry import get_train_spec
from titan_sft.startup_checks import StartupCheckError, check_document_isolation

ROOT = Path(__file__).resolve().parent.parent
DEBUG_TOK = str(ROOT / "titan_sft" / "assets" / "debug_tokenizer")

LEAKY_PLUGIN = '''
from titan_sft.models.attention import AttentionMask
from titan_sft.registry import register_converter


def leaky_attention(model, cfg, device):
    """Attention that ignores document boundaries: one causal mask over the whole row."""
    model.backend.prepare = lambda batch, seqlen, device, cu_seqlens, dtype=None: AttentionMask(causal=model.backend.causal)


register_converter("leaky_attention", leaky_attention)
'''


def debug_model(causal=True):
    torch.manual_seed(0)
    model = build_model(get_train_spec("qwen3").flavors["debug"], device="cpu", causal=causal)
    model.init_weights()
    return model


@pytest.mark.parametrize("causal", [True, False])
def test_isolation_check_passes_on_sdpa_and_fails_on_a_leaking_backend(causal):
    model = debug_model(causal)
    check_document_isolation(model, 512, 256, torch.device("cpu"), "sdpa", causal)
    model.backend.prepare = lambda b, t, device, cu, dtype=None: AttentionMask(causal=causal)  # ignores cu_seqlens
    with pytest.raises(StartupCheckError, match="document 2's hidden states changed when document 1 changed"):
        check_document_isolation(model, 512, 256, torch.device("cpu"), "sdpa", causal)


def test_bidirectional_leak_into_the_earlier_document_is_caught():
    """A leak that only runs backwards (later document into the earlier one) needs the second direction."""
    model = debug_model(causal=False)
    real_prepare = model.backend.prepare

    def backwards_leak(b, t, device, cu, dtype=None):
        mask = real_prepare(b, t, device, cu, dtype)
        mask.dense = mask.dense.clone()
        mask.dense[..., : t // 2, t // 2 :] = 0.0  # (additive) document 1 may see document 2, not the other way round
        return mask

    model.backend.prepare = backwards_leak
    with pytest.raises(StartupCheckError, match="document 1's hidden states changed when document 2 changed"):
        check_document_isolation(model, 512, 256, torch.device("cpu"), "sdpa", causal=False)


@pytest.mark.slow
def test_leaking_backend_stops_the_run(tmp_path):
    (tmp_path / "leaky.py").write_text(LEAKY_PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_model.toml",
                        "--job.custom_imports", "leaky", "--model.converters", "leaky_attention",
                        "--training.steps", "3", "--job.dump_folder", str(tmp_path / "out")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "error: document isolation check failed for attention backend 'sdpa'" in r.stderr
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not (tmp_path / "out" / "metrics.jsonl").read_text()


def test_export_writes_generation_config_with_end_of_turn_and_plain_padding(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    from titan_sft.hf_io import export_hf

    model = debug_model()
    out = export_hf(model, model.args, tmp_path / "hf", "float32", DEBUG_TOK, spec=get_train_spec("qwen3"))
    tok = AutoTokenizer.from_pretrained(out)
    gen = GenerationConfig.from_pretrained(out)
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    assert tok.convert_tokens_to_ids("<|im_end|>") in eos
    import transformers

    assert json.loads((out / "config.json").read_text())["transformers_version"] == transformers.__version__
    added = {t.content: t for t in tok.added_tokens_decoder.values()}
    assert added["<|padding_0|>"].special is False and added["<|im_end|>"].special is True
    assert len(tok) == 512
    ref = export_hf(model, model.args, tmp_path / "ref", "float32", DEBUG_TOK, spec=get_train_spec("qwen3"),
                    generation_config=False)
    assert not (ref / "generation_config.json").exists()


def test_generation_config_eos_for_qwen3_and_llama3_ids():
    from titan_sft.hf_io import build_generation_config

    class Tok:
        eos_token_id, pad_token_id = 151645, 151643

        def get_vocab(self):
            return {"<|im_end|>": 151645, "<|endoftext|>": 151643}

    gen = build_generation_config({"eos_token_id": 151643, "bos_token_id": 151643}, Tok())
    assert gen["eos_token_id"] == [151643, 151645] and gen["pad_token_id"] == 151643
    gen = build_generation_config({"eos_token_id": [128001, 128008, 128009], "bos_token_id": 128000}, None)
    assert gen["eos_token_id"] == [128001, 128008, 128009]


def test_holdout_split_is_seeded_and_never_trained_on():
    from titan_sft.data.sampler import RecipeSampler, holdout_split

    trained, held = holdout_split(100, 0.1, seed=3)
    assert len(held) == 10 and np.array_equal(held, holdout_split(100, 0.1, seed=3)[1])
    assert not set(trained) & set(held) and len(trained) + len(held) == 100
    s = RecipeSampler(100, 8, subset=trained)
    seen = np.concatenate([s.global_indices(step) for step in range(12)])  # > 1 epoch of the 90 trained packs
    assert not set(seen.tolist()) & set(held.tolist()) and set(seen.tolist()) == set(trained.tolist())
    assert s.global_indices(0).tolist() == trained[:8].tolist()  # the recipe's sequential order over the rest


@pytest.mark.slow
def test_held_out_loss_records_and_best_checkpoint(tmp_path):
    from test_parallel import run

    records = {}
    for n in (1, 2):
        out = run(n, tmp_path / str(n), "--training.steps", "4", "--validation.holdout_fraction", "0.01",
                  "--validation.interval", "2", "--validation.keep_best", "true", "--checkpoint.hf_export_interval", "-1")
        records[n] = [r for r in out if r["split"] == "validation"]
    val = records[1]
    assert [r["step"] for r in val] == [2, 4] and all(r["n_packs"] == 11 and r["n_loss_tokens"] > 0 for r in val)
    assert val[1]["loss"] < val[0]["loss"] and val[1]["best"] is True
    for a, b in zip(records[1], records[2]):  # every rank evaluates its share; the sums are all-reduced
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["n_loss_tokens"] == b["n_loss_tokens"]
    meta = json.loads((tmp_path / "1" / "checkpoints-best" / "meta.json").read_text())
    assert meta["kind"] == "best" and meta["step"] == 4 and meta["validation_loss"] == val[1]["loss"]


def _dataset_with_empty_packs(tmp_path, empty=(4, 5)):
    """Prepare 120 debug conversations (so doc_sources names their rows), then blank the loss of some packs, as
    data from another pipeline might arrive."""
    from titan_sft.data.prepare import prepare

    src = tmp_path / "chats.jsonl"
    src.write_text("".join((ROOT / "titan_sft/assets/debug_data/train.jsonl").read_text().splitlines(True)[:120]))
    out = tmp_path / "ds"
    prepare([str(src)], DEBUG_TOK, 128, str(out), workers=1, progress=False)
    mask = np.load(out / "assistant_mask.npy")
    counts = np.load(out / "assistant_counts.npy")
    mask[list(empty)] = 0
    counts[list(empty)] = 0
    np.save(out / "assistant_mask.npy", mask)
    np.save(out / "assistant_counts.npy", counts)
    return src, out


@pytest.mark.slow
def test_empty_loss_group_names_packs_and_rows_or_is_skipped(tmp_path):
    from test_parallel import run

    src, ds = _dataset_with_empty_packs(tmp_path)
    base = ["--data.path", str(ds), "--training.steps", "4", "--checkpoint.hf_export_interval", "-1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_model.toml", *base,
                        "--training.global_batch_size", "4", "--training.loss_groups", "2",
                        "--job.dump_folder", str(tmp_path / "stop")], cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 2
    # step 2 holds packs 4-7; group 0 (packs 4, 5) has no loss token; each pack's rows are named
    line = next(x for x in r.stderr.splitlines() if x.startswith("error:"))
    assert "step 2: loss group(s) [0] have no loss-carrying target" in line
    assert f"pack 4: {src}:" in line and f"pack 5: {src}:" in line and "skip_empty_loss_groups" in line
    records = run(1, tmp_path / "skip", *base, "--training.skip_empty_loss_groups", "true")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[1]["skipped"] is True and records[1]["skipped_total"] == 1 and "loss" not in records[1]
    assert all("loss" in r for r in records if r["step"] != 2)


def test_prepare_names_conversations_truncated_to_no_loss(tmp_path, capsys):
    from titan_sft.data.prepare import prepare

    long_user = {"messages": [{"role": "user", "content": "upper: " + "abcd " * 200},
                              {"role": "assistant", "content": "ABCD"}]}
    ok = {"messages": [{"role": "user", "content": "upper: ab"}, {"role": "assistant", "content": "AB"}]}
    src = tmp_path / "c.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in (ok, long_user, ok)) + "\n")
    m = prepare([str(src)], DEBUG_TOK, 64, str(tmp_path / "out"), workers=1, progress=True)
    assert m["overlength"]["dropped_no_loss_after_truncation"] == 1
    assert m["overlength"]["first_dropped_no_loss"] == [f"{src}:2"]
    assert f"all truncated away by --seq-len 64; first: {src}:2" in capsys.readouterr().err
    sources = np.load(tmp_path / "out" / "doc_sources.npy")
    assert sorted(sources[:, 1].tolist()) == [1, 3] and set(sources[:, 0].tolist()) == {0}


def test_reference_format_dataset_reads(tmp_path):
    """The reference SFT pipeline's packed data: no n_packs/format_version in the manifest, a signed 0/1 mask."""
    import shutil

    from titan_sft.data.dataset import DatasetError, PackedDataset

    ref = tmp_path / "ref"
    shutil.copytree(ROOT / "titan_sft/assets/debug_data/packed", ref)
    m = json.loads((ref / "manifest.json").read_text())
    del m["n_packs"], m["format_version"]
    (ref / "manifest.json").write_text(json.dumps(m))
    np.save(ref / "assistant_mask.npy", np.load(ref / "assistant_mask.npy").astype(np.int8))
    ds, ours = PackedDataset(ref), PackedDataset(ROOT / "titan_sft/assets/debug_data/packed")
    assert len(ds) == len(ours) == 1111 and ds.reference_format
    for i in (0, 500, 1110):
        assert all(np.array_equal(a, b) for a, b in zip(ds[i], ours[i]))
    np.save(ref / "assistant_mask.npy", np.load(ref / "assistant_mask.npy") * -1)
    with pytest.raises(DatasetError, match="values outside 0/1 in a signed mask; rewrite it as uint8"):
        PackedDataset(ref)


def _hub_cache(root: Path, repo: str, files: dict[str, str]) -> None:
    """The huggingface_hub cache layout: models--owner--name/{refs/main, snapshots/<rev>/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(rev)
    snap = repo_dir / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, text in files.items():
        (snap / name).write_text(text)


def test_recipe_dry_runs_from_a_hub_cache_without_weights_or_data(tmp_path):
    from titan_sft.models.hf_adapter import hf_config_from_args

    spec = get_train_spec("qwen3")
    config = hf_config_from_args(spec.flavors["8B"], "qwen3", "Qwen3ForCausalLM")
    tok_files = {f: (ROOT / "titan_sft/assets/debug_tokenizer" / f).read_text()
                 for f in ("tokenizer.json", "tokenizer_config.json")}
    _hub_cache(tmp_path / "hub", "Qwen/Qwen3-8B", {"config.json": json.dumps(config), **tok_files})
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "titan_sft.train", "--config", "train_configs/qwen3_8b.toml", "--dry-run"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "model: qwen3 (from Qwen/Qwen3-8B), 8,190.7M parameters" in r.stdout
    assert "is not prepared yet" in r.stdout and "steps: 2000 (explicit)" in r.stdout
    assert "warmup 100 / stable 100 / decay 1800" in r.stdout
    # Nothing in the cache: the plan comes from the flavor (issue 38, item 11) and says how to get the directory.
    empty = subprocess.run(cmd, cwd=ROOT, env={**env, "HF_HUB_CACHE": str(tmp_path / "empty")},
                           capture_output=True, text=True)
    assert empty.returncode == 0, empty.stderr[-2000:]
    assert "model: qwen3 8B, 8,190.7M parameters" in empty.stdout
    assert "planned from flavor 8B's arguments" in empty.stdout
    assert "python -m titan_sft.download Qwen/Qwen3-8B --to DIR" in empty.stdout
    assert "huggingface-cli download Qwen/Qwen3-8B" in empty.stdout


def test_download_copies_a_cached_model_atomically(tmp_path):
    _hub_cache(tmp_path / "hub", "org/tiny", {"config.json": "{}", "model.safetensors": "x", "README.md": "no"})
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.download", "org/tiny", "--to", str(tmp_path / "out")],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    again = subprocess.run([sys.executable, "-m", "titan_sft.download", "org/tiny", "--to", str(tmp_path / "out")],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    assert again.returncode == 2 and "already exists" in again.stderr


@pytest.mark.slow
def test_lm_eval_runs_on_an_export_on_cpu(tmp_path):
    """python -m titan_sft.evaluate with the hf backend on the debug model's export and a local task."""
    from titan_sft.hf_io import export_hf

    model = debug_model()
    export_hf(model, model.args, tmp_path / "hf", "float32", DEBUG_TOK, spec=get_train_spec("qwen3"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = ROOT / "tests" / "data" / "lm_eval" / "titan_upper.jsonl"
    (tasks / "titan_upper.yaml").write_text(
        (ROOT / "tests" / "data" / "lm_eval" / "titan_upper.yaml").read_text().replace("DATA_FILE", str(data)))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "ds"),
           "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, "-m", "titan_sft.evaluate", "--hf", str(tmp_path / "hf"), "--tasks",
                        "titan_upper", "--backend", "hf", "--include-path", str(tasks), "--output",
                        str(tmp_path / "results.json")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    acc = json.loads((tmp_path / "results.json").read_text())["results"]["titan_upper"]["acc,none"]
    assert acc in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 two-way questions, scored by the model's log-likelihoods
    assert "titan_upper" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "titan_sft.evaluate", "--hf", str(tmp_path), "--tasks", "x"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "not an HF directory" in bad.stderr
