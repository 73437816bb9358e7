"""Applies parallelism and memory/speed features to a meta-device model, in torchtitan's order:
float8 conversion -> activation checkpointing -> per-block torch.compile -> FSDP2 fully_shard (HSDP when the
mesh has a replicate dimension). Tensor parallelism is not implemented (``ParallelDims`` refuses tp > 1).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from titan_sft.config import Training

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def float8_supported(device: torch.device) -> bool:
    """float8 matmuls need an NVIDIA GPU of compute capability 8.9 (Ada) or newer."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def apply_float8(model: nn.Module, emulate: bool = False) -> None:
    """torchao float8 training for every block linear (dims divisible by 16); the output head stays bf16.

    Row-wise scaling (one scale per token row of the activations, per output column of the weights): a
    tensor-wise scale would let one document's activations change another's quantisation, breaking the
    recipe's document isolation. ``emulate`` runs the float8 casts with bf16/fp32 matmuls (CPU tests).
    """
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def keep(mod: nn.Module, fqn: str) -> bool:
        return isinstance(mod, nn.Linear) and fqn.startswith("layers.") and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=emulate)
    convert_to_float8_training(model, config=config, module_filter_fn=keep)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """'full': recompute each block in backward; 'selective': every other block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, (name, block) in enumerate(list(model.layers.named_children())):
        if mode == "full" or (mode == "selective" and i % 2 == 0):
            model.layers.register_module(name, checkpoint_wrapper(block, preserve_rng_state=False))


def apply_compile(model: nn.Module) -> None:
    """Compiles each block separately: identical blocks share one compiled graph, and compile time stays short."""
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(name, torch.compile(block, fullgraph=False))


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, output head).

    The head stays in the root group: the root is not resharded after forward, so the chunked loss inside
    ``forward`` and a tied embedding both see one unsharded tensor.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    n = len(model.layers)
    for i, block in enumerate(model.layers.values()):
        # The last block's params are needed first in backward: keep them gathered after forward.
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < n - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    # Sum, not average, across ranks: the loss is already normalised by global token counts (recipe item 10).
    # Both settings are per FSDP module.
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize_transformer(model: nn.Module, mesh: DeviceMesh, cfg: Training,
                            device: torch.device = torch.device("cpu")) -> nn.Module:
    """Applies the features selected in ``[training]`` and shards ``model`` over ``mesh`` (in place).

    float8 is hardware-gated: on a GPU older than SM 8.9 the run continues in bf16 (and says so); on CPU the
    float8 path is emulated, which only serves testing.
    """
    if cfg.float8:
        if device.type == "cuda" and not float8_supported(device):
            print(f"[parallelize] float8 needs compute capability >= 8.9, {torch.cuda.get_device_name(device)} has "
                  f"{torch.cuda.get_device_capability(device)}: training in bf16 instead", flush=True)
        else:
            apply_float8(model, emulate=device.type != "cuda")
    if cfg.activation_checkpoint != "none":
        apply_activation_checkpointing(model, cfg.activation_checkpoint)
    if cfg.compile:
        apply_compile(model)
    apply_fsdp(model, mesh, DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype])
    return model
