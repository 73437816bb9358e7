"""Context parallel side by side on CPU: one rank vs cp 2 (Ulysses, and ring) on 8192-token packed rows of a ~50M
Qwen3, step time and peak memory per rank.

    python benchmarks/bench_cp.py                 # ~15 minutes on 2 cores
    python benchmarks/bench_cp.py --seq-len 4096  # ~5 minutes

Each configuration is a real training run (``python -m titan_sft.train``, the embedded debug chat data packed at
``--seq-len`` into a temporary directory, one pack per step, fp32, sdpa with the documents' mask) on the same 2
cores: one rank with 2 threads, or 2 ranks with one thread each. Step time is the median of steps 2..N; peak
memory is the largest resident set of any rank (ru_maxrss), which includes the weights, gradients and AdamW state
(sharded over the cp ranks by FSDP); the activations' share is what cp divides. The first step's loss is printed
for each layout: they agree (context parallel is exact).
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


def child(data: str, nproc: int, steps: int, overrides: list[str]) -> None:
    """Runs one training job; prints its median step time, first loss and the peak RSS of its ranks."""
    with tempfile.TemporaryDirectory() as dump:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m",
               "titan_sft.train", "--config", "train_configs/debug_model.toml", "--job.custom_imports", "bench_families",
               "--model.name", "qwen3_bench", "--model.flavor", "50M", "--data.path", data,
               "--training.steps", str(steps), "--training.global_batch_size", "1", "--training.loss_groups", "1",
               "--training.param_dtype", "float32", "--training.loss_chunk_size", "2048",
               "--checkpoint.enable", "false", "--checkpoint.hf_export_interval", "-1",
               "--validation.generation_eval_path", "", "--metrics.enable_tensorboard", "false",
               "--metrics.log_freq", "1", "--training.skip_startup_checks", "true", "--job.dump_folder", dump,
               *overrides]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "benchmarks"), "OMP_NUM_THREADS": str(max(1, 2 // nproc))}
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stdout[-2000:] + proc.stderr[-2000:])
        records = [json.loads(x) for x in (Path(dump) / "metrics.jsonl").read_text().splitlines()]
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # MiB, the largest rank
    print(json.dumps({"step_time_s": statistics.median(r["step_time_s"] for r in records[1:]),
                      "loss_1": records[0]["loss"], "peak_rss_mib": peak}))


def measure(data: str, nproc: int, steps: int, overrides: list[str]) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", data, str(nproc), str(steps), *overrides],
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{overrides}: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "packed")
        subprocess.run([sys.executable, "-m", "titan_sft.data.prepare", "--input", "titan_sft/assets/debug_data/train.jsonl",
                        "--tokenizer", "titan_sft/assets/debug_tokenizer", "--seq-len", str(a.seq_len), "--out", data,
                        "--quiet"], cwd=ROOT, check=True, capture_output=True)
        rows = [("1 rank (2 threads)", measure(data, 1, a.steps, [])),
                ("cp 2 ulysses (2 x 1 thread)", measure(data, 2, a.steps, ["--parallelism.cp", "2"])),
                ("cp 2 ring (2 x 1 thread)", measure(data, 2, a.steps, ["--parallelism.cp", "2",
                                                                         "--parallelism.cp_mode", "ring"]))]
    base = rows[0][1]
    print(f"~50M Qwen3, one packed row of {a.seq_len:,} tokens per step, fp32, sdpa; median of steps 2..{a.steps}")
    print(f"{'layout':30s} {'step s':>8s} {'ratio':>6s} {'peak RSS/rank MiB':>18s} {'ratio':>6s} {'step-1 loss':>12s}")
    for name, r in rows:
        print(f"{name:30s} {r['step_time_s']:8.2f} {r['step_time_s'] / base['step_time_s']:6.2f} "
              f"{r['peak_rss_mib']:18.0f} {r['peak_rss_mib'] / base['peak_rss_mib']:6.2f} {r['loss_1']:12.6f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5:])
    else:
        main()
