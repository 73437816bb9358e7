"""Built-in model converters: swap modules of the meta-device model before it is sharded.

A converter is ``apply(model, cfg, device)``, registered by name (``titan_sft.registry.register_converter``) and
chosen by config (``training.float8``, ``model.converters``). LoRA (``titan_sft.lora``) registers itself from
its own module, imported here so that ``get_converter("lora")`` finds it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types

import torch
import torch.nn.functional as F
from torch import nn

from titan_sft.config import JobConfig
from titan_sft.log import logger
from titan_sft.registry import register_converter


def float8_supported(device: torch.device) -> bool:
    """float8 matmuls need an NVIDIA GPU of compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


@contextlib.contextmanager
def _quiet_torchao():
    """Imports torchao without the noise of its optional kernels: it logs a warning for every prebuilt extension
    that does not load here (MX/CUTLASS kernels, unused by float8 training) and registers a pytree constant that
    torch now flags as deprecated. Errors still get through."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def _import_torchao_float8():
    """torchao's float8 linear API (imported quietly)."""
    with _quiet_torchao():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return Float8LinearConfig, convert_to_float8_training


EXPERT_WEIGHTS = ("w1", "w2", "w3")
FLOAT8_GROUP_ALIGN = 16  # rows per expert group that torchao's float8 grouped GEMM needs (torchtitan pads to 16)


def float8_experts_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """torchao's float8 grouped GEMM (row-wise scales) runs on CUDA with compute capability 9.0+, bf16 operands."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0) and dtype == torch.bfloat16


def apply_float8_experts(model: nn.Module) -> list[str]:
    """The routed experts' stacked weights become torchao's float8 training weights (its ``moe_training``
    prototype): every ``torch._grouped_mm`` on them quantises both operands row-wise to float8 and runs the
    scaled grouped GEMM, forward and backward; the weight itself stays high precision (``._data``), so FSDP,
    checkpoints and the HF export see the same tensor. That GEMM needs every expert's row group aligned to 16
    rows (torchao 0.18): the experts pad their groups (``GroupedExperts.row_align``, zero rows that change no
    number). Returns the converted weights' names."""
    with _quiet_torchao():
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.prototype.moe_training.tensor import Float8TrainingWeightWrapperTensor

    from titan_sft.models.moe import GroupedExperts

    config, names = Float8TrainingOpConfig(), []
    for fqn, m in model.named_modules():
        if isinstance(m, GroupedExperts):
            m.row_align = FLOAT8_GROUP_ALIGN
            for w in EXPERT_WEIGHTS:
                p = getattr(m, w)
                m.register_parameter(w, nn.Parameter(Float8TrainingWeightWrapperTensor(p.data, config),
                                                     requires_grad=p.requires_grad))
                names.append(f"{fqn}.{w}")
    return names


def float8_module_filter(mod: nn.Module, fqn: str) -> bool:
    """Which linears become float8: those of the transformer blocks whose dims are multiples of 16 (the float8
    matmul's tile); the output head stays in bf16 (its logits feed the loss directly), and so do MoE routers
    (a rounding of their logits changes which experts a token reaches) and Gated DeltaNet's ``in_proj_a`` and
    ``in_proj_b`` (one column per value head: no speed to win, and they set the decay rates and write strengths,
    whose gradients are the layer's most ill-conditioned)."""
    return (isinstance(mod, nn.Linear) and fqn.startswith("layers.") and ".router." not in fqn
            and not fqn.endswith((".in_proj_a", ".in_proj_b"))
            and mod.in_features % 16 == 0 and mod.out_features % 16 == 0)


def apply_float8(model: nn.Module, recipe: str = "rowwise", emulate: bool = False,
                 fsdp_float8_all_gather: bool = False) -> list[str]:
    """torchao float8 training for the block linears; returns the converted module names.

    Row-wise scaling (one scale per token row of the activations) is the default: with a tensor-wise scale one
    document's activations change the quantisation of every other document in the packed row, so the recipe's
    document isolation no longer holds bit for bit. Tensor-wise is faster and can all-gather FSDP shards in
    float8. ``emulate`` runs the float8 casts with high-precision matmuls (CPU tests).
    """
    Float8LinearConfig, convert_to_float8_training = _import_torchao_float8()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    if fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=float8_module_filter)
    return [n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"]


TE_INSTALL = "pip install 'transformer-engine[pytorch]'  (or: pip install 'titan_sft[gpu]')"
BLOCK_LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3")


def te_gate(device: torch.device) -> str:
    """Whether Transformer Engine float8 can run: "ok", "incapable" (CPU or below SM 8.9: bf16 instead), or
    "missing" (a capable GPU without the library: the run stops and says what to install)."""
    import importlib.util

    if device.type != "cuda" or not float8_supported(device):
        return "incapable"
    return "ok" if importlib.util.find_spec("transformer_engine") is not None else "missing"


def te_recipe_kwargs(t) -> dict:
    """DelayedScaling's arguments from ``[training] te_*`` (the reference trainer's defaults: HYBRID, margin 0,
    interval 1, amax history 1024, amax "max", no precision override)."""
    return {"fp8_format": t.te_format, "margin": t.te_margin, "interval": t.te_interval,
            "amax_history_len": t.te_amax_history_len, "amax_compute_algo": t.te_amax_compute_algo,
            "override_linear_precision": tuple(t.te_override_linear_precision)}


def apply_te_float8(model: nn.Module, recipe_kwargs: dict) -> list[str]:
    """Swaps the block projections for Transformer Engine linears (same parameter names, so checkpoints and HF
    export are unchanged) and runs each block under ``te.fp8_autocast`` with a delayed-scaling recipe of
    ``recipe_kwargs`` (:func:`te_recipe_kwargs`; an argument the installed TE no longer takes, such as
    ``interval`` in TE 2, is left out when it has its default). The embedding and the output head stay in bf16."""
    import inspect

    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    kwargs = {**recipe_kwargs, "fp8_format": getattr(Format, recipe_kwargs["fp8_format"])}
    accepted = set(inspect.signature(DelayedScaling).parameters)
    if "interval" not in accepted and kwargs.get("interval", 1) == 1:
        kwargs.pop("interval", None)
    recipe = DelayedScaling(**kwargs)
    converted = []
    for name, block in model.layers.named_children():
        for fqn in BLOCK_LINEARS:
            parent_name, attr = fqn.rsplit(".", 1)
            parent = block.get_submodule(parent_name)
            old = getattr(parent, attr, None)
            if not isinstance(old, nn.Linear) or old.in_features % 16 or old.out_features % 16:
                continue  # an MoE block's experts are stacked tensors, not linears
            setattr(parent, attr, te.Linear(old.in_features, old.out_features, bias=False,
                                             params_dtype=old.weight.dtype, device=old.weight.device))
            converted.append(f"layers.{name}.{fqn}")
        contexts = {}

        def enter(mod, args, _contexts=contexts):
            _contexts[id(mod)] = ctx = te.fp8_autocast(enabled=_FLOAT8_ON.get(), fp8_recipe=recipe)
            ctx.__enter__()

        def leave(mod, args, output, _contexts=contexts):
            _contexts.pop(id(mod)).__exit__(None, None, None)

        block.register_forward_pre_hook(enter)
        block.register_forward_hook(leave)
    return converted


_FLOAT8_ON = contextvars.ContextVar("titan_sft_float8_on", default=True)  # read by the TE blocks' fp8_autocast


def _high_precision_forward(self, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    if hasattr(weight, "to_original_precision"):  # gathered in float8 (tensorwise FSDP all-gather): dequantised
        weight = weight.to_original_precision()
    out = F.linear(x, weight, self.bias)
    if hasattr(self, "lora_a"):  # float8 + LoRA: the adapter's part is high precision anyway
        from titan_sft.lora import lora_update

        out = out + lora_update(self, x)
    return out


def _high_precision_expert_weight(self, name: str) -> torch.Tensor:
    from titan_sft.models.moe import GroupedExperts

    w = GroupedExperts.weight(self, name)
    return w._data if type(w).__name__ == "Float8TrainingWeightWrapperTensor" else w  # its bf16 weight


@contextlib.contextmanager
def high_precision_matmuls(model: nn.Module):
    """Inside, float8-converted linears and experts compute in the model's compute dtype (bf16), as if never
    converted.

    Validation and generation run in it, so their metrics do not depend on the training precision (the masked
    diffusion spec: "validation stays bf16"). torchao's ``Float8Linear`` gets a plain linear forward for the
    duration; Transformer Engine blocks enter ``fp8_autocast(enabled=False)``. Weights that FSDP all-gathered in
    float8 (tensorwise on GPU) arrive quantised and are dequantised, not re-gathered.
    """
    from titan_sft.lora import is_float8_linear

    from titan_sft.models.moe import GroupedExperts

    swapped = [m for m in model.modules() if is_float8_linear(m)]
    for m in swapped:
        m.forward = types.MethodType(_high_precision_forward, m)
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    aligns = [m.row_align for m in experts]
    for m in experts:  # the high-precision grouped GEMM needs no aligned groups: unpadded, as never converted
        m.weight = types.MethodType(_high_precision_expert_weight, m)
        m.row_align = 1
    token = _FLOAT8_ON.set(False)
    try:
        yield
    finally:
        _FLOAT8_ON.reset(token)
        for m in swapped:
            del m.forward
        for m, align in zip(experts, aligns):
            del m.weight
            m.row_align = align


def float8_converter(model: nn.Module, cfg: JobConfig, device: torch.device) -> None:
    """Hardware-gated float8: below SM 8.9 the run continues in bf16 (and says so); on CPU it is emulated,
    which only serves testing. Tensor-wise on GPU all-gathers FSDP shards in float8, with the scales of all
    weights computed in one pass after each optimizer step. ``float8_backend = "te"`` uses Transformer Engine."""
    if cfg.training.float8_backend == "te":
        gate = te_gate(device)
        if gate == "missing":
            from titan_sft.config import ConfigError

            raise ConfigError(f"config key 'training.float8_backend': 'te' needs Transformer Engine on this "
                              f"{torch.cuda.get_device_name(device)}: {TE_INSTALL}; or float8_backend = 'torchao'")
        if gate == "incapable":
            where = (f"{torch.cuda.get_device_name(device)} (compute capability "
                     f"{torch.cuda.get_device_capability(device)})" if device.type == "cuda" else device.type)
            logger.warning(f"[parallelize] Transformer Engine float8 needs compute capability 8.9 or 9.0+; {where} "
                           "has not: training in bf16 instead")
            return
        apply_te_float8(model, te_recipe_kwargs(cfg.training))
        return
    if device.type == "cuda" and not float8_supported(device):
        logger.warning(f"[parallelize] float8 needs compute capability >= 8.9, {torch.cuda.get_device_name(device)} "
                       f"has {torch.cuda.get_device_capability(device)}: training in bf16 instead")
        return
    recipe = cfg.training.float8_recipe
    all_gather = recipe == "tensorwise" and device.type == "cuda"  # gloo cannot all-gather float8 tensors
    apply_float8(model, recipe, emulate=device.type != "cuda", fsdp_float8_all_gather=all_gather)
    if model.args.n_experts:
        from titan_sft.constants import DTYPES

        dtype = DTYPES[cfg.training.param_dtype]
        if float8_experts_supported(device, dtype):
            apply_float8_experts(model)
        else:
            logger.warning(f"[parallelize] float8 grouped GEMM for the routed experts needs CUDA with compute "
                           f"capability 9.0+ and bf16; on {device.type} ({dtype}) the experts compute in {dtype} "
                           "(the other block linears are float8)")
    if all_gather:  # the trainer calls it after each step of its own optimizer (never a process-wide hook)
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        model.after_optimizer_step = functools.partial(precompute_float8_dynamic_scale_for_fsdp, model)


register_converter("float8", float8_converter)

import titan_sft.lora  # noqa: E402,F401 - registers "lora"
