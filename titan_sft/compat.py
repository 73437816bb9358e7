"""The one place titan_sft touches private torch API, and the supported torch range it is tested on.

Supported: torch >= 2.11, < 2.14 (``SUPPORTED_TORCH``; CI runs the whole suite on 2.13 and every layout family on
2.11). Each private name below says which torch has it. Where the oldest supported torch lacks one, the function
here gives the fallback with the same numbers, or says (``PER_PARAM_MESH``) so that the caller refuses that one
feature with a line naming the torch it needs. Nothing outside this module imports a private torch name
(tests/test_architecture.py checks it).
"""

from __future__ import annotations

import torch

SUPPORTED_TORCH = ">=2.11,<2.14"

# FSDP2's per-parameter mesh: ``shard_placement_fn`` may return ``ShardPlacementResult(placement, mesh_info)``,
# so one FSDP module holds parameters sharded over different meshes (the routed experts' and the rest).
# torch 2.13 has it; torch 2.11's shard_placement_fn accepts only ``Shard`` or None.
try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult as _ShardPlacementResult
except ImportError:  # torch < 2.13
    _ShardPlacementResult = None
PER_PARAM_MESH = _ShardPlacementResult is not None
PER_PARAM_MESH_TORCH = "2.13"

# FSDP2 shards frozen integer parameters (QLoRA's NF4 codes) from torch 2.13; torch 2.11's FSDP2 wraps each shard
# in an nn.Parameter that requires grad, which an integer tensor cannot. There they are left out of FSDP
# (``ignored_params``): every rank holds them whole, with the same values, so the numbers do not change.
FSDP_INTEGER_PARAMS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def shard_on_mesh(mesh):
    """A ``shard_placement_fn`` result that shards a parameter on dim 0 over ``mesh`` instead of its FSDP module's
    mesh (torch >= 2.13; check ``PER_PARAM_MESH`` first)."""
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info  # torch 2.11+
    from torch.distributed.tensor import Shard

    return _ShardPlacementResult(Shard(0), _get_mesh_info(mesh))


def checkpoint_wrapper(module, **kwargs):
    """torch's activation-checkpoint wrapper module (``torch.distributed.algorithms._checkpoint``; torch 2.0+)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper as wrap

    return wrap(module, **kwargs)


def flex_attention_op():
    """Flex attention's higher-order op, as selective AC's policy sees it (torch 2.5+)."""
    return torch._higher_order_ops.flex_attention


def allow_unbacked_scalars() -> None:
    """Lets data-dependent sizes (``.item()``/``.tolist()`` results: rows per expert) into compiled graphs as
    unbacked symbols instead of graph breaks (``torch._dynamo.config``; torch 2.1+)."""
    torch._dynamo.config.capture_scalar_outputs = True


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (torch 2.8+ on CUDA SM 9.0+, 2.9+ on CPU): rows of ``a`` in groups ending at
    ``offs`` times ``b[g]``."""
    return torch._grouped_mm(a, b, offs=offs)


def has_grouped_mm() -> bool:
    return hasattr(torch, "_grouped_mm")


def all_to_all_single_autograd(x, output_splits, input_splits, group):
    """Differentiable uneven all-to-all (``torch.distributed._functional_collectives``; torch 2.3+)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as a2a

    return a2a(x, output_splits, input_splits, group)


def all_gather_tensor_autograd(x, dim: int, group):
    """Differentiable all-gather (``torch.distributed._functional_collectives``; torch 2.3+)."""
    from torch.distributed._functional_collectives import all_gather_tensor_autograd as gather

    return gather(x, dim, group)


def device_constructors():
    """The factory functions that take a ``device`` argument (``torch.utils._device``; torch 2.0+)."""
    from torch.utils._device import _device_constructors

    return _device_constructors()


def local_shape_and_offset(shape, mesh, placements):
    """A DTensor's local shard shape and global offset on this rank (``torch.distributed.tensor._utils``;
    torch 2.4+)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return compute_local_shape_and_global_offset(shape, mesh, placements)
