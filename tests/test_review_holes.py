"""Holes a review of the masked-diffusion trainer found (issue 19, item 8), each with a test that failed before its
fix: held-out packs that were never validated, split_loss on a dataset without EOS padding, earlier runs
overwritten, and RNG state restored from rank 0 alone (CPU) or not at all (CUDA)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
DIFFUSION = "train_configs/debug_diffusion.toml"


def _run(dump, *overrides, config=DIFFUSION, nproc=1):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", config, "--job.dump_folder", str(dump), "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--checkpoint.hf_export_interval", "-1", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _records(dump):
    return [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_masked_diffusion_validates_on_the_held_out_packs(tmp_path):
    from titan_sft.data.sampler import holdout_split

    r = _run(tmp_path / "run", "--training.steps", "4", "--validation.interval", "2", "--validation.path", "",
             "--validation.test_path", "", "--validation.holdout_fraction", "0.1", "--validation.generation_every",
             "0", "--training.per_device_batch", "4", "--checkpoint.interval", "100")
    assert r.returncode == 0, r.stderr[-3000:]
    val = [x for x in _records(tmp_path / "run") if x["split"] == "validation"]
    held = holdout_split(_n_packs(), 0.1, 0)[1]
    assert [x["step"] for x in val] == [2, 4]
    assert all(x["n_examples"] == len(held) for x in val)  # one example per pack (EOS-padded)
    assert (tmp_path / "run" / "checkpoints-best" / "meta.json").is_file()  # keep_best works with it


def _n_packs():
    manifest = ROOT / "titan_sft/assets/debug_data/diffusion/train/manifest.json"
    return json.loads(manifest.read_text())["n_packs"]


def test_split_loss_refuses_a_dataset_without_eos_padding(tmp_path):
    data = tmp_path / "greedy"
    shutil.copytree(ROOT / "titan_sft/assets/debug_data/diffusion/train", data)
    manifest = json.loads((data / "manifest.json").read_text())
    (data / "manifest.json").write_text(json.dumps({**manifest, "eos_pad": False, "packing": "greedy"}))
    r = _run(tmp_path / "run", "--data.path", str(data), "--objective.split_loss", "true", "--objective.answer_weight",
             "0.5", "--objective.padding_weight", "0.5", "--training.steps", "2")
    assert r.returncode != 0  # torchrun reports the rank's exit status 2 as a failure
    assert "error: config key 'objective.split_loss'" in r.stderr and "--eos-pad" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_earlier_run_is_never_written_into_whatever_the_checkpoint_settings(tmp_path):
    from titan_sft.checkpoint import run_folder

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step-3"
    ckpt.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("{}\n")
    (ckpt / ".metadata").write_text("")
    (ckpt / "meta.json").write_text('{"step": 4}')
    assert run_folder(str(run), "auto") == str(run)  # continues that run
    assert run_folder(str(run), "auto", checkpoint_enabled=False) == f"{run}-1"  # resumes nothing: a new folder
    assert run_folder(str(run), str(ckpt)) == str(run)  # its own checkpoint, named
    other = tmp_path / "other" / "checkpoints" / "step-3"
    other.mkdir(parents=True)
    assert run_folder(str(run), str(other)) == f"{run}-1"  # another run's checkpoint: a new folder


@pytest.mark.slow
def test_resume_restores_each_ranks_own_rng_state(tmp_path):
    """Two ranks with LoRA dropout on a randomly initialised model: rank 0 alone drew the init, so the ranks'
    generators differ; a resumed run continues each rank's own stream (losses bit for bit). Before, every rank got
    rank 0's CPU state."""
    common = ["--model.converters", "lora", "--lora.dropout", "0.2", "--training.steps", "4",
              "--checkpoint.interval", "100", "--checkpoint.resume", "auto", "--validation.generation_eval_path", ""]
    cfg = "train_configs/debug_model.toml"
    whole = _run(tmp_path / "whole", *common, config=cfg, nproc=2)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = _run(tmp_path / "split", *common, "--training.stop_at_step", "2", config=cfg, nproc=2)
    assert first.returncode == 0, first.stderr[-3000:]
    meta = json.loads((tmp_path / "split" / "checkpoints-temp" / "meta.json").read_text())
    assert len(meta["rng"]) == 2 and meta["rng"][0]["cpu"] != meta["rng"][1]["cpu"]
    second = _run(tmp_path / "split", *common, config=cfg, nproc=2)
    assert second.returncode == 0, second.stderr[-3000:]
    losses = lambda d: {x["step"]: x["loss"] for x in _records(d) if x["split"] == "train"}  # noqa: E731
    assert losses(tmp_path / "split") == losses(tmp_path / "whole")


def test_cuda_rng_state_is_saved_and_restored(monkeypatch):
    """On a GPU the rank's CUDA generator is checkpointed too (faked here: no GPU)."""
    from titan_sft import checkpoint

    state = {"cuda": torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a: state["cuda"].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda t, *a: state.update(cuda=t.clone()))
    saved = checkpoint.gather_rng_states()
    cpu_before = torch.get_rng_state()
    torch.rand(10)
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)
    checkpoint.restore_rng_state({"rng": saved})
    assert torch.equal(state["cuda"], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu_before)


def test_known_library_noise_is_dropped_and_other_records_pass():
    import logging

    from titan_sft.log import quiet_known_noise

    quiet_known_noise()
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).addHandler(handler)
    try:
        logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.so: Could not load this library")
        logging.getLogger("torch.utils._pytree").warning("<enum 'K'> is an Enum subclass and is now natively "
                                                         "supported by torch.compile")
        logging.getLogger("torchao").warning("Skipping import of cpp extensions due to incompatible torch version")
    finally:
        for name in ("torchao", "torch.utils._pytree"):
            logging.getLogger(name).removeHandler(handler)
    assert seen == ["Skipping import of cpp extensions due to incompatible torch version"]
