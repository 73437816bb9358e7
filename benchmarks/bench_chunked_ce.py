"""Chunked vs naive cross-entropy (forward + backward), and the chunked loss eager vs compiled
(``training.compile_loss``): peak memory and time, side by side, ratios printed.

    python benchmarks/bench_chunked_ce.py --tokens 8192 --hidden 2048 --vocab 151936 --runs 5

Peak memory is the peak RSS growth during the timed runs of a fresh subprocess per variant (CPU; the compiled
variant's first, compiling call is excluded), or torch.cuda.max_memory_allocated on GPU.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _status_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def one(variant: str, n: int, d: int, v: int, chunk: int, runs: int, device: str, dtype: str) -> dict:
    import torch

    from titan_sft.loss import chunked_cross_entropy_sum, naive_cross_entropy_sum

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    h = torch.randn(n, d, device=device).to(dt).requires_grad_()
    w = (torch.randn(v, d, device=device) * d**-0.5).to(dt).requires_grad_()
    y = torch.randint(0, v, (n,), device=device)

    def step():
        h.grad = w.grad = None
        if variant == "naive":
            loss = naive_cross_entropy_sum(h, w, y)
        else:
            loss = chunked_cross_entropy_sum(h, w, y, chunk, compiled=variant == "compiled")
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()

    if variant == "compiled":  # the first call compiles: neither timed nor counted in the peak
        step()
        h.grad = w.grad = None
    median, peak = timed_peak(step, runs, device)
    return {"variant": variant, "median_s": median, "peak_extra_gib": peak}


def variant_row(script: str, name: str, argv: list[str]) -> dict:
    """Runs ``script --variant name *argv`` in a fresh process; the JSON object its last line prints."""
    cmd = [sys.executable, script, "--variant", name, *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed_peak(step, runs: int, device: str) -> tuple[float, float]:
    """(median seconds of ``runs`` calls of ``step``, peak extra memory in GiB over them): the peak allocated on a
    GPU, else the growth of the peak RSS (VmHWM, reset to the current RSS first)."""
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark (VmHWM) to the current RSS
            f.write("5")
        base = _status_kib("VmRSS")
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    if device == "cuda":
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    else:
        peak = (_status_kib("VmHWM") - base) / 2**20
    return statistics.median(times), peak


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
        # a fixed mmap threshold: glibc returns freed chunk buffers to the OS, so RSS peaks are comparable
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
        out = subprocess.run([sys.executable, __file__, "--child", variant, *sys.argv[1:]], capture_output=True,
                             text=True, check=True, env=env).stdout.strip().splitlines()[-1]
        res[variant] = json.loads(out)
        print(f"{variant:8s} median {res[variant]['median_s']:.3f}s  peak extra memory {res[variant]['peak_extra_gib']:.2f} GiB")
    print(f"memory ratio naive/chunked: {res['naive']['peak_extra_gib'] / max(res['chunked']['peak_extra_gib'], 1e-9):.1f}x; "
          f"time ratio chunked/naive: {res['chunked']['median_s'] / res['naive']['median_s']:.2f}x")
    print(f"compiled/eager chunked: time {res['compiled']['median_s'] / res['chunked']['median_s']:.2f}x, "
          f"memory {res['compiled']['peak_extra_gib'] / max(res['chunked']['peak_extra_gib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
