"""Layouts side by side on CPU (gloo, 2 ranks): FSDP 2 vs TP 2 step time and peak memory per rank, and the gradient
memory of the two microbatch policies (reduce-scatter every microbatch vs only after the last).

    python benchmarks/bench_layouts.py                 # debug model and a ~100M Qwen3, a few minutes on 2 cores

Each configuration is a real training run (``python -m titan_sft.train`` under torchrun on the embedded debug
data); step time is the median over steps 2..N, peak memory the largest resident set of any rank (ru_maxrss).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(nproc: int, steps: int, overrides: list[str]) -> None:
    """Runs one training job and prints its median step time, first loss and the peak RSS of its ranks."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "titan_sft.train", "--config", "train_configs/debug_model.toml", "--job.custom_imports", "bench_families",
               "--training.steps", str(steps), "--training.param_dtype", "float32", "--checkpoint.enable", "false",
               "--checkpoint.hf_export_interval", "-1", "--validation.generation_eval_path", "",
               "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "1", "--training.skip_startup_checks", "true",
               "--job.dump_folder", dump, *overrides]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks"), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", str(max(1, 2 // nproc)))}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # MiB, the largest rank
    print(json.dumps({"step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
                      "loss_1": records[0]["loss"], "peak_rss_mib": peak}))


def measure(nproc: int, steps: int, overrides: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", str(nproc), str(steps), *overrides],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{overrides}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    rows = []
    for flavor, gbs in (("debug", 8), ("100M", 4)):
        common = ["--model.name", "qwen3_bench", "--model.flavor", flavor, "--training.global_batch_size", str(gbs),
                  "--training.loss_groups", "1"]
        fsdp = measure(2, a.steps, common)
        tp = measure(2, a.steps, common + ["--parallelism.tp", "2"])
        rows.append((f"{flavor}: TP 2 / FSDP 2", tp, fsdp))
    common = ["--model.name", "qwen3_bench", "--model.flavor", "100M", "--training.global_batch_size", "8",
              "--training.loss_groups", "1"]  # 2 ranks x 4 microbatches of 1 pack
    every = measure(2, 2, common)
    last = measure(2, 2, common + ["--parallelism.grad_reduce", "last_microbatch"])
    rows.append(("100M, 4 microbatches: last_microbatch / per_microbatch", last, every))
    print(f"{'comparison':58s} {'step time':>22s} {'peak RSS per rank (MiB)':>30s}")
    for name, a_, b in rows:
        print(f"{name:58s} {a_['step_time_s']:8.2f}s / {b['step_time_s']:6.2f}s = {a_['step_time_s'] / b['step_time_s']:4.2f}"
              f"   {a_['peak_rss_mib']:7.0f} / {b['peak_rss_mib']:7.0f} = {a_['peak_rss_mib'] / b['peak_rss_mib']:4.2f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])
    else:
        main()
