"""Activation checkpointing modes and per-block compile side by side on CPU: step time and peak memory of a
~90M Qwen3 (benchmarks/bench_families.py), one process on all cores, 4 packs of 256 tokens per step.

    python benchmarks/bench_ac_compile.py          # ~6 minutes on 2 cores

Ratios are against no AC, eager. Peak memory is the process's largest resident set (ru_maxrss), which includes
the ~1 GiB of weights, gradients and AdamW state every mode shares.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_layouts import measure  # noqa: E402

COMMON = ["--model.name", "qwen3_bench", "--model.flavor", "100M", "--training.global_batch_size", "4",
          "--training.loss_groups", "1"]
CASES = [("no AC, eager", []), ("AC full", ["--training.activation_checkpoint", "full"]),
         ("AC selective (op)", ["--training.activation_checkpoint", "selective"]),
         ("AC every 2nd block", ["--training.activation_checkpoint", "every_n"]),
         ("compile (fullgraph), no AC", ["--training.compile", "true"])]


def main() -> None:
    rows = [(name, measure(1, 5, COMMON + extra)) for name, extra in CASES]
    base = rows[0][1]
    print(f"{'case':30s} {'step s':>8s} {'ratio':>6s} {'peak RSS MiB':>13s} {'ratio':>6s}")
    for name, r in rows:
        print(f"{name:30s} {r['step_time_s']:8.2f} {r['step_time_s'] / base['step_time_s']:6.2f} "
              f"{r['peak_rss_mib']:13.0f} {r['peak_rss_mib'] / base['peak_rss_mib']:6.2f}")


if __name__ == "__main__":
    main()
