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
    model.backend.prepare = lambda batch, seqlen, device, cu_seqlens: AttentionMask(causal=model.backend.causal)


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
    model.backend.prepare = lambda b, t, device, cu: AttentionMask(causal=causal)  # ignores cu_seqlens
    with pytest.raises(StartupCheckError, match="document 2's hidden states changed when document 1 changed"):
        check_document_isolation(model, 512, 256, torch.device("cpu"), "sdpa", causal)


def test_bidirectional_leak_into_the_earlier_document_is_caught():
    """A leak that only runs backwards (later document into the earlier one) needs the second direction."""
    model = debug_model(causal=False)
    real_prepare = model.backend.prepare

    def backwards_leak(b, t, device, cu):
        mask = real_prepare(b, t, device, cu)
        mask.dense = mask.dense.clone()
        mask.dense[..., : t // 2, t // 2 :] = True  # document 1 may see document 2, not the other way round
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
