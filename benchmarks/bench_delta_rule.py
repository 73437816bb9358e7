"""The chunked gated delta rule (Gated DeltaNet's recurrence): titan_sft's torch implementation
(``models.gated_deltanet.chunk_gated_delta_rule``) vs transformers' torch fallback (``torch_chunk_gated_delta_rule``,
what ``Qwen3_5ForCausalLM`` runs without flash-linear-attention), same inputs, forward and backward; median step
time and peak memory side by side, ratios printed.

    python benchmarks/bench_delta_rule.py --seq-len 2048 --heads 32 --runs 3

Shapes: one Qwen3.5-9B linear-attention layer (32 value heads of 128, keys of 128; q and k already L2-normalised
and repeated to the value heads), fp32 on CPU, bf16 inputs on a GPU. Each variant runs in a fresh process; peak
memory is the growth of the peak RSS over the timed steps (CPU) or the peak allocated (GPU). On a GPU with fla-core
installed, titan_sft runs flash-linear-attention's kernel instead (benchmarks/gpu_check.sh times it).
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
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
