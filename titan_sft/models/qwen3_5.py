"""Qwen3.5 flavors, dense and MoE (numbers from each model's official config; their language model only).

The hybrid decoder: three of every four layers are Gated DeltaNet (``models.gated_deltanet``), the fourth full
attention with q/k norms, an output gate and RoPE on a quarter of each head (theta 1e7); every RMSNorm scales by
``1 + weight``. The MoE flavors route every layer's tokens to 8 (397B: 10) of 256 (512) experts beside a
sigmoid-gated shared expert.
"""

from __future__ import annotations

from titan_sft.models.transformer import TransformerArgs


def hybrid_layers(n_layers: int, every: int = 4) -> list[str]:
    """transformers' default pattern: layer i is full attention when (i + 1) is a multiple of ``every``."""
    return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]


def _qwen3_5(dim: int, layers: int, heads: int, kv_heads: int, v_heads: int, ffn: int = 0, tied: bool = False,
             experts: int = 0, top_k: int = 0, moe_ffn: int = 0) -> TransformerArgs:
    return TransformerArgs(
        dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, head_dim=256, ffn_dim=ffn, vocab_size=248320,
        norm_eps=1e-6, rope_theta=10_000_000.0, qk_norm=True, tie_embeddings=tied, max_seq_len=262144,
        layer_types=hybrid_layers(layers), attn_output_gate=True, partial_rotary_factor=0.25, norm_offset=True,
        linear_n_k_heads=16, linear_n_v_heads=v_heads, linear_k_head_dim=128, linear_v_head_dim=128,
        linear_conv_kernel=4, n_experts=experts, n_experts_per_tok=top_k, moe_ffn_dim=moe_ffn,
        shared_expert_ffn_dim=moe_ffn, norm_topk_prob=True, router_aux_loss_coef=0.001 if experts else 0.0,
        extra={"bos_token_id": 248044, "eos_token_id": 248044},
    )


# The debug flavors: the Qwen3 debug model's sizes (dim 128, 4 heads of 32, vocab 512 for the embedded debug
# tokenizer) in the hybrid pattern (layers 0-2 Gated DeltaNet, 3 full attention), two key heads serving four value
# heads, RoPE on 8 of 32 dimensions; tied like the small released models.
_DEBUG = dict(dim=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=384, vocab_size=512, norm_eps=1e-6,
              rope_theta=10_000.0, qk_norm=True, tie_embeddings=True, max_seq_len=4096, layer_types=hybrid_layers(4),
              attn_output_gate=True, partial_rotary_factor=0.25, norm_offset=True, linear_n_k_heads=2,
              linear_n_v_heads=4, linear_k_head_dim=32, linear_v_head_dim=32, linear_conv_kernel=4)

QWEN3_5_FLAVORS: dict[str, TransformerArgs] = {
    "debug": TransformerArgs(**_DEBUG),
    "0.8B": _qwen3_5(1024, 24, 8, 2, 16, ffn=3584, tied=True),
    "2B": _qwen3_5(2048, 24, 8, 2, 16, ffn=6144, tied=True),
    "4B": _qwen3_5(2560, 32, 16, 4, 32, ffn=9216, tied=True),
    "9B": _qwen3_5(4096, 32, 16, 4, 32, ffn=12288),
    "27B": _qwen3_5(5120, 64, 24, 4, 48, ffn=17408),
}

QWEN3_5_MOE_FLAVORS: dict[str, TransformerArgs] = {
    # 8 experts of 128, top 2, a shared expert of 128, every layer routed (as the released MoE models).
    "debug_moe": TransformerArgs(**{**_DEBUG, "ffn_dim": 0}, n_experts=8, n_experts_per_tok=2, moe_ffn_dim=128,
                                 shared_expert_ffn_dim=128, norm_topk_prob=True, router_aux_loss_coef=0.001),
    "35B-A3B": _qwen3_5(2048, 40, 16, 2, 32, experts=256, top_k=8, moe_ffn=512),
    "122B-A10B": _qwen3_5(3072, 48, 32, 2, 64, experts=256, top_k=8, moe_ffn=1024),
    "397B-A17B": _qwen3_5(4096, 60, 32, 2, 64, experts=512, top_k=10, moe_ffn=1024),
}
