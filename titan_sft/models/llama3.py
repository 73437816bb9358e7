"""Llama 3.1 flavors (numbers from the official config.json files)."""

from __future__ import annotations

from titan_sft.models.transformer import RopeScaling, TransformerArgs


def _llama31(dim: int, ffn: int, layers: int, heads: int) -> TransformerArgs:
    return TransformerArgs(
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        n_kv_heads=8,
        head_dim=dim // heads,
        ffn_dim=ffn,
        vocab_size=128256,
        norm_eps=1e-5,
        rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        qk_norm=False,
        tie_embeddings=False,
        max_seq_len=131072,
        extra={"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
    )


LLAMA3_FLAVORS: dict[str, TransformerArgs] = {
    "debug": TransformerArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=512,
        norm_eps=1e-5, rope_theta=500_000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=256),
        qk_norm=False, tie_embeddings=False, max_seq_len=4096,
    ),
    "8B": _llama31(4096, 14336, 32, 32),
    "70B": _llama31(8192, 28672, 80, 64),
}
