"""MoE on CPU: grouped GEMM vs the per-expert loop, and expert parallel 2 vs 1 on the debug_moe job.

    python benchmarks/bench_moe.py [--tokens 4096 --dim 1024 --ffn 384 --experts 32 --top-k 4 --runs 5]

1. One MoE layer (router, permutation, experts, combine), forward + backward, ``impl = "grouped"`` against
   ``impl = "loop"`` on the same weights and tokens, in bf16 and fp32, and the layer under torch.compile
   (fullgraph, as ``training.compile`` compiles it: bf16 grouped; fp32 the loop, which is what traces) against
   eager; medians of ``--runs`` after a warm-up (the compile is in the warm-up).
2. The debug_moe model for ``--steps`` steps on 2 ranks (gloo, one thread each): ``parallelism.ep = 2`` (tokens
   exchanged by all-to-all) against ``ep = 1`` (FSDP only); median step time of the steps after the first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def time_layer(impl: str, dtype: torch.dtype, a, compiled: bool = False) -> float:
    from titan_sft.models.moe import MoE

    torch.manual_seed(0)
    moe = MoE(a.dim, a.ffn, a.experts, a.top_k, True, impl=impl).to(dtype)
    with torch.no_grad():
        moe.init_weights(0.02, 0.02)
    if compiled:
        torch._dynamo.config.capture_scalar_outputs = True  # as parallelize.apply_compile sets it
        moe = torch.compile(moe, fullgraph=True)
    x = torch.randn(1, a.tokens, a.dim, dtype=dtype, requires_grad=True)
    g = torch.randn(1, a.tokens, a.dim, dtype=dtype)
    times = []
    for i in range(a.runs + 1):
        t = time.perf_counter()
        out = moe(x)[0]
        (out * g).sum().backward()
        if i:  # the first run warms up
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_time(ep: int, steps: int, dump: Path) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "titan_sft.train",
           "--config", "train_configs/debug_moe.toml", "--job.dump_folder", str(dump), "--training.steps",
           str(steps), "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--checkpoint.interval",
           "1000", "--checkpoint.hf_export_interval", "-1", "--validation.generation_eval_path", "",
           "--parallelism.ep", str(ep)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    records = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(r["step_time_s"] for r in records if r["split"] == "train" and r["step"] > 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=384)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    a = ap.parse_args()
    print(f"MoE layer fwd+bwd: {a.tokens} tokens, dim {a.dim}, {a.experts} experts of {a.ffn}, top {a.top_k}; "
          f"median of {a.runs}")
    for dtype in (torch.bfloat16, torch.float32):
        grouped, loop = time_layer("grouped", dtype, a), time_layer("loop", dtype, a)
        print(f"  {str(dtype).removeprefix('torch.')}: grouped GEMM {grouped * 1e3:.1f} ms, per-expert loop "
              f"{loop * 1e3:.1f} ms: grouped / loop = {grouped / loop:.2f}")
        eager = grouped if dtype == torch.bfloat16 else loop
        compiled = time_layer("auto", dtype, a, compiled=True)
        print(f"  {str(dtype).removeprefix('torch.')} compiled ({'grouped' if dtype == torch.bfloat16 else 'loop'}): "
              f"{compiled * 1e3:.1f} ms: compiled / eager = {compiled / eager:.2f}")
    with tempfile.TemporaryDirectory() as d:
        one, two = step_time(1, a.steps, Path(d) / "ep1"), step_time(2, a.steps, Path(d) / "ep2")
    print(f"debug_moe, 2 ranks, median step time: ep 1 {one * 1e3:.1f} ms, ep 2 {two * 1e3:.1f} ms: "
          f"ep2 / ep1 = {two / one:.2f}")


if __name__ == "__main__":
    main()
