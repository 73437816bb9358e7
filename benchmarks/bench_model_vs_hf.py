"""Native vs transformers forward+backward time on the same Qwen3 config, weights and packed batch.

    python benchmarks/bench_model_vs_hf.py --runs 5          # ~100M-parameter Qwen3, 4096 tokens, CPU fp32, sdpa

The packed batch is 4096 tokens of several documents: the native model takes it as one row with cu_seqlens;
transformers gets the same row with a 4-D boolean block-diagonal mask (what it needs for the same result).
"""

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=768)
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen3Config

    from titan_sft.models import load_hf
    from titan_sft.models.attention import dense_document_mask

    cfg = Qwen3Config(vocab_size=32768, hidden_size=a.hidden, intermediate_size=a.hidden * 3,
                      num_hidden_layers=a.layers, num_attention_heads=12, num_key_value_heads=4, head_dim=64,
                      tie_word_embeddings=True, max_position_embeddings=8192)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    path = tempfile.mkdtemp()
    hf.save_pretrained(path)
    native = load_hf(path).train()
    hf.train()
    n_params = sum(p.numel() for p in native.parameters())
    # five documents of fixed proportions (700/1200/300/900/996 of 4096)
    lens = [a.tokens * k // 4096 for k in (700, 1200, 300, 900)]
    lens.append(a.tokens - sum(lens))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.randint(0, cfg.vocab_size, (1, a.tokens))
    mask = dense_document_mask(cu, a.tokens, causal=True)[None, None]

    def bench(fn):
        times = []
        for _ in range(a.runs + 1):
            t = time.perf_counter()
            fn().float().square().mean().backward()
            times.append(time.perf_counter() - t)
        return statistics.median(times[1:])

    t_native = bench(lambda: native(x, cu_seqlens=cu))
    t_hf = bench(lambda: hf(x, attention_mask=mask).logits)
    print(f"Qwen3 {n_params / 1e6:.0f}M params, {a.tokens} packed tokens, fp32, sdpa, median of {a.runs}")
    print(f"native {t_native:.3f}s   transformers {t_hf:.3f}s   native/transformers time ratio {t_native / t_hf:.2f}")


if __name__ == "__main__":
    main()
