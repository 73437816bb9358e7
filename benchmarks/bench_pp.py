"""Pipeline parallel side by side on CPU (gloo, 2 ranks): pp 2 (GPipe, 1F1B, Interleaved1F1B) vs FSDP 2 step time
on the debug model and a ~100M Qwen3, and the pipeline's bubble measured against the schedule's theory.

    python benchmarks/bench_pp.py            # ~10 minutes on 2 cores

Each configuration is a real training run (``bench_layouts.measure``: torchrun, the embedded debug data, fp32, 8
packs per step in microbatches of 1; step time is the median of steps 2..N). The measured bubble is the share of
the two cores' time a pp 2 step does not spend on the work one rank does alone: 1 - T(1 rank, 1 thread) /
(2 x T(pp 2, 1 thread per rank)). It counts the activations' send/recv as idle, and it can come out below the
theory: one rank holding the whole model runs slower per FLOP than a stage holding half of it (weights, gradients
and AdamW state that fit the caches better). The theory is (p - 1) / (v m + p - 1) with m = 8 microbatches per
step and v stages per rank.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_layouts import measure  # noqa: E402

SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--flavors", default="debug,100M")
    a = ap.parse_args()
    print(f"{'model':8s} {'layout':26s} {'step s':>8s} {'vs FSDP 2':>9s} {'bubble':>7s} {'theory':>7s} {'step-1 loss':>12s}")
    for flavor in a.flavors.split(","):
        common = ["--model.name", "qwen3_bench", "--model.flavor", flavor, "--training.global_batch_size", "8",
                  "--training.loss_groups", "2"]
        os.environ["BENCH_THREADS"] = "1"
        serial = measure(1, a.steps, common)
        del os.environ["BENCH_THREADS"]
        fsdp = measure(2, a.steps, common)
        rows = [("1 rank, 1 thread", serial, None), ("FSDP 2", fsdp, None)]
        for name, v in SCHEDULES.items():
            r = measure(2, a.steps, common + ["--parallelism.pp", "2", "--parallelism.pp_schedule", name])
            rows.append((f"pp 2 {name}", r, 1 / (v * 8 + 1)))
        for name, r, theory in rows:
            bubble = f"{1 - serial['step_time_s'] / (2 * r['step_time_s']):7.1%}" if theory is not None else f"{'':7s}"
            print(f"{flavor:8s} {name:26s} {r['step_time_s']:8.3f} {r['step_time_s'] / fsdp['step_time_s']:9.2f} "
                  f"{bubble} {f'{theory:7.1%}' if theory is not None else '':>7s} {r['loss_1']:12.6f}")


if __name__ == "__main__":
    main()
