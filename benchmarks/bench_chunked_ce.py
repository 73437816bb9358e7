"""Chunked vs naive cross-entropy (forward + backward), and the chunked loss eager vs compiled
(``training.compile_loss``): peak memory and time, side by side, ratios printed.

    python benchmarks/bench_chunked_ce.py --tokens 8192 --hidden 2048 --vocab 151936 --runs 5

Peak memory is measured as the peak RSS growth of a fresh subprocess per variant (CPU), or
torch.cuda.max_memory_allocated on GPU.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


def one(variant: str, n: int, d: int, v: int, chunk: int, runs: int, device: str, dtype: str) -> dict:
    import resource

    import torch

    from titan_sft.loss import chunked_cross_entropy_sum, naive_cross_entropy_sum

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(n, d, device=device).to(dt).requires_grad_()
    w = (torch.randn(v, d, device=device) * d**-0.5).to(dt).requires_grad_()
    y = torch.randint(0, v, (n,), device=device)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    times = []
    for _ in range(runs + (variant == "compiled")):  # the compiled variant's first run compiles: not timed
        h.grad = w.grad = None
        t = time.perf_counter()
        if variant == "naive":
            loss = naive_cross_entropy_sum(h, w, y)
        else:
            loss = chunked_cross_entropy_sum(h, w, y, chunk, compiled=variant == "compiled")
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times = times[variant == "compiled":]
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base_cuda) / 2**30
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2**20
    return {"variant": variant, "median_s": statistics.median(times), "peak_extra_gib": peak}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--child", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child, a.tokens, a.hidden, a.vocab, a.chunk, a.runs, a.device, a.dtype)))
        return
    res = {}
    for variant in ("naive", "chunked", "compiled"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, *sys.argv[1:]], capture_output=True,
                             text=True, check=True).stdout.strip().splitlines()[-1]
        res[variant] = json.loads(out)
        print(f"{variant:8s} median {res[variant]['median_s']:.3f}s  peak extra memory {res[variant]['peak_extra_gib']:.2f} GiB")
    print(f"memory ratio naive/chunked: {res['naive']['peak_extra_gib'] / max(res['chunked']['peak_extra_gib'], 1e-9):.1f}x; "
          f"time ratio chunked/naive: {res['chunked']['median_s'] / res['naive']['median_s']:.2f}x")
    print(f"compiled/eager chunked: time {res['compiled']['median_s'] / res['chunked']['median_s']:.2f}x, "
          f"memory {res['compiled']['peak_extra_gib'] / max(res['chunked']['peak_extra_gib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
