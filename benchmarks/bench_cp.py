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
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_layouts import measure as run_layout  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def measure(data: str, nproc: int, steps: int, overrides: list[str]) -> dict:
    """One training run (bench_layouts' child): the ~50M flavor on one pack of ``data`` per step."""
    return run_layout(nproc, steps, ["--model.name", "qwen3_bench", "--model.flavor", "50M", "--data.path", data,
                                     "--training.global_batch_size", "1", "--training.loss_groups", "1",
                                     "--training.loss_chunk_size", "2048", *overrides])


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
    main()
