"""Step time before and after a checkpoint save, and after a resume (the post-save slowdown of issue 14).

    python benchmarks/bench_save_slowdown.py            # debug model, 1 process on all cores, ~2 minutes

Each run trains the debug config for 100 steps with a checkpoint at step 41 (label 40); the ratio is the median
step time of steps 50-99 over steps 10-39. A resume run continues a 40-step run to 100 and compares its steps
50-99 with the straight run's steps 10-39. Goal: every ratio at most 1.1.
"""

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMON = ["--training.steps", "100", "--checkpoint.interval", "40", "--checkpoint.hf_export_interval", "-1",
          "--checkpoint.temp_interval_minutes", "0", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
          "false", "--validation.generation_eval_path", "", "--checkpoint.resume", "auto"]


def train(dump: str, *extra: str) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": str(os.cpu_count())}
    cmd = [sys.executable, "-m", "titan_sft.train", "--config", "train_configs/debug_model.toml", *COMMON,
           "--job.dump_folder", dump, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
    rows = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["step_time_s"] for r in rows}


def median(times: dict, lo: int, hi: int) -> float:
    return statistics.median(times[s] for s in range(lo, hi + 1) if s in times)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = {}
        for mode in ("disabled", "async"):
            t = train(f"{tmp}/{mode}", "--checkpoint.async_mode", mode)
            results[f"{mode} save"] = (median(t, 10, 39), median(t, 50, 99))
        t = train(f"{tmp}/resume", "--training.stop_at_step", "40")
        t = train(f"{tmp}/resume")
        results["resume"] = (results["disabled save"][0], median(t, 50, 99))
    print(f"{'run':16s} {'before':>9s} {'after':>9s} {'ratio':>6s}   (median step time, s)")
    for name, (before, after) in results.items():
        print(f"{name:16s} {before:9.3f} {after:9.3f} {after / before:6.2f}")


if __name__ == "__main__":
    main()
