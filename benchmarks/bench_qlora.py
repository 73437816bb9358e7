"""bf16 LoRA vs NF4 QLoRA (``lora.base_quant = "nf4"``) on the same Qwen3-shaped model: median training-step time,
the parameters' bytes and the process's peak memory, side by side, ratios printed.

    python benchmarks/bench_qlora.py --dim 1024 --layers 8 --seq-len 512 --runs 3

One step is a forward, backward and AdamW step of a rank-16 LoRA on all seven projections (norms trained) over one
row of ``seq-len`` tokens, the whole model in bf16 (as FSDP computes it with ``param_dtype = "bfloat16"``). Each
variant runs in a fresh process on the CPU (a GPU when there is one); "peak" is the process's peak resident memory
above what it held before building the model (CPU: VmHWM) or the peak allocated (GPU), so it includes the model,
its gradients, the optimizer state and the activations. The NF4 step also
dequantizes every frozen weight, forward and backward: on a CPU that work is visible in the time.
"""

import argparse
import json

from bench_chunked_ce import timed_peak, variant_row  # benchmarks/ is the script's folder: on sys.path


def run_variant(quant: str, a) -> dict:
    import dataclasses

    import torch

    from titan_sft.config import load_config
    from titan_sft.lora import apply_lora
    from titan_sft.optimizer import build_optimizer
    from titan_sft.registry import get_train_spec

    from bench_chunked_ce import _status_kib

    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = 0 if device == "cuda" else _status_kib("VmRSS") / 2**20  # the interpreter and torch, before the model
    spec = get_train_spec("qwen3")
    args = dataclasses.replace(spec.flavors["debug"], dim=a.dim, n_layers=a.layers, n_heads=a.dim // 128,
                               n_kv_heads=max(1, a.dim // 512), head_dim=128, ffn_dim=3 * a.dim,
                               vocab_size=a.vocab, max_seq_len=a.seq_len)
    cfg = load_config(None, ["--model.converters", "lora", "--lora.rank", "16", "--lora.base_quant", quant,
                             "--training.param_dtype", "bfloat16"])
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model_cls(args)
        model.init_weights()
    model.to(torch.bfloat16)
    apply_lora(model, cfg)  # a materialized model: NF4 weights are quantized on the spot
    for m in model.modules():
        if hasattr(m, "reset_converter_parameters"):
            m.reset_converter_parameters(0)
    model.to(torch.bfloat16)  # the adapters too (integer NF4 codes are left as they are)
    opt = build_optimizer(model, cfg.optimizer)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randint(0, a.vocab, (1, a.seq_len), device=device)

    def step():
        model(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up (and the optimizer state)
    seconds, _ = timed_peak(step, a.runs, device)
    if device == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = _status_kib("VmHWM") / 2**20 - start
    return {"variant": quant, "seconds": seconds, "params_gib": params / 2**30, "peak_gib": peak, "device": device}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.variant:
        print(json.dumps(run_variant(a.variant, a)))
        return
    rows = {}
    for name in ("none", "nf4"):
        rows[name] = r = variant_row(__file__, name, ["--dim", str(a.dim), "--layers", str(a.layers), "--vocab",
                                                      str(a.vocab), "--seq-len", str(a.seq_len), "--runs", str(a.runs)])
        label = "bf16 LoRA" if name == "none" else "NF4 QLoRA"
        print(f"{label:>10}: {r['seconds']:.3f} s/step (median of {a.runs}), parameters {r['params_gib']:.3f} GiB, "
              f"peak {r['peak_gib']:.2f} GiB ({r['device']})", flush=True)
    q, b = rows["nf4"], rows["none"]
    print(f"ratio QLoRA / LoRA: time {q['seconds'] / b['seconds']:.2f}x, parameters "
          f"{q['params_gib'] / b['params_gib']:.2f}x, peak memory {q['peak_gib'] / b['peak_gib']:.2f}x")


if __name__ == "__main__":
    main()
