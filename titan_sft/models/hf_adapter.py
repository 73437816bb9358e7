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
    # Qwen3.5-MoE's shared expert and its gate
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert.gate.weight": "mlp.shared_expert_gate.weight",
    # Gated DeltaNet (Qwen3.5's linear attention); its q/k/v projections and convs are FUSED parts below
    "attention.in_proj_z.weight": "linear_attn.in_proj_z.weight",
    "attention.in_proj_b.weight": "linear_attn.in_proj_b.weight",
    "attention.in_proj_a.weight": "linear_attn.in_proj_a.weight",
    "attention.out_proj.weight": "linear_attn.out_proj.weight",
    "attention.A_log": "linear_attn.A_log",
    "attention.dt_bias": "linear_attn.dt_bias",
    "attention.norm.weight": "linear_attn.norm.weight",
}
# Native tensors that are row blocks of one HF tensor: Gated DeltaNet's q, k and v projections and convs are one
# [q | k | v] tensor in HF files (kept apart natively so tensor parallel can shard heads). Native suffix ->
# (HF suffix, part index); the rows of each part come from the model's sizes (``fused_rows``).
FUSED = {
    "attention.in_proj_q.weight": ("linear_attn.in_proj_qkv.weight", 0),
    "attention.in_proj_k.weight": ("linear_attn.in_proj_qkv.weight", 1),
    "attention.in_proj_v.weight": ("linear_attn.in_proj_qkv.weight", 2),
    "attention.conv_q": ("linear_attn.conv1d.weight", 0),
    "attention.conv_k": ("linear_attn.conv1d.weight", 1),
    "attention.conv_v": ("linear_attn.conv1d.weight", 2),
}
_HF_FUSED = {v[0] for v in FUSED.values()}
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


def fused_rows(args: TransformerArgs) -> list[tuple[int, int]]:
    """(first row, rows) of the q, k and v parts of a fused Gated DeltaNet tensor."""
    key, value = args.linear_n_k_heads * args.linear_k_head_dim, args.linear_n_v_heads * args.linear_v_head_dim
    return [(0, key), (key, key), (2 * key, value)]


def fused_slot(native_name: str, args: TransformerArgs) -> tuple[str, int, int] | None:
    """(HF name, first row, rows) of a native tensor that is a row block of a fused HF tensor; None otherwise."""
    m = _NATIVE_LAYER.match(native_name)
    if not m or m.group(2) not in FUSED:
        return None
    hf_suffix, part = FUSED[m.group(2)]
    return (f"model.layers.{m.group(1)}.{hf_suffix}", *fused_rows(args)[part])


def fused_parts(hf_name: str, args: TransformerArgs) -> list[tuple[str, int, int]] | None:
    """The native (name, first row, rows) parts of a fused HF tensor, in row order; None for any other name."""
    m = _HF_LAYER.match(hf_name)
    if not m or m.group(2) not in _HF_FUSED:
        return None
    rows = fused_rows(args)
    parts = sorted((part, native) for native, (hf, part) in FUSED.items() if hf == m.group(2))
    return [(f"layers.{m.group(1)}.{native}", *rows[part]) for part, native in parts]


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


# Fused expert tensors (Qwen3.5-MoE's released checkpoints, and transformers' in-memory layout): one
# ``mlp.experts.gate_up_proj`` [E, 2I, D] (gate rows, then up rows) and one ``mlp.experts.down_proj`` [E, D, I] per
# layer instead of one tensor per expert. Native stacked name -> (HF suffix, row half of gate_up_proj or None).
FUSED_EXPERTS = {"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None)}
_HF_FUSED_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def fused_expert_source(native_name: str) -> tuple[str, int | None] | None:
    """(HF fused tensor, row half) holding a native stacked expert tensor in a fused-experts checkpoint."""
    m = _NATIVE_EXPERT.match(native_name)
    if not m:
        return None
    suffix, half = FUSED_EXPERTS[m.group(2)]
    return f"model.layers.{m.group(1)}.mlp.experts.{suffix}", half


def is_fused_expert_name(hf_name: str) -> bool:
    return _HF_FUSED_EXPERT.match(hf_name) is not None


def fuse_experts(hf_sd: dict[str, Any], n_experts: int) -> dict[str, Any]:
    """``hf_sd`` with its per-expert tensors replaced by the fused ``gate_up_proj``/``down_proj`` of each layer."""
    out, layers = {}, {}
    for name, tensor in hf_sd.items():
        m = _HF_EXPERT.match(name)
        if m is None:
            out[name] = tensor
        else:
            layers.setdefault(int(m.group(1)), {})[(m.group(3), int(m.group(2)))] = tensor
    for layer, parts in sorted(layers.items()):
        stack = {p: torch.stack([parts[(p, e)] for e in range(n_experts)]) for p in EXPERT_MAP.values()}
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], 1)
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = stack["down_proj"]
    return out


# A multimodal checkpoint (``Qwen3_5ForConditionalGeneration``) nests the language model under this prefix
# (``model.language_model.layers.0...``; ``lm_head.weight`` stays at the top).
MULTIMODAL_PREFIX = "model.language_model."


def text_tensor_name(name: str) -> str:
    """A tensor's name in a text-only checkpoint: a multimodal checkpoint's language-model names lose their nesting."""
    return "model." + name[len(MULTIMODAL_PREFIX):] if name.startswith(MULTIMODAL_PREFIX) else name


def multimodal_tensor_name(name: str) -> str:
    """The inverse of ``text_tensor_name`` for a multimodal checkpoint."""
    return MULTIMODAL_PREFIX + name[len("model."):] if name.startswith("model.") else name


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
        """The HF tensors of a native state dict; routing biases have none (see ``ROUTING_BIAS_FILE``). Fused HF
        tensors are concatenated from their parts (all parts must be present)."""
        out, fused = {}, {}
        for name, tensor in state_dict.items():
            slot = fused_slot(name, self.args)
            if slot is not None:
                fused.setdefault(slot[0], {})[slot[1]] = tensor
                continue
            if name == "output.weight" and self.args.tie_embeddings:
                continue  # tied: the embedding is the head, HF writes no lm_head.weight
            if routing_bias_layer(name) is not None:
                continue
            per_expert = expert_hf_names(name, self.args.n_experts)
            if per_expert is not None:
                out.update({hf: tensor[j] for j, hf in enumerate(per_expert)})
                continue
            out[native_to_hf_name(name)] = tensor
        for hf, parts in fused.items():
            out[hf] = torch.cat([parts[start] for start in sorted(parts)])
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        out, experts = {}, {}
        for name, tensor in hf_state_dict.items():
            if name == "lm_head.weight" and self.args.tie_embeddings:
                continue  # some tied checkpoints still carry a copy; the embedding wins, as in transformers
            parts = fused_parts(name, self.args)
            if parts is not None:
                out.update({native: tensor[start:start + rows] for native, start, rows in parts})
                continue
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
            fused = fused_slot(n, self.args)
            if fused is not None:
                names.extend([] if fused[0] in names else [fused[0]])
                continue
            names.extend(expert_hf_names(n, self.args.n_experts) or [native_to_hf_name(n)])
        return [n for n in names if not (n == "lm_head.weight" and self.args.tie_embeddings)]


_DENSE_MLP = ("feed_forward.w1.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")


_LINEAR_KEYS = [k for k in _LAYER_MAP if k.startswith("attention.") and _LAYER_MAP[k].startswith("linear_attn.")]
_LINEAR_KEYS += list(FUSED)


def expected_native_names(args: TransformerArgs) -> list[str]:
    names = ["tok_embeddings.weight"]
    moe = set(args.moe_layers())
    for i in range(args.n_layers):
        linear = args.layer_type(i) == "linear_attention"
        for key in list(_LAYER_MAP) + list(FUSED):
            is_linear_key = key in _LINEAR_KEYS
            if is_linear_key != linear and (key.startswith("attention.") or is_linear_key):
                continue
            if ("q_norm" in key or "k_norm" in key) and not args.qk_norm:
                continue
            if (key in _DENSE_MLP and i in moe) or (key.startswith("feed_forward.router") and i not in moe):
                continue
            if key.startswith("feed_forward.shared_expert") and not (i in moe and args.shared_expert_ffn_dim):
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
HF_QK_NORM = {"qwen3": True, "qwen3_moe": True, "llama": False, "qwen3_5_text": True, "qwen3_5_moe_text": True}
# Qwen3.5's text configs (the hybrid decoder); a multimodal config ("qwen3_5", "qwen3_5_moe") nests one as
# ``text_config``.
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
MULTIMODAL_TYPES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The language model's config of a config.json: itself, or a multimodal checkpoint's ``text_config`` (with
    the model_type its weights are read as, and the top level's ``tie_word_embeddings``: transformers ties the
    multimodal model's head by that one)."""
    if cfg.get("model_type") in MULTIMODAL_TYPES:
        text = {**cfg["text_config"], "model_type": MULTIMODAL_TYPES[cfg["model_type"]]}
        if "tie_word_embeddings" in cfg:
            text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
        return text
    return cfg


def _qwen3_5_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """TransformerArgs fields of Qwen3.5's hybrid decoder from a text config."""
    layer_types = cfg.get("layer_types")
    if not layer_types:  # transformers' default: every full_attention_interval-th layer is full attention
        every = cfg.get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % every else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    bad = sorted(set(layer_types) - {"linear_attention", "full_attention"})
    if bad or len(layer_types) != cfg["num_hidden_layers"]:
        raise ValueError(f"config.json: layer_types must list 'linear_attention'/'full_attention' for each of the "
                         f"{cfg['num_hidden_layers']} layers (got {len(layer_types)} entries, unknown {bad})")
    rope = cfg.get("rope_parameters") or {}
    fields = dict(layer_types=list(layer_types), attn_output_gate=True, norm_offset=True,
                  partial_rotary_factor=float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))),
                  linear_n_k_heads=cfg["linear_num_key_heads"], linear_n_v_heads=cfg["linear_num_value_heads"],
                  linear_k_head_dim=cfg["linear_key_head_dim"], linear_v_head_dim=cfg["linear_value_head_dim"],
                  linear_conv_kernel=cfg.get("linear_conv_kernel_dim", 4))
    if cfg.get("shared_expert_intermediate_size"):
        fields["shared_expert_ffn_dim"] = cfg["shared_expert_intermediate_size"]
    return fields


def args_from_hf_config(cfg: dict[str, Any], qk_norm: bool | None = None) -> TransformerArgs:
    """TransformerArgs from a config.json dict.

    Args:
        cfg: the parsed config.json.
        qk_norm: whether the architecture normalises q/k per head; None looks ``model_type`` up in
            ``HF_QK_NORM`` (qwen3, llama).
    """
    cfg = text_config(cfg)
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
        ffn_dim=cfg.get("intermediate_size", 0),  # none in Qwen3.5-MoE, whose every layer has experts
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        qk_norm=qk_norm,
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_seq_len=cfg.get("max_position_embeddings", 40960),
        extra={k: v for k, v in cfg.items() if k in _CARRIED_KEYS},
        **moe,
        **(_qwen3_5_fields(cfg) if model_type in QWEN3_5_TYPES else {}),
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
    if args.partial_rotary_factor != 1.0:
        rope_parameters["partial_rotary_factor"] = args.partial_rotary_factor
    if args.rope_scaling is not None:
        cfg["rope_scaling"] = {k: v for k, v in rope_parameters.items() if k != "rope_theta"}
    if model_type in QWEN3_5_TYPES:
        cfg.update(layer_types=list(args.layer_types), linear_num_key_heads=args.linear_n_k_heads,
                   linear_num_value_heads=args.linear_n_v_heads, linear_key_head_dim=args.linear_k_head_dim,
                   linear_value_head_dim=args.linear_v_head_dim, linear_conv_kernel_dim=args.linear_conv_kernel)
        if args.shared_expert_ffn_dim:
            cfg["shared_expert_intermediate_size"] = args.shared_expert_ffn_dim
        del cfg["rope_theta"]  # transformers 5 reads rope_parameters; Qwen3.5 has no older reader
    elif model_type in ("qwen3", "qwen3_moe"):  # Qwen3's config classes read these; Llama's reads mlp_bias
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
