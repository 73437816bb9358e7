"""Masked diffusion: the output head at masked positions only vs full logits, per training step of the head + loss.

One example of a 128-token prompt and a 1,024-token answer, 30% of the answer masked; the decoder's final hidden
states are given (the decoder is the same in both variants), Qwen3-0.6B's head (dim 1024, vocab 151,936, fp32).

* full: logits for every position (``hidden @ W^T``, [1152, 151936]), CE at the masked positions weighted by 1/t,
  as a straightforward implementation (LLaDA's reference code) does;
* selected: titan_sft's ``chunked_cross_entropy_sum(..., rows=masked)``: the head runs at the ~307 masked
  positions only, chunked, the gradient computed in place.

Each variant runs in its own process (so peak RSS is its own); prints the median step time (forward + backward),
the peak RSS above the process's baseline, and the ratios. Run: python benchmarks/bench_diffusion_head.py
"""

from __future__ import annotations

import json
import resource
import statistics
import subprocess
import sys
import time

DIM, VOCAB, PROMPT, ANSWER, FRACTION, STEPS = 1024, 151_936, 128, 1024, 0.30, 5


def run(variant: str) -> dict:
    import torch
    import torch.nn.functional as F

    from titan_sft.loss import chunked_cross_entropy_sum

    torch.manual_seed(0)
    T = PROMPT + ANSWER
    weight = (torch.randn(VOCAB, DIM) * DIM**-0.5).requires_grad_()
    hidden = torch.randn(1, T, DIM).requires_grad_()
    targets_all = torch.randint(0, VOCAB, (T,))
    g = torch.Generator().manual_seed(1)
    masked = PROMPT + torch.nonzero(torch.rand(ANSWER, generator=g) < FRACTION).flatten()
    t = 0.3
    w = torch.full((len(masked),), 1.0 / (t * ANSWER))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(STEPS):
        weight.grad = hidden.grad = None
        t0 = time.perf_counter()
        if variant == "full":
            logits = F.linear(hidden, weight).float()[0]
            ce = F.cross_entropy(logits[masked], targets_all[masked], reduction="none")
            loss = (ce * w).sum()
        else:
            loss = chunked_cross_entropy_sum(hidden, weight, targets_all[masked], 4096, w, rows=masked)
        loss.backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"variant": variant, "median_s": statistics.median(times), "peak_rss_mib": (peak - base) / 1024,
            "masked": len(masked), "loss": loss.item()}


def main() -> None:
    if len(sys.argv) > 1:
        print(json.dumps(run(sys.argv[1])))
        return
    res = {}
    for variant in ("full", "selected"):
        out = subprocess.run([sys.executable, __file__, variant], capture_output=True, text=True, check=True)
        res[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    f, s = res["full"], res["selected"]
    print(f"head + loss per step, 1 example: prompt {PROMPT} + answer {ANSWER} tokens, {s['masked']} masked "
          f"({FRACTION:.0%}), dim {DIM}, vocab {VOCAB:,}, fp32, CPU, {STEPS} steps")
    print(f"{'variant':<10} {'median s':>9} {'peak RSS MiB':>13} {'loss':>10}")
    for r in (f, s):
        print(f"{r['variant']:<10} {r['median_s']:>9.3f} {r['peak_rss_mib']:>13.0f} {r['loss']:>10.4f}")
    print(f"selected / full: time {s['median_s'] / f['median_s']:.2f}x, peak memory "
          f"{s['peak_rss_mib'] / max(f['peak_rss_mib'], 1e-9):.2f}x (same loss: {abs(s['loss'] - f['loss']) < 1e-3})")


if __name__ == "__main__":
    main()
