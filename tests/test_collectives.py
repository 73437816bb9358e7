"""The trainer's collectives run on the compute device (NCCL takes CUDA tensors only). Without a GPU the device of a
tensor cannot show the bug, so titan_sft.parallel.comm marks tensors made without a device (what a GPU run would
leave on the host); conftest turns that on for every trainer the suite starts, and these tests prove the check
fires, stays quiet for device tensors, and that no module goes around it."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_sft.parallel import comm

ROOT = Path(__file__).resolve().parent.parent
COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "scatter", "gather"}


def test_no_module_calls_a_tensor_collective_around_comm():
    """Every tensor collective titan_sft issues itself goes through comm (which checks the device)."""
    offenders = []
    for path in (ROOT / "titan_sft").rglob("*.py"):
        if path.name == "comm.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
                owner = node.func.value
                name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
                if name in ("dist", "distributed"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}.{node.func.attr}")
    assert not offenders, offenders


@pytest.fixture
def marker():
    comm.enable_host_tensor_check()
    yield
    comm.disable_host_tensor_check()


def test_marker_flags_host_tensors_and_passes_device_ones(monkeypatch, marker):
    host = torch.zeros(3, dtype=torch.float64)
    derived = host * 2 + 1  # computed from host tensors only: still on the host on a GPU
    with pytest.raises(comm.CollectiveDeviceError, match="host.*NCCL"):
        comm.all_reduce(host, what="test")
    with pytest.raises(comm.CollectiveDeviceError, match="test2"):
        comm.all_reduce(derived, what="test2")
    moved = host.to(comm.device())  # a copy on a GPU; the marker makes it one here too
    assert moved is not host
    comm.all_reduce(moved)
    comm.all_reduce(comm.tensor([1.0, 2.0]))
    comm.broadcast(comm.zeros(2))
    mixed = comm.zeros(3) + host  # on a GPU this runs on the device
    comm.all_reduce(mixed)
    monkeypatch.setattr(comm, "_device", torch.device("meta"))
    with pytest.raises(comm.CollectiveDeviceError, match="tensor on cpu"):
        comm.all_reduce(torch.zeros(1, device="cpu"))


def _run(dump, *overrides, config="train_configs/debug_model.toml", nproc=2, env=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TITAN_SFT_CHECK_COLLECTIVE_DEVICES": "1", **(env or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
           "titan_sft.train", "--config", config, "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump), *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_every_trainer_collective_of_a_run_is_on_the_compute_device(tmp_path):
    """Two ranks with every per-step collective in use (loss denominators, step statistics and flags, held-out
    loss, temporary checkpoints on rank 0's clock, a planned stop) under the host-tensor check. (Async saves'
    vote is the same all-reduce; tests/test_hardening.py runs them.)"""
    r = _run(tmp_path / "run", "--training.steps", "6", "--training.stop_at_step", "4", "--checkpoint.interval", "2",
             "--checkpoint.temp_interval_minutes", "0.00001",
             "--validation.holdout_fraction", "0.1", "--validation.interval", "2", "--validation.generation_eval_path", "")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in recs if x["split"] == "train"] == [1, 2, 3, 4]
    assert [x["step"] for x in recs if x["split"] == "validation"] == [2, 4]
    assert all(x["n_tokens"] == 4 * 256 for x in recs if x["split"] == "train")  # summed over both ranks once
    assert (tmp_path / "run" / "checkpoints-temp").is_dir()


@pytest.mark.slow
def test_a_host_tensor_collective_fails_the_run_as_nccl_would(tmp_path):
    """The check is live in the trainer: an objective whose denominators stay on the host stops the run."""
    plugin = tmp_path / "plugins" / "host_objective.py"
    plugin.parent.mkdir()
    plugin.write_text(
        "import torch\n"
        "from titan_sft.objectives.causal_lm import CausalLM\n"
        "from titan_sft.parallel import comm\n"
        "from titan_sft.registry import register_objective\n\n"
        "class HostCounts(CausalLM):\n"
        "    def begin_step(self, batch, dataset, first):\n"
        "        comm.all_reduce(torch.zeros(2, dtype=torch.float64), group=self.dp_group, what='host counts')\n"
        "        return super().begin_step(batch, dataset, first)\n\n"
        "register_objective('host_counts', HostCounts)\n")
    r = _run(tmp_path / "run", "--training.steps", "2", "--checkpoint.enable", "false", "--job.custom_imports",
             "host_objective", "--objective.name", "host_counts", "--validation.generation_eval_path", "", nproc=1,
             env={"PYTHONPATH": str(plugin.parent)})
    assert r.returncode != 0
    assert "CollectiveDeviceError: host counts: tensor on the host" in r.stderr
