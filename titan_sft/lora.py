"""LoRA as a model converter (``model.converters = ["lora"]``, settings in ``[lora]``), for any objective.

The chosen block projections become :class:`LoRALinear`: the frozen base weight plus ``lora_a`` [r, in] and
``lora_b`` [out, r], output ``x W^T + (alpha / r) * dropout(x) A^T B^T``. ``lora_b`` starts at zero, so training
starts from the base model exactly. Every other parameter is frozen, except the RMSNorm weights with
``lora.train_norms``; the optimizer (``titan_sft.optimizer``) only sees trainable parameters, so it keeps no state
for the frozen base.

Composition: the adapters are plain parameters of the linear itself, so FSDP2 shards them with the block and the
tensor-parallel styles place them with the weight (column-wise: both sharded on dim 0; row-wise: replicated);
DTensor then computes the exact branch under any layout. Activation checkpointing recomputes the branch with the
block (with dropout > 0 the RNG state is kept for the recompute).

Routed experts (``lora.experts``): each expert's gate/up/down weight [E, out, in] gets per-expert factors stored
stacked, ``<w>_lora_a`` [E, r, in] and ``<w>_lora_b`` [E, out, r], run as two more grouped GEMMs on the same
token groups (:class:`LoRAGroupedExperts`); expert parallel shards them by expert with their experts.

On disk: DCP checkpoints hold the adapters like any parameter; HF exports merge them into the base weights
(:func:`merge_lora`); :func:`save_peft_adapter` writes what PEFT loads (``adapter_config.json`` +
``adapter_model.safetensors``, HF module names; trained norms as ``modules_to_save``).
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from titan_sft import nf4
from titan_sft.config import JobConfig, Lora
from titan_sft.constants import DTYPES
from titan_sft.models.moe import GroupedExperts, MoE, local
from titan_sft.registry import register_converter

# HF projection name -> native module path inside a block
TARGETS = {"q_proj": "attention.wq", "k_proj": "attention.wk", "v_proj": "attention.wv", "o_proj": "attention.wo",
           "gate_proj": "feed_forward.w1", "up_proj": "feed_forward.w3", "down_proj": "feed_forward.w2"}
# Targets with more than one native module, or a module only some blocks have: Gated DeltaNet's projections
# (in_proj_qkv is three natively: each gets its own adapter, exported to PEFT as one block-diagonal adapter of rank
# 3r on the fused projection) and Qwen3.5-MoE's shared expert (PEFT's gate_proj/up_proj/down_proj match it too).
EXTRA_TARGETS = {"in_proj_qkv": ("attention.in_proj_q", "attention.in_proj_k", "attention.in_proj_v"),
                 "in_proj_z": ("attention.in_proj_z",), "in_proj_b": ("attention.in_proj_b",),
                 "in_proj_a": ("attention.in_proj_a",), "out_proj": ("attention.out_proj",),
                 "gate_proj": ("feed_forward.shared_expert.w1",), "up_proj": ("feed_forward.shared_expert.w3",),
                 "down_proj": ("feed_forward.shared_expert.w2",)}
FUSED_QKV = ("in_proj_q", "in_proj_k", "in_proj_v")  # native parts of in_proj_qkv, in row order
ADAPTER_KEYS = ("lora_a", "lora_b")
MAGNITUDE = "lora_magnitude"  # DoRA's per-row magnitude of a linear (PEFT: lora_magnitude_vector)
EXPERT_TARGETS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # HF name -> stacked expert weight
EXPERT_ADAPTERS_FILE = "expert_adapters.safetensors"


def lora_scaling(lo: Lora) -> float:
    """The update's scale: alpha / r, or alpha / sqrt(r) with rsLoRA (``lora.use_rslora``)."""
    return lo.alpha / (math.sqrt(lo.rank) if lo.use_rslora else lo.rank)


class LoRALinear(nn.Linear):
    """nn.Linear (frozen) with a low-rank update; still an nn.Linear, so parallel styles apply to it.

    With ``dora`` (DoRA, as PEFT computes it): a trainable magnitude m [out] rescales each output row of the
    adapted weight W + s B A to m / ||W + s B A||, the norm taken per row and detached (the DoRA paper's section
    4.3): ``y = x W^T + (m / n - 1) x' W^T + (m / n) s x' A^T B^T`` with x' = dropout(x) (x' W^T is x W^T when
    there is no dropout). m starts at ||W|| (B = 0), so training still starts from the base model exactly."""

    def __init__(self, base: nn.Linear, rank: int, scale: float, dropout: float, key: str, dora: bool = False):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight = base.weight
        self.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
        self.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
        self.lora_magnitude = (nn.Parameter(torch.empty(base.out_features, device=base.weight.device))
                               if dora else None)
        self.scale = scale
        self.dropout = dropout  # a float, not a submodule: parallel styles partition every submodule of a linear
        self.key = zlib.crc32(key.encode())  # seeds this module's init: the same for any layout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_magnitude is None:
            return self.base_linear(x) + lora_update(self, x)
        base = F.linear(x, self.weight)
        h = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        w = self.weight.to(x.dtype)
        norm = torch.linalg.vector_norm(w + self.scale * (self.lora_b @ self.lora_a).detach().to(x.dtype), dim=1)
        ratio = self.lora_magnitude / norm.detach()
        dropped = base if h is x else F.linear(h, w)
        return base + (ratio - 1) * dropped + ratio * F.linear(F.linear(h, self.lora_a), self.lora_b) * self.scale

    def base_linear(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T with the frozen base weight."""
        return F.linear(x, self.weight)

    def reset_converter_parameters(self, seed: int) -> None:
        """A ~ kaiming-uniform (PEFT's init: bound 1 / sqrt(in)), B = 0, drawn whole on the CPU from (seed, module
        name) and each rank keeps its shard, so every layout starts from the same adapters; DoRA's magnitude is
        the base weight's row norms."""
        g = torch.Generator().manual_seed(seed * 1_000_003 + self.key)
        bound = 1.0 / math.sqrt(self.in_features)
        a = torch.rand(self.lora_a.shape, generator=g, dtype=torch.float32) * 2 * bound - bound
        with torch.no_grad():
            for p, full in ((self.lora_a, a), (self.lora_b, torch.zeros(self.lora_b.shape))):
                _copy_full(p, full)
            if self.lora_magnitude is not None:
                _copy_row_norms(self.lora_magnitude, self.weight)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.lora_a.shape[0]}, scale={self.scale:g}"


class NF4LoRALinear(LoRALinear):
    """A LoRALinear whose frozen base weight is stored in NF4 (``lora.base_quant``, :mod:`titan_sft.nf4`)."""

    def base_linear(self, x: torch.Tensor) -> torch.Tensor:
        return nf4.linear(self, x)


class NF4Linear(nn.Linear):
    """A frozen linear without adapters whose weight is stored in NF4 (a projection outside ``lora.targets``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4.linear(self, x)


class NF4Experts:
    """Mixed into a model's (LoRA) GroupedExperts class: its stacked weights are stored in NF4 and dequantized
    whole for each grouped GEMM (the dequantized weight lives until the layer's backward: a block's experts at a
    time under activation checkpointing)."""

    def weight(self, name: str) -> torch.Tensor:
        return nf4.weight(self, name, self.nf4_dtype)


_NF4_EXPERTS: dict[type, type] = {}


def _nf4_experts_class(cls: type) -> type:
    if cls not in _NF4_EXPERTS:
        _NF4_EXPERTS[cls] = type(f"NF4{cls.__name__}", (NF4Experts, cls), {})
    return _NF4_EXPERTS[cls]


def quantize_base(model: nn.Module, dtype: torch.dtype) -> int:
    """QLoRA (``lora.base_quant = "nf4"``): every frozen linear of the blocks (adapted or not) and the routed
    experts' stacked weights keep their values in NF4 (:mod:`titan_sft.nf4`); routers and the shared expert's
    gate (tiny, and routing decisions are sensitive) stay in ``dtype``, as do the embedding, norms and head.
    Runs on the meta model; the codes come at load. Returns the number of weights quantized."""
    from titan_sft.models.moe import Router, SharedExpert

    n = 0
    for block in model.layers.values():
        skip = {id(m) for r in block.modules() if isinstance(r, Router) for m in r.modules()}
        skip |= {id(m.gate) for m in block.modules() if isinstance(m, SharedExpert)}
        for m in list(block.modules()):
            if id(m) in skip:
                continue
            if isinstance(m, GroupedExperts):
                n += len(nf4.quantize_module(m, ("w1", "w2", "w3")))
                m.__class__ = _nf4_experts_class(type(m))
                m.nf4_dtype = dtype
            elif isinstance(m, nn.Linear) and not m.weight.requires_grad and m.bias is None:
                if nf4.quantize_module(m, ("weight",)):
                    m.__class__ = NF4LoRALinear if isinstance(m, LoRALinear) else NF4Linear
                    n += 1
    return n


_FLOAT8_LORA: type | None = None


def _float8_lora_class() -> type:
    """torchao's Float8Linear with a LoRA update: the frozen base matmul in float8, the adapters in high precision.
    Made by class swap of a converted linear (see :func:`_add_lora_to_float8`), so the float8 config, the weight and
    the module's place (its FQN) are the Float8Linear's own."""
    global _FLOAT8_LORA
    if _FLOAT8_LORA is None:
        from torchao.float8.float8_linear import Float8Linear

        class Float8LoRALinear(Float8Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x) + lora_update(self, x)

            reset_converter_parameters = LoRALinear.reset_converter_parameters

            def extra_repr(self) -> str:
                return f"{super().extra_repr()}, lora rank={self.lora_a.shape[0]}, scale={self.scale:g}"

        _FLOAT8_LORA = Float8LoRALinear
    return _FLOAT8_LORA


def lora_update(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """(alpha / r) * dropout(x) A^T B^T: the adapter's part of a LoRA linear's output."""
    h = F.dropout(x, module.dropout, module.training) if module.dropout > 0 else x
    return F.linear(F.linear(h, module.lora_a), module.lora_b) * module.scale


def _add_lora_to_float8(base: nn.Module, rank: int, scale: float, dropout: float, key: str) -> nn.Module:
    base.__class__ = _float8_lora_class()
    base.weight.requires_grad_(False)
    base.lora_a = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device))
    base.lora_b = nn.Parameter(torch.empty(base.out_features, rank, device=base.weight.device))
    base.lora_magnitude = None
    base.scale, base.dropout, base.key = scale, dropout, zlib.crc32(key.encode())
    return base


class LoRAGroupedExperts(GroupedExperts):
    """Routed experts with a low-rank update per expert on the adapted weights (``lora_targets``): for expert e,
    ``x W_e^T + scale * dropout(x) A_e^T B_e^T``, through the same grouped GEMM (or loop) as the base weight.
    Made by class swap of a model's GroupedExperts (:func:`add_expert_lora`), so names and places stay."""

    lora_targets: tuple[str, ...]

    def project(self, x: torch.Tensor, name: str, mm) -> torch.Tensor:
        y = super().project(x, name, mm)
        if name not in self.lora_targets:
            return y
        h = F.dropout(x, self.dropout, self.training) if self.dropout > 0 else x
        a, b = (local(getattr(self, f"{name}_{k}")) for k in ADAPTER_KEYS)
        return y + mm(mm(h, a), b) * self.scale

    def reset_converter_parameters(self, seed: int) -> None:
        """Per weight: A ~ kaiming-uniform with bound 1 / sqrt(in) (PEFT's), B = 0, drawn whole on the CPU from
        (seed, module name, weight), every rank keeping its shard (the same adapters for any layout)."""
        for name in self.lora_targets:
            a_p, b_p = (getattr(self, f"{name}_{k}") for k in ADAPTER_KEYS)
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{self.key}.{name}".encode()))
            bound = 1.0 / math.sqrt(a_p.shape[-1])
            a = torch.rand(a_p.shape, generator=g, dtype=torch.float32) * 2 * bound - bound
            with torch.no_grad():
                _copy_full(a_p, a)
                _copy_full(b_p, torch.zeros(b_p.shape))


def add_expert_lora(experts: GroupedExperts, targets: list[str], rank: int, scale: float, dropout: float,
                    key: str) -> list[str]:
    """Gives ``experts`` stacked per-expert adapters on the weights of ``targets`` (HF names: gate_proj, up_proj,
    down_proj; others are ignored); returns the adapted weights' names."""
    names = tuple(EXPERT_TARGETS[t] for t in targets if t in EXPERT_TARGETS)
    experts.__class__ = LoRAGroupedExperts
    experts.lora_targets, experts.scale, experts.dropout, experts.key = names, scale, dropout, key
    for name in names:
        w = getattr(experts, name)
        e, out, inp = w.shape
        experts.register_parameter(f"{name}_lora_a", nn.Parameter(torch.empty(e, rank, inp, device=w.device)))
        experts.register_parameter(f"{name}_lora_b", nn.Parameter(torch.empty(e, out, rank, device=w.device)))
    return list(names)


def _copy_row_norms(magnitude: torch.Tensor, weight: torch.Tensor) -> None:
    """``magnitude`` := the row norms of ``weight`` (either plain, or DTensors: the norms are computed on the
    weight's shards and placed as the magnitude is)."""
    from torch.distributed.tensor import DTensor

    norms = torch.linalg.vector_norm(weight, dim=1)
    if isinstance(norms, DTensor):
        norms = norms.full_tensor()
    _copy_full(magnitude, norms.float())


def is_float8_linear(module: nn.Module) -> bool:
    return any(c.__name__ == "Float8Linear" for c in type(module).__mro__)


def _copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Writes the whole tensor ``full`` into ``param`` (plain, or a DTensor: this rank's shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        shard = distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(shard.to_local())
    else:
        param.copy_(full.to(param.device, param.dtype))


def apply_lora(model: nn.Module, cfg: JobConfig, device: torch.device | None = None) -> list[str]:
    """Converts the target projections of every block and freezes the rest; returns the converted names. In a
    model with routed experts the attention projections and the dense layers' MLPs get adapters; the experts
    get stacked per-expert ones with ``lora.experts`` (their gate/up/down among the targets), and the router
    stays frozen."""
    lo = cfg.lora
    for p in model.parameters():
        p.requires_grad_(False)
    names = []
    for i, block in model.layers.items():
        paths = [p for t in lo.targets for p in ((TARGETS[t],) if t in TARGETS else ()) + EXTRA_TARGETS.get(t, ())]
        for path in paths:
            parent_path, attr = path.rsplit(".", 1)
            parent = _submodule_or_none(block, parent_path)
            fqn = f"layers.{i}.{path}"
            base = getattr(parent, attr, None)
            if not isinstance(base, nn.Linear):  # an MoE block's MLP: routed experts, adapted below or frozen
                continue
            if is_float8_linear(base):  # float8 ran first: keep its float8 base matmul, add the adapter beside it
                _add_lora_to_float8(base, lo.rank, lora_scaling(lo), lo.dropout, fqn)
            else:
                setattr(parent, attr, LoRALinear(base, lo.rank, lora_scaling(lo), lo.dropout, fqn, lo.use_dora))
            names.append(fqn)
        ff = getattr(block, "feed_forward", None)
        if lo.experts and isinstance(ff, MoE):
            fqn = f"layers.{i}.feed_forward.experts"
            names += [f"{fqn}.{w}" for w in add_expert_lora(ff.experts, lo.targets, lo.rank, lora_scaling(lo), lo.dropout,
                                                            fqn)]
    if lo.train_norms:
        for name, p in model.named_parameters():
            if "norm" in name:
                p.requires_grad_(True)
    if lo.base_quant == "nf4":
        quantize_base(model, DTYPES[cfg.training.param_dtype])
    return names


def _submodule_or_none(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
    return module


def is_adapter_key(name: str) -> bool:
    return name.endswith((*ADAPTER_KEYS, MAGNITUDE))


def is_expert_adapter_key(name: str) -> bool:
    """An expert weight's stacked adapter (``...experts.w1_lora_a``), as opposed to a linear's (``...wq.lora_a``)."""
    return is_adapter_key(name) and name.rsplit(".", 1)[-1] not in (*ADAPTER_KEYS, MAGNITUDE)


def merge_lora(state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """A full state dict with the adapters folded into their base weights: W + scale * B @ A (in fp32)."""
    out = {}
    for name, t in state.items():
        if is_adapter_key(name):
            continue
        # A linear's adapters sit beside its weight (wq.weight: wq.lora_a); a stacked expert weight's carry its
        # name (experts.w1: experts.w1_lora_a), and b @ a is then batched over the experts.
        prefix = name[: -len("weight")] if name.endswith(".weight") else name + "_"
        if prefix + "lora_a" in state:
            a, b = state[prefix + "lora_a"].float(), state[prefix + "lora_b"].float()
            merged = t.float() + scale * (b @ a)
            if prefix + MAGNITUDE in state:  # DoRA: each row rescaled to its trained magnitude
                m = state[prefix + MAGNITUDE].float()
                merged = merged * (m / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
            t = merged.to(t.dtype)
        out[name] = t
    return out


def lora_scale(cfg: JobConfig) -> float | None:
    """The LoRA update's scale (:func:`lora_scaling`) when the run uses LoRA, else None."""
    return lora_scaling(cfg.lora) if "lora" in cfg.model.converters else None


def save_peft_adapter(state: dict[str, torch.Tensor], lo: Lora, out_dir: str | Path, base_model: str | None,
                      train_norms: bool, native_to_hf, stored_name=None) -> Path:
    """Writes ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (run on one rank, with
    a full state dict). The trained norm weights go in as ``modules_to_save``, so ``PeftModel.from_pretrained``
    restores them with the adapters. ``stored_name`` maps a text-only module path to the base's (a multimodal
    base nests the language model: ``model.language_model.layers...``); with it, ``modules_to_save`` names whole
    module paths, since a suffix such as ``norm`` would also take in the vision tower's norms."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors, norm_modules, experts = {}, set(), {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in state.items():
        if is_expert_adapter_key(name):
            experts[name] = t.contiguous()  # native names: layers.<i>.feed_forward.experts.<w>_lora_<a|b>
        elif is_adapter_key(name) and name.rsplit(".", 2)[-2] in FUSED_QKV:
            qkv.setdefault(name.rsplit(".", 2)[0], {})[".".join(name.rsplit(".", 2)[-2:])] = t
        elif is_adapter_key(name):
            module, kind = name.rsplit(".", 1)
            base = native_to_hf(module + ".weight")[: -len(".weight")]
            key = {"lora_a": "lora_A.weight", "lora_b": "lora_B.weight", MAGNITUDE: "lora_magnitude_vector"}[kind]
            tensors[f"base_model.model.{base}.{key}"] = t.contiguous()
        elif train_norms and "norm" in name:
            hf = native_to_hf(name)
            tensors[f"base_model.model.{hf}"] = t.contiguous()
            norm_modules.add(hf.split(".")[-2] if stored_name is None else stored_name(hf).rsplit(".", 1)[0])
    for prefix, parts in qkv.items():
        # q, k and v adapters as one on the fused projection: A stacked [3r, in], B block-diagonal [q+k+v, 3r];
        # rank 3r with alpha 3 * alpha keeps the scale alpha / r, so PEFT's update is exactly the three updates.
        a = torch.cat([parts[f"{p}.lora_a"] for p in FUSED_QKV])
        b = torch.block_diag(*[parts[f"{p}.lora_b"] for p in FUSED_QKV])
        base = f"model.{prefix.rsplit('.', 1)[0]}.linear_attn.in_proj_qkv"
        tensors[f"base_model.model.{base}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{base}.lora_B.weight"] = b.contiguous()
        if f"in_proj_q.{MAGNITUDE}" in parts:  # DoRA: B is block-diagonal, so each row's norm is its part's
            tensors[f"base_model.model.{base}.lora_magnitude_vector"] = torch.cat(
                [parts[f"{p}.{MAGNITUDE}"] for p in FUSED_QKV]).contiguous()
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lo.rank, "lora_alpha": lo.alpha, "lora_dropout": lo.dropout, "target_modules": sorted(lo.targets),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": sorted(norm_modules) or None, "use_rslora": lo.use_rslora, "use_dora": lo.use_dora,
    }
    if qkv:
        parts = next(iter(qkv.values()))
        # the fused adapter's alpha keeps the scale: 3 alpha / 3r, or with rsLoRA sqrt(3) alpha / sqrt(3r)
        alpha = (math.sqrt(3) if lo.use_rslora else 3) * lo.alpha
        config.update(rank_pattern={"in_proj_qkv": 3 * lo.rank}, alpha_pattern={"in_proj_qkv": alpha},
                      titan_sft_qkv_rows=[parts[f"{p}.lora_b"].shape[0] for p in FUSED_QKV])
    if experts:
        # PEFT reaches the routed experts as transformers' fused 3-D parameters (target_parameters); the same
        # factors in PEFT's layout go into adapter_model.safetensors (peft_expert_tensors). titan_sft's own
        # per-projection factors are kept beside, by native name: what warm starts read back exactly.
        peft_tensors, params = peft_expert_tensors(experts)
        tensors.update(peft_tensors)
        # gate_up_proj: rank 2r with alpha 2 alpha (rsLoRA: sqrt(2) alpha) keeps the scale, as for in_proj_qkv
        config["target_parameters"] = params
        if "mlp.experts.gate_up_proj" in params:
            config.setdefault("rank_pattern", {})["mlp.experts.gate_up_proj"] = 2 * lo.rank
            config.setdefault("alpha_pattern", {})["mlp.experts.gate_up_proj"] = (
                (math.sqrt(2) if lo.use_rslora else 2) * lo.alpha)
        save_file(experts, str(out_dir / EXPERT_ADAPTERS_FILE), metadata={"format": "pt", "scale": str(lora_scaling(lo))})
        config["titan_sft_expert_adapters"] = EXPERT_ADAPTERS_FILE
    if stored_name is not None:
        tensors = {f"base_model.model.{stored_name(k.removeprefix('base_model.model.'))}": v for k, v in tensors.items()}
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    linear = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors
              if ".lora_" in k and ".mlp.experts." not in k}
    if experts:
        # PEFT remaps MLP names in target_modules to the fused expert parameters of an MoE model (its transformers
        # v4 -> v5 conversion) and drops them as modules: the experts are named by target_parameters instead. A
        # dense layer's MLP adapters of such a model then have no name PEFT keeps (vllm_lora_problems says so).
        config["titan_sft_dense_mlp_adapters"] = sorted(linear & set(EXPERT_TARGETS))
        linear -= set(EXPERT_TARGETS)
    config["target_modules"] = sorted(linear & set(lo.targets)) or ([] if experts else sorted(lo.targets))
    if lo.base_quant != "none":  # the base it was trained against (it is served on the original weights)
        config["titan_sft_base_quant"] = lo.base_quant
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def peft_expert_tensors(experts: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """titan_sft's stacked per-expert adapters (native names) as PEFT applies LoRA to transformers' fused expert
    parameters (``target_parameters``): (adapter tensors by PEFT key, the targeted parameter names).

    Per layer and expert e: ``gate_up_proj[e]`` [2I, H] gets A = [A_gate; A_up] [2r, H] and the block-diagonal
    B = [[B_gate, 0], [0, B_up]] [2I, 2r], so B A is exactly the gate and the up update stacked (rank 2r, as
    PEFT itself fuses per-expert gate and up adapters); ``down_proj[e]`` [H, I] gets its own rank-r factors. PEFT
    stores an adapter of rank r' on E experts as ``lora_A.weight`` [E * r', in] (expert-major) and
    ``lora_B.weight`` [out, r' * E] (rank-major). Where both
    parameters of a layer are adapted PEFT nests its wrappers, gate_up_proj inside: its keys carry
    ``base_layer.``."""
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in experts.items():
        prefix, leaf = name.rsplit(".", 1)  # layers.<i>.feed_forward.experts, w1_lora_a
        layers.setdefault(prefix, {})[leaf] = t
    out, params = {}, []
    for prefix, f in layers.items():
        module = f"model.{prefix.split('.')[0]}.{prefix.split('.')[1]}.mlp.experts"
        parts = []
        if "w1_lora_a" in f or "w3_lora_a" in f:
            ref_a, ref_b = (f.get(f"w1_{k}", f.get(f"w3_{k}")) for k in ("lora_a", "lora_b"))
            a = [f.get(f"w{w}_lora_a", torch.zeros_like(ref_a)) for w in (1, 3)]
            b = [f.get(f"w{w}_lora_b", torch.zeros_like(ref_b)) for w in (1, 3)]
            e, rows, r = b[0].shape
            bd = torch.zeros(e, 2 * rows, 2 * r, dtype=b[0].dtype)
            bd[:, :rows, :r], bd[:, rows:, r:] = b[0], b[1]
            parts.append(("gate_up_proj", torch.cat(a, dim=1), bd))
        if "w2_lora_a" in f:
            parts.append(("down_proj", f["w2_lora_a"], f["w2_lora_b"]))
        for depth, (param, a, b) in enumerate(parts):
            key = f"base_model.model.{module}." + "base_layer." * (len(parts) - 1 - depth)
            e, r2, inp = a.shape
            out[key + "lora_A.weight"] = a.reshape(e * r2, inp).contiguous()
            out[key + "lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r2 * e).contiguous()
            if f"mlp.experts.{param}" not in params:
                params.append(f"mlp.experts.{param}")
    return out, params


def trainable_full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (adapters, trained norms), whole, on rank 0's host by native name (empty on the
    other ranks). Call on every rank: each DTensor is gathered (a collective), one small tensor at a time; a
    pipeline's later stages send theirs to rank 0."""
    from torch.distributed.tensor import DTensor

    from titan_sft.atomic import rank
    from titan_sft.parallel.distributed import unwrapped_name

    gather = getattr(model, "full_state_on_rank0", None)
    if gather is not None:  # a pipelined model: the other stages' adapters live on other ranks
        trainable = {unwrapped_name(n): p for n, p in model.named_parameters() if p.requires_grad}
        return {k: v.to(torch.float32, copy=True) for k, v in gather(trainable).items()}
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            if rank() == 0:
                # a copy: on one CPU rank full_tensor() is the parameter itself, and the initial norms kept from
                # here would train along with it
                out[unwrapped_name(name)] = full.detach().to("cpu", torch.float32, copy=True)
    return out


def save_adapter(model: nn.Module, out_dir: str | Path, lo: Lora, *, native_to_hf, dtype: torch.dtype,
                 base_model: str | None = None, tokenizer_dir: str | None = None,
                 initial_norms: dict[str, torch.Tensor] | None = None, objective: dict | None = None,
                 stored_name=None) -> Path:
    """A servable adapter directory, written atomically (``*.partial``, then renamed): the PEFT adapter
    (:func:`save_peft_adapter`: trained norms as ``modules_to_save``), the tokenizer files, the norms' values
    before training (``initial_norms.safetensors``, HF names: what base-model scoring needs), and the objective
    record. Only the trainable parameters are gathered. Call on every rank; rank 0 writes."""
    import shutil

    from safetensors.torch import save_file

    from titan_sft.atomic import barrier, rank

    state = trainable_full_state(model)
    out_dir = Path(out_dir)
    if rank() == 0:
        tmp = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        save_peft_adapter({k: v.to(dtype) for k, v in state.items()}, lo, tmp, base_model, lo.train_norms,
                          native_to_hf, stored_name)
        if initial_norms:
            named = stored_name or (lambda n: n)
            save_file({named(native_to_hf(k)): v.to(dtype).contiguous() for k, v in initial_norms.items()},
                      str(tmp / "initial_norms.safetensors"), metadata={"format": "pt"})
        if tokenizer_dir:
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True).save_pretrained(str(tmp))
        if objective:
            (tmp / "objective.json").write_text(json.dumps(objective, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    barrier()
    return out_dir


def read_peft_adapter(adapter_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json, tensors by native name) of a PEFT LoRA adapter directory, titan_sft's or peft's:
    ``lora_A``/``lora_B`` become ``lora_a``/``lora_b``, modules_to_save weights (norms) their native names."""
    from safetensors.torch import load_file

    from titan_sft.models.hf_adapter import hf_to_native_name, text_tensor_name

    d = Path(adapter_dir)
    conf = json.loads((d / "adapter_config.json").read_text())
    state = {}
    for name, t in load_file(str(d / "adapter_model.safetensors")).items():
        hf = text_tensor_name(name.removeprefix("base_model.model."))  # also an adapter of a multimodal base
        if ".mlp.experts." in hf and conf.get("titan_sft_expert_adapters"):
            continue  # PEFT's layout of the experts' adapters: titan_sft's own factors are read below
        for kind, native in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b"),
                             (".lora_magnitude_vector", MAGNITUDE)):
            if hf.endswith(kind) and hf.endswith("in_proj_qkv" + kind):
                state.update(_split_qkv_adapter(hf[: -len(kind)], native, t, conf))
                break
            if hf.endswith(kind):
                state[hf_to_native_name(hf[: -len(kind)] + ".weight")[: -len("weight")] + native] = t
                break
        else:
            # peft writes modules_to_save copies as <module>.modules_to_save.default.weight
            state[hf_to_native_name(hf.replace(".modules_to_save.default", ""))] = t
    if conf.get("titan_sft_expert_adapters"):
        state.update(load_file(str(d / conf["titan_sft_expert_adapters"])))
    return conf, state


def _split_qkv_adapter(hf_module: str, kind: str, t: torch.Tensor, conf: dict) -> dict[str, torch.Tensor]:
    """A fused in_proj_qkv adapter (titan_sft's block-diagonal export, whose config records the q, k and v rows)
    back into the q, k and v adapters; any other fused adapter has no exact split and is refused."""
    sizes = conf.get("titan_sft_qkv_rows")
    if not sizes:
        raise ValueError(f"{hf_module}: an in_proj_qkv adapter not written by titan_sft (no titan_sft_qkv_rows in "
                         "adapter_config.json) has no exact split into q, k and v adapters")
    prefix = hf_module.removeprefix("model.").replace("linear_attn.in_proj_qkv", "attention")
    if kind == MAGNITUDE:
        return {f"{prefix}.{p}.{MAGNITUDE}": part for p, part in zip(FUSED_QKV, t.split(sizes))}
    if kind == "lora_a":
        r = t.shape[0] // 3
        return {f"{prefix}.{p}.lora_a": t[j * r:(j + 1) * r] for j, p in enumerate(FUSED_QKV)}
    r, out, start = t.shape[1] // 3, {}, 0
    for j, (p, n) in enumerate(zip(FUSED_QKV, sizes)):
        block = t[start:start + n]
        if block[:, : j * r].any() or block[:, (j + 1) * r:].any():
            raise ValueError(f"{hf_module}: the in_proj_qkv adapter is not block-diagonal over q, k and v")
        out[f"{prefix}.{p}.lora_b"] = block[:, j * r:(j + 1) * r]
        start += n
    return out


# The masked-diffusion reference trainer keeps its trained norms beside the adapter, not in it: their values, and
# the base's values it started them from.
REFERENCE_NORMS, REFERENCE_INITIAL_NORMS = "normalization_state.pt", "normalization_initial_state.pt"


def read_reference_norms(path: Path) -> dict[str, torch.Tensor]:
    """A reference norms file by native name. Its keys may be the PEFT model's parameter names
    (``base_model.model.model.layers.0.input_layernorm.weight``), a ``module.``-prefixed copy of them, or HF names."""
    from titan_sft.config import ConfigError
    from titan_sft.models.hf_adapter import hf_to_native_name, text_tensor_name

    out = {}
    for key, t in torch.load(path, map_location="cpu", weights_only=True).items():
        hf = text_tensor_name(key.removeprefix("module.").removeprefix("base_model.model.")
                              .replace(".modules_to_save.default", ""))
        try:
            native = hf_to_native_name(hf)
        except KeyError:
            native = ""
        if "norm" not in native:
            raise ConfigError(f"config key 'lora.init_from': {path} holds '{key}', not a norm of this model")
        out[native] = t
    return out


def check_initial_norms(adapter_dir: str | Path, initial: dict[str, torch.Tensor]) -> None:
    """Refuses a warm start whose adapter was trained from another base: the reference's record of the norms it
    started from (``normalization_initial_state.pt``) must equal this run's base's (``initial``, before the start)."""
    from titan_sft.config import ConfigError

    path = Path(adapter_dir) / REFERENCE_INITIAL_NORMS
    if not path.is_file():
        return
    for key, t in read_reference_norms(path).items():
        if key in initial and not torch.equal(t.float(), initial[key].float()):
            diff = (t.float() - initial[key].float()).abs().max().item()
            raise ConfigError(f"config key 'lora.init_from': {path} records '{key}' of the base the adapter was "
                              f"trained from, and this run's base differs (max |difference| {diff:.3g}); start from "
                              "that base (model.hf_assets_path)")


def warm_start(model: nn.Module, adapter_dir: str | Path, lo: Lora) -> int:
    """Copies an adapter directory's tensors into the (sharded) model's trainable parameters; returns how many.
    Every adapter of the model must be in it, with this run's rank (one clear error otherwise). The reference
    trainer's trained norms (``normalization_state.pt`` beside its adapter) are read too, and must then cover
    every trained norm."""
    from titan_sft.config import ConfigError
    from titan_sft.parallel.distributed import unwrapped_name

    d = Path(adapter_dir)
    if not (d / "adapter_config.json").is_file():
        raise ConfigError(f"config key 'lora.init_from': {d} is not a PEFT adapter directory (no adapter_config.json)")
    conf, state = read_peft_adapter(d)
    if int(conf.get("r", -1)) != lo.rank:
        raise ConfigError(f"config key 'lora.init_from': {d} has r = {conf.get('r')}, this run lora.rank = {lo.rank}")
    norms = (d / REFERENCE_NORMS).is_file()
    if norms and not lo.train_norms:
        raise ConfigError(f"config key 'lora.train_norms': {d / REFERENCE_NORMS} holds trained norms, and this run "
                          "keeps the norms frozen; set lora.train_norms = true")
    if norms:
        state.update(read_reference_norms(d / REFERENCE_NORMS))
    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = unwrapped_name(name)
            if is_adapter_key(key) and key not in state:
                raise ConfigError(f"config key 'lora.init_from': {d} lacks {key} (targets {conf.get('target_modules')})")
            if norms and p.requires_grad and "norm" in key and key not in state:
                raise ConfigError(f"config key 'lora.init_from': {d / REFERENCE_NORMS} lacks the trained norm "
                                  f"'{key}'")
            if p.requires_grad and key in state:
                _copy_full(p, state[key].float())
                n += 1
    return n


VLLM_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def vllm_lora_problems(adapter_dir: str | Path) -> list[str]:
    """What keeps vLLM from serving ``adapter_dir`` as a LoRA adapter (empty: nothing), by vLLM's rules for PEFT
    adapters: every tensor is ``base_model.model.<module>.lora_A|lora_B.weight`` of a target module it supports,
    with ``r`` and ``lora_alpha`` in the config. Trained norms (``modules_to_save``) are not LoRA weights to it:
    such an adapter is served through the merged export (``hf/``) instead."""
    import re

    from safetensors import safe_open

    d = Path(adapter_dir)
    conf = json.loads((d / "adapter_config.json").read_text())
    problems = [f"adapter_config.json lacks {k}" for k in ("r", "lora_alpha", "target_modules") if k not in conf]
    if conf.get("modules_to_save"):
        problems.append(f"modules_to_save {conf['modules_to_save']} (trained norms): vLLM applies LoRA weights only")
    if conf.get("titan_sft_expert_adapters"):
        problems.append("the routed experts' adapters are PEFT target_parameters on the fused 3-D expert "
                        "parameters, outside the linear modules checked here (serve the merged export)")
    if conf.get("titan_sft_dense_mlp_adapters"):
        problems.append(f"dense MLP adapters ({', '.join(conf['titan_sft_dense_mlp_adapters'])}) in a model with "
                        "routed experts: PEFT maps those names to the experts and drops them")
    if conf.get("use_dora"):
        problems.append("use_dora: vLLM serves no DoRA adapter (serve the merged export)")
    pattern = re.compile(r"^base_model\.model\.(.+)\.lora_[AB]\.weight$")
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():
            if ".mlp.experts." in key or key.endswith("lora_magnitude_vector"):
                continue  # said above
            m = pattern.match(key)
            if m is None:
                if not conf.get("modules_to_save"):
                    problems.append(f"{key}: not a LoRA weight")
                continue
            module = m.group(1).rsplit(".", 1)[-1]
            if module not in VLLM_LORA_MODULES or module not in conf.get("target_modules", []):
                problems.append(f"{key}: module {module} is not a supported target")
    return problems


def on_start(model: nn.Module, cfg: JobConfig, exporter) -> None:
    """Keeps the trained norms' starting values for the adapters (``initial_norms.safetensors``), then applies a
    warm start (``lora.init_from``)."""
    from titan_sft.log import logger

    if cfg.lora.train_norms:
        exporter.initial_norms = {k: v for k, v in trainable_full_state(model).items() if "norm" in k}
    if cfg.lora.init_from:
        if cfg.lora.train_norms:
            check_initial_norms(cfg.lora.init_from, exporter.initial_norms)
        n = warm_start(model, cfg.lora.init_from, cfg.lora)
        logger.info(f"[init] warm start: {n} adapter and norm tensors from {cfg.lora.init_from}")


def on_step(model: nn.Module, cfg: JobConfig, exporter, completed_steps: int, total_steps: int) -> None:
    """``adapters/step-<L>`` every ``lora.adapter_interval`` steps (Levanter's cadence), adapter-only snapshots
    apart from the merged exports (which write one beside each ``hf/step-<L>``); the last step's is adapters/final."""
    from titan_sft.checkpoint import hook_fires, label
    from titan_sft.log import logger

    period, export = cfg.lora.adapter_interval, cfg.checkpoint.hf_export_interval
    if period <= 0 or completed_steps == total_steps or not hook_fires(completed_steps, total_steps, period):
        return
    if export >= 0 and hook_fires(completed_steps, total_steps, export):
        return  # the merged export of this step wrote it
    path = exporter.save_adapter(model, Path(cfg.job.dump_folder) / "adapters" / f"step-{label(completed_steps)}")
    logger.info(f"[export] wrote {path}")


def on_end(model: nn.Module, cfg: JobConfig, exporter) -> None:
    """``adapters/final``: the adapter a user serves."""
    from titan_sft.log import logger

    path = exporter.save_adapter(model, Path(cfg.job.dump_folder) / "adapters" / "final")
    logger.info(f"[export] wrote {path}")


register_converter("lora", apply_lora, on_start=on_start, on_end=on_end, on_step=on_step)
