"""Adapter-only checkpoints (issue 37, item 1): a run whose base is frozen (LoRA) stores the trainable parameters,
their optimizer state, the data position, the RNG and the base's identity (source + fingerprint), not the base.
Resume rebuilds the base and continues exactly (bitwise on one rank, 1e-5 from 2 FSDP ranks to 1), a changed base
is refused with one line, and the checkpoint converts to the same HF weights as the run's own export."""

import json
import os
import re
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from test_train_e2e import BASE, ROOT, run

LORA = ["--model.converters", "lora", "--lora.rank", "4", "--training.steps", "8",
        "--checkpoint.hf_export_interval", "0"]


def _bytes(folder):
    return sum(f.stat().st_size for f in folder.iterdir() if f.name != "meta.json")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    dump = tmp_path_factory.mktemp("adapter_ckpt") / "straight"
    return dump, run(1, dump, *LORA)


@pytest.mark.slow
def test_adapter_only_checkpoint_is_small_and_resumes_bitwise(straight, tmp_path):
    dump, records = straight
    run(1, tmp_path / "split", *LORA, "--training.stop_at_step", "4")
    ckpt = tmp_path / "split" / "checkpoints-temp"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["base_identity"]["source"] == {"kind": "init", "name": "qwen3", "flavor": "debug", "seed": 0}
    keys = set(FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata)
    model_keys = {k for k in keys if k.startswith("model.")}
    assert model_keys and all(k.endswith(("lora_a", "lora_b")) or "norm" in k for k in model_keys), sorted(model_keys)
    assert any(k.startswith("optimizer.") for k in keys)  # resumable: the optimizer state is there
    frozen = set(meta["base_identity"]["fingerprint"])
    assert "tok_embeddings.weight" in frozen and "layers.0.attention.wq.weight" in frozen
    assert not frozen & {k.removeprefix("model.") for k in model_keys}
    # today's layout (the whole model) for the byte count: the base is most of it
    run(1, tmp_path / "stored", *LORA, "--training.stop_at_step", "4", "--checkpoint.frozen_base", "stored")
    small, full = _bytes(ckpt), _bytes(tmp_path / "stored" / "checkpoints-temp")
    print(f"checkpoint bytes of the debug LoRA job at step 4: adapter-only {small:,}, with the base {full:,} "
          f"({full / small:.1f}x)")
    audit = json.loads((tmp_path / "split" / "parameter_audit.json").read_text())
    n_tensors = sum(1 for k in keys if k.startswith(("model.", "optimizer.state.")))
    # the base's fp32 bytes are what the stored layout adds; what remains is the trainable state (12 bytes per
    # parameter: fp32 value and AdamW's two moments) and DCP's per-tensor record (well under 8 KiB each here)
    assert full - small >= 4 * audit["frozen"]
    assert small <= 12 * audit["trainable"] + 8192 * n_tensors
    resumed = run(1, tmp_path / "split", *LORA)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed[4:]] == [r["loss"] for r in records[4:]]  # bitwise
    assert [r["grad_norm"] for r in resumed[4:]] == [r["grad_norm"] for r in records[4:]]
    a, b = (load_file(str(d / "hf" / "step-7" / "model.safetensors")) for d in (tmp_path / "split", dump))
    assert all(torch.equal(a[k], b[k]) for k in b)


@pytest.mark.slow
def test_adapter_only_checkpoint_reshards_from_two_ranks_to_one(straight, tmp_path):
    _, records = straight
    run(2, tmp_path / "reshard", *LORA, "--training.stop_at_step", "4")
    resumed = run(1, tmp_path / "reshard", *LORA)
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for a, b in zip(resumed[4:], records[4:]):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(b["loss"]), (a["loss"], b["loss"])


@pytest.mark.slow
def test_another_base_is_refused_with_one_line_and_the_checkpoint_kept(straight, tmp_path):
    """The base here is the seeded init: job.seed 1 is another base. Through ./run_train.sh on 2 ranks: one error
    line, exit 2, no launcher traceback, and the checkpoint is not moved aside as damaged."""
    dump, _ = straight
    shutil.copytree(dump, tmp_path / "run")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "NGPU": "2"}
    r = subprocess.run(["./run_train.sh", "train_configs/debug_model.toml", *BASE, *LORA, "--job.dump_folder",
                        str(tmp_path / "run"), "--training.steps", "9", "--job.seed", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    errors = [x.removeprefix("[rank0]:") for x in out.splitlines() if "error:" in x]
    assert len(errors) == 1, errors
    assert ("was trained on the base random init of qwen3 flavor debug with job.seed 0; this run's base (random "
            "init of qwen3 flavor debug with job.seed 1) is another: ") in errors[0], errors[0]
    assert "Traceback" not in out and "ChildFailedError" not in out
    assert not list((tmp_path / "run").rglob("*.damaged*"))


@pytest.mark.slow
def test_convert_rebuilds_the_base_of_an_adapter_only_checkpoint(straight):
    """`convert to-hf` of the final adapter-only checkpoint: the base is the seeded init again, the adapters are
    merged, and the weights equal the run's own HF export."""
    from titan_sft.convert import model_from_checkpoint
    from titan_sft.lora import merge_lora
    from titan_sft.models.hf_adapter import native_to_hf_name

    dump, _ = straight
    ckpt = dump / "checkpoints" / "step-7"
    assert "base_identity" in json.loads((ckpt / "meta.json").read_text())
    model, cfg, _, _ = model_from_checkpoint(ckpt)
    merged = merge_lora({k: v.detach() for k, v in model.state_dict().items()}, cfg.lora.alpha / cfg.lora.rank)
    exported = load_file(str(dump / "hf" / "step-7" / "model.safetensors"))
    for name, t in merged.items():
        hf = native_to_hf_name(name)
        if hf in exported:
            assert torch.allclose(t.float(), exported[hf].float(), atol=1e-6, rtol=0), name


@pytest.mark.slow
def test_dora_with_rslora_trains_the_same_on_two_fsdp_ranks_as_on_one(tmp_path):
    """DoRA + rsLoRA on the debug model (tied head, weight decay on): 2 FSDP ranks equal 1 rank over 3 steps
    (1e-5), the export holds the trained magnitudes as its row norms, and the adapter says use_dora / use_rslora."""
    dora = [*LORA, "--training.steps", "3", "--lora.use_dora", "true", "--lora.use_rslora", "true",
            "--optimizer.lr", "1e-2"]
    one, two = run(1, tmp_path / "one", *dora), run(2, tmp_path / "two", *dora, "--training.per_device_batch", "1")
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]), (a["loss"], b["loss"])
    wa, wb = (load_file(str(d / "hf" / "step-2" / "model.safetensors")) for d in (tmp_path / "one", tmp_path / "two"))
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5, rtol=1e-5) for k in wa)
    adapter = tmp_path / "one" / "adapters" / "final"
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["use_dora"] is True and conf["use_rslora"] is True
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    m = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"]
    # the exported q_proj is W' = (m / ||W + s B A||) (W + s B A): its row norms are the trained magnitudes
    assert torch.allclose(wa["model.layers.0.self_attn.q_proj.weight"].norm(dim=1), m, rtol=1e-5)
    assert one[-1]["loss"] < one[0]["loss"]


@pytest.mark.slow
def test_a_weights_only_start_resumes_its_own_checkpoint_on_the_same_command(tmp_path):
    """`--checkpoint.resume <weights-only checkpoint>` is where the run starts: rerun with the same command after
    a stop (a requeue), it continues from its own checkpoint in the same folder (before: from step 0, in a new
    folder), the base's identity names the weights-only checkpoint, and the steps equal an uninterrupted run."""
    from titan_sft.convert import from_hf

    start = from_hf(str(ROOT / "titan_sft/assets/debug_base"), str(tmp_path / "start"))
    common = [*LORA, "--checkpoint.resume", str(start)]
    straight = run(1, tmp_path / "straight", *common)
    run(1, tmp_path / "split", *common, "--training.stop_at_step", "4")
    meta = json.loads((tmp_path / "split" / "checkpoints-temp" / "meta.json").read_text())
    assert meta["base_identity"]["source"] == {"kind": "dcp", "path": str(start)}
    resumed = run(1, tmp_path / "split", *common)
    assert [r["step"] for r in resumed] == list(range(1, 9)) and not (tmp_path / "split-1").exists()
    assert [r["loss"] for r in resumed[4:]] == [r["loss"] for r in straight[4:]]


def test_dry_run_prints_the_checkpoint_size(monkeypatch):
    """Qwen3-30B-A3B LoRA (attention + norms): 12 bytes per trainable parameter (fp32 value, AdamW's two
    moments), the bf16 base not stored; with frozen_base = "stored" the base's bytes are added."""
    from titan_sft.config import load_config
    from titan_sft.dry_run import dry_run

    monkeypatch.setenv("WORLD_SIZE", "8")
    args = ["--model.init_from_hf", "false", "--model.flavor", "30B-A3B", "--model.hf_assets_path", ""]
    plan = dry_run(load_config("train_configs/qwen3_30b_a3b_lora.toml", args))
    trainable = float(re.search(r"LoRA: .*: ([\d.]+)M trainable", plan).group(1)) * 1e6
    size = float(re.search(r"checkpoint size: ([\d.]+) GiB \(trainable parameters and their AdamW state; the "
                           r"frozen base's ([\d.]+) GiB is not stored", plan).group(1))
    assert size == pytest.approx(12 * trainable / 2**30, abs=1e-3)
    stored = dry_run(load_config("train_configs/qwen3_30b_a3b_lora.toml", [*args, "--checkpoint.frozen_base", "stored"]))
    full = float(re.search(r"checkpoint size: ([\d.]+) GiB \(the frozen base's ([\d.]+) GiB included", stored).group(1))
    assert full > 50 and full == pytest.approx(size + 2 * 30.53e9 / 2**30, rel=1e-2)
