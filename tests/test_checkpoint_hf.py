"""HF export (parity with transformers, dtype, tokenizer padding, sharding), convert round trip, sharded HF load,
and auto-resume in the face of what a killed save leaves behind."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import save_tiny_hf
from safetensors.torch import load_file

from titan_sft.checkpoint import find_checkpoints
from titan_sft.convert import from_hf, to_hf
from titan_sft.hf_io import export_hf, hf_safetensors_files, read_hf_config
from titan_sft.models import build_model
from titan_sft.models.hf_adapter import args_from_hf_config
from titan_sft.models.qwen3 import QWEN3_FLAVORS
from titan_sft.registry import get_train_spec

ROOT = Path(__file__).resolve().parent.parent
DEBUG_TOK = str(ROOT / "titan_sft" / "assets" / "debug_tokenizer")
QWEN3 = get_train_spec("qwen3")


def debug_model(tied=True):
    args = QWEN3_FLAVORS["debug"]
    if not tied:
        import dataclasses

        args = dataclasses.replace(args, tie_embeddings=False)
    torch.manual_seed(0)
    m = build_model(args, device="cpu")
    m.init_weights()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    return m.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_fp32_export_matches_native_in_transformers(tmp_path, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = debug_model(tied)
    out = export_hf(model, model.args, tmp_path / "hf", "float32", DEBUG_TOK, spec=QWEN3)
    assert not list(tmp_path.glob("*.partial"))
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 261, (2, 33))
    with torch.no_grad():
        assert (hf(x).logits - model(x)).abs().max() < 1e-5
    tok = AutoTokenizer.from_pretrained(out)
    assert len(tok) == model.args.vocab_size == 512
    from transformers import AutoTokenizer as AT

    n_real = len(AT.from_pretrained(DEBUG_TOK))
    assert tok.convert_ids_to_tokens(n_real) == "<|padding_0|>" and tok.convert_ids_to_tokens(511) == f"<|padding_{511 - n_real}|>"
    assert (out / "generation_config.json").is_file()  # issue 14: vLLM needs the end-of-turn EOS (off: test_hardening)
    names = set(load_file(out / "model.safetensors"))
    assert ("lm_head.weight" in names) is (not tied)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["torch_dtype"] == cfg["dtype"] == "float32"
    assert cfg["tie_word_embeddings"] is tied and cfg["vocab_size"] == 512


def test_bf16_export_is_native_rounded_and_sharded(tmp_path):
    from transformers import AutoModelForCausalLM

    model = debug_model()
    out = export_hf(model, model.args, tmp_path / "hf", "bfloat16", DEBUG_TOK, max_shard_gb=0.0003, spec=QWEN3)
    files = hf_safetensors_files(out)
    assert len(files) > 1 and (out / "model.safetensors.index.json").is_file()
    assert all(f.stat().st_size <= 0.0003e9 + 64_000 for f in files)  # header slack
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    rounded = debug_model()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    x = torch.randint(0, 261, (1, 40))
    with torch.no_grad():
        assert (hf(x).logits - rounded(x)).abs().max() < 1e-5


@pytest.mark.parametrize("kind", ["qwen3_tied", "llama3"])
def test_round_trip_hf_dcp_hf_is_bitwise(tmp_path, kind):
    save_tiny_hf(kind, tmp_path / "src")
    from_hf(str(tmp_path / "src"), str(tmp_path / "dcp"))
    assert json.loads((tmp_path / "dcp" / "meta.json").read_text())["kind"] == "weights_only"
    to_hf(str(tmp_path / "dcp"), str(tmp_path / "back"), dtype="float32")
    a = load_file(tmp_path / "src" / "model.safetensors")
    b = load_file(tmp_path / "back" / "model.safetensors")
    a.pop("lm_head.weight", None) if kind == "qwen3_tied" else None
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert args_from_hf_config(read_hf_config(tmp_path / "src")) == args_from_hf_config(read_hf_config(tmp_path / "back"))


def test_convert_cli_errors(tmp_path):
    r = subprocess.run([sys.executable, "-m", "titan_sft.convert", "to-hf", "--checkpoint", str(tmp_path),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and "not a complete titan_sft checkpoint" in r.stderr


@pytest.mark.slow
def test_initial_hf_load_on_two_ranks(tmp_path):
    save_tiny_hf("qwen3_untied", tmp_path / "hf")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(ROOT / "tests" / "dist" / "check_hf_load.py"), str(tmp_path / "hf")],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("shards equal their HF slices") == 2


@pytest.mark.slow
def test_auto_resume_skips_partial_and_damaged(tmp_path):
    """What a kill mid-save leaves (a *.partial, or a directory with damaged metadata) is never resumed from."""
    from test_train_e2e import run

    dump = tmp_path / "run"
    run(1, dump, "--training.steps", "6", "--checkpoint.interval", "2", "--training.stop_at_step", "4")
    found = find_checkpoints(dump)
    assert [s for s, _ in found][:2] == [4, 3]  # temp (4 steps) then step-2 (label 2 = 3 steps)
    # a save killed before its rename, and a "complete" one whose metadata got truncated
    shutil.copytree(dump / "checkpoints-temp", dump / "checkpoints" / "step-4.partial")
    shutil.copytree(dump / "checkpoints-temp", dump / "checkpoints" / "step-9")
    meta = json.loads((dump / "checkpoints" / "step-9" / "meta.json").read_text())
    (dump / "checkpoints" / "step-9" / "meta.json").write_text(json.dumps({**meta, "step": 10}))
    (dump / "checkpoints" / "step-9" / ".metadata").write_bytes(b"\x00garbage")
    # and a complete-looking one (newer still) whose tensor data was cut short
    shutil.copytree(dump / "checkpoints-temp", dump / "checkpoints" / "step-10")
    (dump / "checkpoints" / "step-10" / "meta.json").write_text(json.dumps({**meta, "step": 11}))
    for f in (dump / "checkpoints" / "step-10").glob("*.distcp"):
        f.write_bytes(f.read_bytes()[:100])
    log = tmp_path / "log.txt"
    resumed = run(1, dump, "--training.steps", "6", "--checkpoint.interval", "2", log=log)
    straight = run(1, tmp_path / "straight", "--training.steps", "6", "--checkpoint.interval", "2")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in resumed[4:]] == [r["loss"] for r in straight[4:]]
    # one line each, and moved aside: neither retried at the next start nor deleted
    lines = [x for x in log.read_text().splitlines() if "cannot resume from" in x]
    assert len(lines) == 2 and "step-10.damaged" in lines[0] and "step-9.damaged" in lines[1], lines
    assert "Traceback" not in log.read_text()
    names = sorted(p.name for p in (dump / "checkpoints").iterdir())
    assert names == ["step-10.damaged", "step-2", "step-4", "step-5", "step-9.damaged"], names


def test_checkpoint_writes_a_tied_head_once_and_no_crc(tmp_path, monkeypatch):
    """DCP would write a tied head twice (one copy per key) and run torch.save's CRC32 over every byte, which
    nothing reads; the checkpointer's model state and writer skip both, and the state loads back whole."""
    import torch.distributed.checkpoint as dcp

    from titan_sft.checkpoint import _CrcFreeWriter, model_state, tied_aliases, with_aliases

    model = debug_model(tied=True)
    assert tied_aliases(model) == {"output.weight": "tok_embeddings.weight"}
    assert tied_aliases(debug_model(tied=False)) == {}
    crc_at_save = []
    real_save = torch.save

    def spy(*a, **k):
        crc_at_save.append(torch.serialization.get_crc32_options())
        return real_save(*a, **k)

    monkeypatch.setattr(torch, "save", spy)
    dcp.save({"model": model_state(model)}, storage_writer=_CrcFreeWriter(str(tmp_path / "c"), thread_count=2),
             no_dist=True)
    assert len(crc_at_save) == len(model_state(model)) and not any(crc_at_save)
    assert torch.serialization.get_crc32_options()  # restored after the write
    keys = {i.fqn for i in dcp.FileSystemReader(str(tmp_path / "c")).read_metadata().storage_data}
    assert "model.tok_embeddings.weight" in keys and "model.output.weight" not in keys

    fresh = build_model(QWEN3_FLAVORS["debug"], device="cpu")
    fresh.init_weights()
    state = {"model": model_state(fresh)}
    dcp.load(state, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    fresh.load_state_dict(with_aliases(fresh, state["model"]))
    assert fresh.output.weight is fresh.tok_embeddings.weight
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
