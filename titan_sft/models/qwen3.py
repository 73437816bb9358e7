"""Qwen3 dense flavors (numbers from each model's official config.json)."""

from __future__ import annotations

from titan_sft.models.transformer import TransformerArgs


def _qwen3(dim: int, ffn: int, layers: int, heads: int, tied: bool) -> TransformerArgs:
    return TransformerArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=ffn,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1_000_000.0,
        qk_norm=True,
        tie_embeddings=tied,
        max_seq_len=40960,
        extra={"bos_token_id": 151643, "eos_token_id": 151645},
    )


QWEN3_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny model for CPU debug runs and tests; vocab covers the embedded debug tokenizer (261 tokens). RoPE theta
    # 1e4 rather than Qwen3's 1e6: with head_dim 32 and short rows it gives the debug task sharper positions.
    "debug": TransformerArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=512,
        norm_eps=1e-6, rope_theta=10_000.0, qk_norm=True, tie_embeddings=True, max_seq_len=4096,
    ),
    "0.6B": _qwen3(1024, 3072, 28, 16, tied=True),
    "1.7B": _qwen3(2048, 6144, 28, 16, tied=True),
    "4B": _qwen3(2560, 9728, 36, 32, tied=True),
    "8B": _qwen3(4096, 12288, 36, 32, tied=False),
    "14B": _qwen3(5120, 17408, 40, 40, tied=False),
    "32B": _qwen3(5120, 25600, 64, 64, tied=False),
}
