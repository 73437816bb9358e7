"""Built-in model converters: swap modules of the meta-device model before it is sharded.

A converter is ``apply(model, cfg, device)``, registered by name (``titan_sft.registry.register_converter``) and
chosen by config (``training.float8``, ``model.converters``). LoRA arrives as one more converter.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from titan_sft.config import JobConfig
from titan_sft.log import logger
from titan_sft.registry import register_converter


def float8_supported(device: torch.device) -> bool:
    """float8 matmuls need an NVIDIA GPU of compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _import_torchao_float8():
    """torchao's float8 API, imported without the noise of its optional kernels: it logs a warning for every
    prebuilt extension that does not load here (MX/CUTLASS kernels, unused by float8 training) and registers a
    pytree constant that torch now flags as deprecated. Errors still get through."""
    import logging

    quiet = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)
    return Float8LinearConfig, convert_to_float8_training


def apply_float8(model: nn.Module, emulate: bool = False) -> None:
    """torchao float8 training for every block linear (dims divisible by 16); the output head stays bf16.

    Row-wise scaling (one scale per token row of the activations, per output column of the weights): a
    tensor-wise scale would let one document's activations change another's quantisation, breaking the
    recipe's document isolation. ``emulate`` runs the float8 casts with bf16/fp32 matmuls (CPU tests).
    """
    Float8LinearConfig, convert_to_float8_training = _import_torchao_float8()

    def keep(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and fqn.startswith("layers.") and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def float8_converter(model: nn.Module, cfg: JobConfig, device: torch.device) -> None:
    """Hardware-gated float8: below SM 8.9 the run continues in bf16 (and says so); on CPU it is emulated,
    which only serves testing."""
    if device.type == "cuda" and not float8_supported(device):
        logger.warning(f"[parallelize] float8 needs compute capability >= 8.9, {torch.cuda.get_device_name(device)} "
                       f"has {torch.cuda.get_device_capability(device)}: training in bf16 instead")
        return
    apply_float8(model, emulate=device.type != "cuda")


register_converter("float8", float8_converter)
