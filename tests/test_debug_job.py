"""`./run_train.sh` runs the debug job: the loss falls, the HF export exists, and the exported model (loaded with
transformers) answers the held-out prompts of the embedded task."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.torch_range
@pytest.mark.slow
def test_run_train_debug_job_learns_the_task(tmp_path):
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(["./run_train.sh", "--job.dump_folder", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert train[-1]["step"] == 250 and train[-1]["loss"] < 0.1 * train[0]["loss"]
    (val,) = [r for r in records if r["split"] == "validation"]
    assert val["n_examples"] == 100 and val["exact_match"] >= 0.8
    assert "exact-match accuracy" in proc.stdout
    assert (tmp_path / "hf" / "step-249" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-100", "step-200", "step-249"]
    # Only our lines and real warnings: no torchao kernel-library noise, no torch pytree deprecation for torchao.
    output = proc.stdout + proc.stderr
    assert "Failed to load" not in output and "is an Enum subclass" not in output
