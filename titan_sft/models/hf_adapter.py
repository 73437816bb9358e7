"""Native <-> Hugging Face conversion: tensor names, tied embeddings, and config.json <-> TransformerArgs.

The native model rotates RoPE halves exactly as HF does, so no tensor changes layout; only names move. A tied
HF checkpoint has no ``lm_head.weight``: the embedding is the head. Reading and writing files lives in
``titan_sft.hf_io``; this module only maps names and config fields.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_sft.models.transformer import RopeScaling, TransformerArgs

# (native regex, HF template); {i} is the layer index.
_LAYER_MAP = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",  # mixture of experts: the router
}
_TOP_MAP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_HF_LAYER_MAP = {v: k for k, v in _LAYER_MAP.items()}
_HF_TOP_MAP = {v: k for k, v in _TOP_MAP.items()}
_NATIVE_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Mixture of experts: experts stacked natively [E, out, in], one tensor per expert in HF files.
EXPERT_MAP = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}  # native stacked name -> HF per-expert name
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|down_proj|up_proj)\.weight$")
_NATIVE_EXPERT = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w1|w2|w3)$")
# The aux-loss-free routing bias: Qwen3-MoE's HF format has no tensor for it (transformers and vLLM route by the
# router's probabilities alone), so it travels beside the weights in ROUTING_BIAS_FILE, layer index -> E floats.
ROUTING_BIAS_FILE = "routing_bias.json"
_NATIVE_ROUTING_BIAS = re.compile(r"^layers\.(\d+)\.feed_forward\.router\.expert_bias$")


def routing_bias_layer(native_name: str) -> int | None:
    """The layer index of a native routing-bias buffer's name; None for any other name."""
    m = _NATIVE_ROUTING_BIAS.match(native_name)
    return int(m.group(1)) if m else None


def routing_bias_name(layer: int) -> str:
    return f"layers.{layer}.feed_forward.router.expert_bias"


def native_to_hf_name(name: str) -> str:
    if name in _TOP_MAP:
        return _TOP_MAP[name]
    m = _NATIVE_LAYER.match(name)
    if m and m.group(2) in _LAYER_MAP:
        return f"model.layers.{m.group(1)}.{_LAYER_MAP[m.group(2)]}"
    raise KeyError(f"no HF name for native tensor '{name}'")


def hf_to_native_name(name: str) -> str:
    if name in _HF_TOP_MAP:
        return _HF_TOP_MAP[name]
    m = _HF_LAYER.match(name)
    if m and m.group(2) in _HF_LAYER_MAP:
        return f"layers.{m.group(1)}.{_HF_LAYER_MAP[m.group(2)]}"
    raise KeyError(f"unknown HF tensor '{name}'")


def expert_slot(hf_name: str) -> tuple[str, int] | None:
    """(native stacked name, expert index) of an HF per-expert tensor name; None for any other name."""
    m = _HF_EXPERT.match(hf_name)
    if not m:
        return None
    native = {v: k for k, v in EXPERT_MAP.items()}[m.group(3)]
    return f"layers.{m.group(1)}.feed_forward.experts.{native}", int(m.group(2))


def expert_hf_names(native_name: str, n_experts: int) -> list[str] | None:
    """The HF per-expert names of a native stacked expert tensor, in expert order; None for any other name."""
    m = _NATIVE_EXPERT.match(native_name)
    if not m:
        return None
    return [f"model.layers.{m.group(1)}.mlp.experts.{j}.{EXPERT_MAP[m.group(2)]}.weight" for j in range(n_experts)]


class StateDictAdapter:
    """Maps state dicts between the native model and HF checkpoints of one model (its args decide tying). Stacked
    expert tensors [E, out, in] become one HF tensor per expert (``t[j]``, views) and are stacked back on read."""

    def __init__(self, args: TransformerArgs):
        self.args = args

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The HF tensors of a native state dict; routing biases have none (see ``ROUTING_BIAS_FILE``)."""
        out = {}
        for name, tensor in state_dict.items():
            if name == "output.weight" and self.args.tie_embeddings:
                continue  # tied: the embedding is the head, HF writes no lm_head.weight
            if routing_bias_layer(name) is not None:
                continue
            per_expert = expert_hf_names(name, self.args.n_experts)
            if per_expert is not None:
                out.update({hf: tensor[j] for j, hf in enumerate(per_expert)})
                continue
            out[native_to_hf_name(name)] = tensor
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out, experts = {}, {}
        for name, tensor in hf_state_dict.items():
            if name == "lm_head.weight" and self.args.tie_embeddings:
                continue  # some tied checkpoints still carry a copy; the embedding wins, as in transformers
            slot = expert_slot(name)
            if slot is not None:
                experts.setdefault(slot[0], {})[slot[1]] = tensor
                continue
            out[hf_to_native_name(name)] = tensor
        for native, by_index in experts.items():
            missing = [j for j in range(self.args.n_experts) if j not in by_index]
            if missing:
                raise KeyError(f"experts {missing[:5]} of '{native}' are missing")
            out[native] = torch.stack([by_index[j] for j in range(self.args.n_experts)])
        return out

    def hf_names(self) -> list[str]:
        """HF tensor names a checkpoint of this model holds."""
        names = []
        for n in expected_native_names(self.args):
            names.extend(expert_hf_names(n, self.args.n_experts) or [native_to_hf_name(n)])
        return [n for n in names if not (n == "lm_head.weight" and self.args.tie_embeddings)]


_DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


def expected_native_names(args: TransformerArgs) -> list[str]:
    names = ["tok_embeddings.weight"]
    moe = set(args.moe_layers())
    for i in range(args.n_layers):
        for key in _LAYER_MAP:
            if "q_norm" in key or "k_norm" in key:
                if not args.qk_norm:
                    continue
            if (key in _DENSE_MLP and i in moe) or (key.startswith("feed_forward.router") and i not in moe):
                continue
            names.append(f"layers.{i}.{key}")
        if i in moe:
            names.extend(f"layers.{i}.feed_forward.experts.{w}" for w in EXPERT_MAP)
    names.append("norm.weight")
    if not args.tie_embeddings:
        names.append("output.weight")
    return names


# ------------------------------------------------------------------------------------------------
# config.json


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either transformers 5 (``rope_parameters``) or older (``rope_theta``,
    ``rope_scaling``) config layouts."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", scaling.get("rope_theta")))
    if theta is None:
        raise ValueError("config.json has no rope_theta (neither rope_parameters.rope_theta nor rope_theta)")
    src = params if params.get("rope_type", "default") != "default" else scaling
    rope_type = src.get("rope_type", src.get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type == "yarn":
        known = {f: src[f] for f in ("beta_fast", "beta_slow", "attention_factor", "mscale", "mscale_all_dim",
                                     "truncate") if src.get(f) is not None}
        original = src.get("original_max_position_embeddings") or cfg["max_position_embeddings"]
        factor = src.get("factor") or cfg["max_position_embeddings"] / original
        return float(theta), RopeScaling(factor=float(factor), original_max_position_embeddings=int(original),
                                         rope_type="yarn", **known)
    if rope_type != "llama3":
        raise ValueError(f"config.json: RoPE type '{rope_type}' is not supported (supported: default, llama3, yarn)")
    return float(theta), RopeScaling(
        factor=float(src["factor"]),
        low_freq_factor=float(src["low_freq_factor"]),
        high_freq_factor=float(src["high_freq_factor"]),
        original_max_position_embeddings=int(src["original_max_position_embeddings"]),
    )


# What the native decoder needs to know of the HF architectures it can represent: Qwen3 normalises q and k per
# head, Llama does not. (Which family a model_type belongs to is the registry's business, not this table's.)
HF_QK_NORM = {"qwen3": True, "qwen3_moe": True, "llama": False}


def args_from_hf_config(cfg: dict[str, Any], qk_norm: bool | None = None) -> TransformerArgs:
    """TransformerArgs from a config.json dict.

    Args:
        cfg: the parsed config.json.
        qk_norm: whether the architecture normalises q/k per head; None looks ``model_type`` up in
            ``HF_QK_NORM`` (qwen3, llama).
    """
    model_type = cfg.get("model_type")
    if qk_norm is None:
        if model_type not in HF_QK_NORM:
            raise ValueError(f"config.json: model_type '{model_type}' is not supported "
                             f"(supported: {', '.join(HF_QK_NORM)})")
        qk_norm = HF_QK_NORM[model_type]
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise ValueError("config.json: attention_bias/mlp_bias models are not supported")
    theta, scaling = _rope_from_hf(cfg)
    heads = cfg["num_attention_heads"]
    moe = {}
    n_experts = cfg.get("num_experts") or cfg.get("num_local_experts")  # the hub's name / transformers 5's
    if n_experts:
        moe = dict(n_experts=n_experts, n_experts_per_tok=cfg["num_experts_per_tok"],
                   moe_ffn_dim=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
                   decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                   mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                   router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)))
    return TransformerArgs(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        ffn_dim=cfg["intermediate_size"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=qk_norm,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=cfg.get("max_position_embeddings", 40960),
        extra={k: v for k, v in cfg.items() if k in _CARRIED_KEYS},
        **moe,
    )


# Fields of the source config.json that export carries through unchanged (token ids and the like).
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id", "initializer_range", "max_window_layers")


def hf_config_from_args(args: TransformerArgs, model_type: str, architecture: str,
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """A config.json dict that transformers (4.x and 5.x) and vLLM read as the same model.

    Both RoPE layouts are written: ``rope_parameters`` (transformers 5) and ``rope_theta``/``rope_scaling``
    (older readers); likewise ``dtype`` and ``torch_dtype``. ``model_type`` and ``architecture`` come from the
    model family's train spec.
    """
    dtype_name = str(dtype).removeprefix("torch.")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.rope_scaling is not None and args.rope_scaling.rope_type == "yarn":
        s = args.rope_scaling
        rope_parameters = {"rope_type": "yarn", "rope_theta": args.rope_theta, "factor": s.factor,
                           "original_max_position_embeddings": s.original_max_position_embeddings,
                           "beta_fast": s.beta_fast, "beta_slow": s.beta_slow, "truncate": s.truncate}
        rope_parameters.update({f: getattr(s, f) for f in ("attention_factor", "mscale", "mscale_all_dim")
                                if getattr(s, f) is not None})
    elif args.rope_scaling is not None:
        s = args.rope_scaling
        rope_parameters = {
            "rope_type": "llama3",
            "rope_theta": args.rope_theta,
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
    cfg: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": args.tie_embeddings,
        "rope_theta": args.rope_theta,
        "rope_parameters": rope_parameters,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        "use_cache": True,
        "initializer_range": 0.02,
    }
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if model_type in ("qwen3", "qwen3_moe"):  # Qwen3's config classes read these; Llama's reads mlp_bias
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=args.n_layers)
    else:
        cfg["mlp_bias"] = False
    if args.n_experts:
        cfg.update(num_experts=args.n_experts, num_local_experts=args.n_experts, num_experts_per_tok=args.n_experts_per_tok,
                   moe_intermediate_size=args.moe_ffn_dim, norm_topk_prob=args.norm_topk_prob,
                   decoder_sparse_step=args.decoder_sparse_step, mlp_only_layers=list(args.mlp_only_layers),
                   router_aux_loss_coef=args.router_aux_loss_coef, output_router_logits=False)
    cfg.update(args.extra)
    return cfg
