"""scripts/multinode_trainer.slurm on a real two-node SLURM cluster (two slurmd daemons on this host): a job
that completes, and a job that is signalled as before a preemption, checkpoints, is requeued and finishes with
every step logged exactly once and the uninterrupted run's final loss."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent / "slurm"))
from cluster import Cluster, ensure_installed  # noqa: E402

STEPS = 30
TRAIN = [
    "--training.steps", str(STEPS), "--training.global_batch_size", "4", "--training.loss_groups", "2",
    "--training.param_dtype", "float32", "--optimizer.lr", "1e-3", "--checkpoint.interval", "1000",
    "--checkpoint.temp_interval_minutes", "0", "--checkpoint.hf_export_interval", "0",
    "--checkpoint.hf_export_dtype", "float32", "--checkpoint.resume", "auto", "--metrics.log_freq", "1",
    "--metrics.enable_tensorboard", "false", "--validation.generation_eval_path", "",
]


@pytest.fixture(scope="module")
def cluster():
    why = ensure_installed()
    if why:
        pytest.skip(why)
    c = Cluster()
    try:
        yield c.start()
    finally:
        c.stop()


def submit(cluster, tmp_path, name):
    # --gpus-per-node=0 overrides the script's 8-GPU default on these CPU nodes
    return cluster.sbatch("-N", "2", "--gpus-per-node=0", f"--output={tmp_path}/{name}-%j.log",
                          "scripts/multinode_trainer.slurm", "train_configs/debug_model.toml",
                          "--job.dump_folder", str(tmp_path / name), *TRAIN, cwd=ROOT,
                          env={"OMP_NUM_THREADS": "1"})


def records(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_job_completes_on_two_nodes_then_survives_preemption(cluster, tmp_path):
    job = submit(cluster, tmp_path, "straight")
    info = cluster.wait(job)
    log = next(tmp_path.glob("straight-*.log")).read_text()
    assert info["JobState"] == "COMPLETED", log[-3000:] + cluster.logs()
    assert "[init] 2 ranks on 2 node(s): n1, n2" in log  # one rank on each node took part
    straight = records(tmp_path / "straight")
    assert [r["step"] for r in straight] == list(range(1, STEPS + 1))
    assert (tmp_path / "straight" / "hf" / f"step-{STEPS - 1}" / "model.safetensors").is_file()

    # as SLURM does before a preemption or the time limit (--signal=B:USR1@T): USR1 to the batch shell
    job = submit(cluster, tmp_path, "preempted")
    metrics = tmp_path / "preempted" / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 4):
        time.sleep(0.2)
    subprocess.run(["scancel", "-b", "--signal=USR1", job], env=cluster.env, check=True)
    deadline = time.monotonic() + 300
    while True:
        info = cluster.job(job)
        if info.get("JobState") == "COMPLETED" and int(info.get("Restarts", 0)) >= 1:
            break
        assert info.get("JobState") not in ("FAILED", "CANCELLED", "TIMEOUT") and time.monotonic() < deadline, (
            info, next(tmp_path.glob("preempted-*.log")).read_text()[-4000:])
        time.sleep(0.5)
    log = next(tmp_path.glob("preempted-*.log")).read_text()
    assert "requeueing job" in log and "[resume] continuing after step" in log, log[-4000:]
    stopped_at = int(re.search(r"\[stop\] signal \d+: stopped after step (\d+)", log).group(1))
    assert 4 <= stopped_at < STEPS
    resumed = records(tmp_path / "preempted")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))  # every step exactly once
    assert abs(resumed[-1]["loss"] - straight[-1]["loss"]) <= 1e-6 * abs(straight[-1]["loss"])
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]  # resume is exact, in fact bitwise
    assert not list(ROOT.glob(f".titan_sft-{job}.stopped"))
