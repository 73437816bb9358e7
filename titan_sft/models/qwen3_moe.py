"""Qwen3-MoE flavors (numbers from each model's official config.json): the Qwen3 decoder with routed experts in
every layer (decoder_sparse_step 1, no mlp_only_layers), 128 experts of which 8 per token, top-k renormalised."""

from __future__ import annotations

from titan_sft.models.transformer import TransformerArgs


def _qwen3_moe(dim: int, layers: int, heads: int, ffn: int, moe_ffn: int) -> TransformerArgs:
    return TransformerArgs(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=4, head_dim=128, ffn_dim=ffn, vocab_size=151936,
        norm_eps=1e-6, rope_theta=1_000_000.0, qk_norm=True, tie_embeddings=False, max_seq_len=40960,
        n_experts=128, n_experts_per_tok=8, moe_ffn_dim=moe_ffn, norm_topk_prob=True, router_aux_loss_coef=0.001,
        extra={"bos_token_id": 151643, "eos_token_id": 151645},
    )


QWEN3_MOE_FLAVORS: dict[str, TransformerArgs] = {
    # Tiny MoE for CPU tests and the debug job: the dense debug model's attention, 8 experts of 128, top 2, and a
    # dense first layer (mlp_only_layers) so that both MLP kinds are exercised. Vocab covers the debug tokenizer.
    "debug_moe": TransformerArgs(
        dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=512, norm_eps=1e-6,
        rope_theta=10_000.0, qk_norm=True, tie_embeddings=True, max_seq_len=4096, n_experts=8, n_experts_per_tok=2,
        moe_ffn_dim=128, norm_topk_prob=True, mlp_only_layers=[0], router_aux_loss_coef=0.001,
    ),
    "30B-A3B": _qwen3_moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _qwen3_moe(4096, 94, 64, 12288, 1536),
}
