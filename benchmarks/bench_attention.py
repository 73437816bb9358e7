"""Attention alone, forward + backward, on packed rows: every backend present side by side (sdpa with a dense
document mask, compiled flex, torch's varlen, flash-attn's varlen), Qwen3-4B's heads (32 query, 8 key/value, head
dim 128), two 8k rows of documents of 256-4096 tokens, causal, bf16. benchmarks/gpu_check.sh's phase (d).

    python benchmarks/bench_attention.py --jsonl OUT/gpu_check.jsonl --table OUT/gpu_check.md [--rehearse]

Prints and appends one JSON line per backend: median milliseconds over 10 timed iterations (3 warm-up), tokens/s,
TFLOP/s by the pairs each document really has (n (n + 1) / 2 per causal document, 4 * H * D FLOPs per pair
forward, twice that backward: titan_sft.metrics' count) and the ratio to varlen. ``--rehearse``: CPU, tiny
shapes, sdpa and flex forward only (flex has no CPU backward).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def doc_boundaries(rows: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """cu_seqlens over ``rows`` packed rows, documents as in bench_gpu's synthetic dataset."""
    from bench_gpu import packed_doc_lengths

    lens = [n for pack in packed_doc_lengths(rows, seq_len, np.random.default_rng(seed)) for n in pack]
    return torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)


def time_backend(name: str, q, k, v, cu, rows, seq_len, backward: bool, iters: int = 10, warmup: int = 3) -> float:
    from titan_sft.models.attention import AttentionBackend

    backend = AttentionBackend(name, causal=True)
    if not backward:
        q, k, v = q.detach(), k.detach(), v.detach()
    mask = backend.prepare(rows, seq_len, q.device, cu.to(q.device))
    sync = torch.cuda.synchronize if q.is_cuda else (lambda: None)
    times = []
    for i in range(warmup + iters):
        sync()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(backward):
            out = backend(q, k, v, mask)
        if backward:
            out.backward(torch.ones_like(out))
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        for x in (q, k, v):
            x.grad = None
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jsonl", default="benchmarks/results/gpu_check.jsonl")
    ap.add_argument("--table", default="benchmarks/results/gpu_check.md")
    ap.add_argument("--rehearse", action="store_true")
    a = ap.parse_args()
    from bench_gpu import append_record, kernel_record
    from titan_sft.metrics import peak_flops

    cuda = torch.cuda.is_available() and not a.rehearse
    dev = torch.device("cuda" if cuda else "cpu")
    rows, seq_len, h, hkv, d = (2, 8192, 32, 8, 128) if cuda else (2, 256, 4, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    cu = doc_boundaries(rows, seq_len)
    n = (cu[1:] - cu[:-1]).long()
    pairs = int((n * (n + 1) // 2).sum())
    torch.manual_seed(0)
    q = torch.randn(rows, h, seq_len, d, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(rows, hkv, seq_len, d, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(rows, hkv, seq_len, d, device=dev, dtype=dtype, requires_grad=True)
    if cuda:
        names = ["varlen", "sdpa", "flex"] + (["flash_varlen"] if importlib.util.find_spec("flash_attn") else [])
    else:
        names = ["sdpa", "flex"]
    peak = peak_flops(dev)
    results = {}
    jsonl = Path(a.jsonl)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    for name in names:
        backward = cuda or name != "flex"
        record = {"case": f"attention_{name}", "baseline": "attention_varlen" if name != "varlen" and cuda else None,
                  "note": f"attention only, {'fwd+bwd' if backward else 'forward'}, {rows}x{seq_len} packed"}
        try:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            t = time_backend(name, q, k, v, cu, rows, seq_len, backward)
            flops = pairs * 4 * h * d * (3 if backward else 1)
            record.update(kernel_record(t, rows * seq_len, flops, peak, cuda))
        except Exception as e:  # one backend's failure is its line; the others still run
            record["error"] = f"{type(e).__name__}: {e}"[:2000]
        results[name] = record
        append_record(jsonl, Path(a.table), record)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
