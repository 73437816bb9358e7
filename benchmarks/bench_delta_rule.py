"""The chunked gated delta rule (Gated DeltaNet's recurrence): titan_sft's torch implementation
(``models.gated_deltanet.chunk_gated_delta_rule``) vs transformers' torch fallback (``torch_chunk_gated_delta_rule``,
what ``Qwen3_5ForCausalLM`` runs without flash-linear-attention), same inputs, forward and backward; median step
time and peak memory side by side, ratios printed.

    python benchmarks/bench_delta_rule.py --seq-len 2048 --heads 32 --runs 3

Shapes: one Qwen3.5-9B linear-attention layer (32 value heads of 128, keys of 128; q and k already L2-normalised
and repeated to the value heads), fp32 on CPU, bf16 inputs on a GPU. Each variant runs in a fresh process; peak
memory is the growth of the peak RSS over the timed steps (CPU) or the peak allocated (GPU). On a GPU with fla-core
installed, titan_sft runs flash-linear-attention's kernel instead.

    python benchmarks/bench_delta_rule.py --jsonl OUT/gpu_check.jsonl --table OUT/gpu_check.md [--rehearse]

is benchmarks/gpu_check.sh's phase: in one process, Qwen3.5-9B linear-attention layer shapes on packed 2 x 8192-token
rows of ragged documents, bf16, forward and backward: fla's kernel (where fla-core is installed; its record says
skipped otherwise), the torch delta rule (titan_sft's fallback) and transformers' torch fallback, ratios to fla,
and ring context parallel's widened per-segment pass (torch or fla, whichever runs). ``--rehearse``: CPU, tiny.
"""

import argparse
import json

from bench_chunked_ce import timed_peak, variant_row  # benchmarks/ is the script's folder: on sys.path


def run_variant(name: str, a) -> dict:
    import torch

    from titan_sft.models.gated_deltanet import chunk_gated_delta_rule, l2_normalize

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    shape = (1, a.seq_len, a.heads, a.head_dim)
    q, k = (l2_normalize(torch.randn(shape, device=device)).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(shape, device=device, dtype=dtype, requires_grad=True)
    g = (-torch.rand(shape[:3], device=device) * 2).requires_grad_()
    beta = torch.rand(shape[:3], device=device, dtype=dtype).requires_grad_()
    if name == "titan_sft":
        fn = lambda: chunk_gated_delta_rule(q, k, v, g, beta)  # noqa: E731
    else:
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        fn = lambda: torch_chunk_gated_delta_rule(q, k, v, g, beta)[0]  # noqa: E731

    def step():
        out = fn()
        out.float().pow(2).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    seconds, peak = timed_peak(step, a.runs, device)
    return {"variant": name, "seconds": seconds, "peak_gib": peak, "device": device}


def gpu_check(a) -> int:
    """The GPU check's records (one per variant) appended to ``a.jsonl``, the table rewritten after each."""
    import importlib.util
    import time
    from pathlib import Path

    import torch

    from bench_gpu import append_record, kernel_record
    from titan_sft.metrics import peak_flops
    from titan_sft.models import gated_deltanet as gd

    cuda = torch.cuda.is_available() and not a.rehearse
    dev = torch.device("cuda" if cuda else "cpu")
    rows, seq_len, heads, dim = (2, 8192, 32, 128) if cuda else (1, 256, 2, 16)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=dev).manual_seed(0)
    shape = (1, rows * seq_len, heads, dim)
    q, k = (gd.l2_normalize(torch.randn(shape, device=dev, generator=gen)).to(dtype) for _ in range(2))
    v = torch.randn(shape, device=dev, generator=gen, dtype=dtype)
    g = -torch.rand(shape[:3], device=dev, generator=gen) * 0.5
    beta = torch.rand(shape[:3], device=dev, generator=gen).to(dtype)
    inputs = [x.requires_grad_() for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, 1000, 5000, 8192, 8200, 12000, 16384], device=dev)[: 2 + 5 * (rows > 1)]
    cu[-1] = rows * seq_len
    doc = torch.searchsorted(cu, torch.arange(rows * seq_len, device=dev), right=True) - 1
    position = torch.arange(rows * seq_len, device=dev) - cu[:-1][doc]
    fla = cuda and importlib.util.find_spec("fla") is not None

    def transformers_fallback():
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        outs = [torch_chunk_gated_delta_rule(*(x[:, s:e] for x in inputs))[0] for s, e in zip(cu[:-1].tolist(),
                                                                                          cu[1:].tolist())]
        return torch.cat(outs, 1)

    def ring_segments():  # 4 segments per row: ring cp 2's pass on one rank's share of both rows, times 2
        n = rows * 4
        return gd.segment_gated_delta_rule(*(x.reshape(n, -1, *x.shape[2:]) for x in inputs),
                                           position.view(n, -1))[0]

    variants = {"fla": lambda: gd._fla_gated_delta_rule(*inputs, cu.int()),
                "torch": lambda: gd.packed_gated_delta_rule(*inputs, cu_seqlens=cu.int()),
                "transformers": transformers_fallback, "ring_segments": ring_segments}
    flops = 3 * rows * seq_len * gd.gated_delta_rule_flops(seq_len, heads, dim, dim)
    peak = peak_flops(dev)
    jsonl = Path(a.jsonl)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    failed = 0
    for name, fn in variants.items():
        record = {"case": f"delta_rule_{name}", "baseline": "delta_rule_fla" if name != "fla" else None,
                  "note": f"Gated DeltaNet recurrence only ({heads} heads of {dim}{': Qwen3.5-9B' if cuda else ''}), "
                          "fwd+bwd, "
                          f"{rows}x{seq_len} packed" + (", fla if installed" if name == "ring_segments" else "")}
        if name == "fla" and not fla:
            record["skipped"] = "fla-core not installed" if cuda else "CPU"
        else:
            try:
                for _ in range(2 if cuda else 1):  # warm-up (Triton compiles)
                    fn().float().pow(2).sum().backward()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                times = []
                for _ in range(a.runs):
                    t = time.perf_counter()
                    fn().float().pow(2).sum().backward()
                    if cuda:
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                t = sorted(times)[len(times) // 2]
                record.update(kernel_record(t, rows * seq_len, flops, peak, cuda))
            except Exception as e:  # one variant's failure is its line; the others still run
                record["error"] = f"{type(e).__name__}: {e}"[:2000]
                failed += 1
        append_record(jsonl, Path(a.table), record)
    return 1 if failed else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jsonl", help="the GPU check's mode: append its records here")
    ap.add_argument("--table", default="benchmarks/results/gpu_check.md")
    ap.add_argument("--rehearse", action="store_true")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.jsonl:
        raise SystemExit(gpu_check(a))
    if a.variant:
        print(json.dumps(run_variant(a.variant, a)))
        return
    rows = {}
    for name in ("transformers", "titan_sft"):
        rows[name] = variant_row(__file__, name, ["--seq-len", str(a.seq_len), "--heads", str(a.heads),
                                                  "--head-dim", str(a.head_dim), "--runs", str(a.runs)])
        r = rows[name]
        print(f"{name:>12}: {r['seconds']:.3f} s/step (median of {a.runs}), peak +{r['peak_gib']:.2f} GiB ({r['device']})",
              flush=True)
    ours, ref = rows["titan_sft"], rows["transformers"]
    print(f"ratio titan_sft / transformers: time {ours['seconds'] / ref['seconds']:.2f}x, "
          f"memory {ours['peak_gib'] / max(ref['peak_gib'], 1e-9):.2f}x")


if __name__ == "__main__":
    main()
