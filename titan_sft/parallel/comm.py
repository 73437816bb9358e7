"""The trainer's own collectives (step statistics, loss denominators, agreement flags), on the compute device.

NCCL only takes CUDA tensors, gloo takes CPU tensors; a collective handed a tensor on the wrong device fails
mid-run (NCCL: "Tensors must be CUDA and dense"). Every collective titan_sft issues itself goes through this
module, which places the tensors it creates on the run's compute device (:func:`set_device`, called by
``init_distributed``) and refuses, with one line naming the call, a tensor that is anywhere else. FSDP's, DTensor's
and DCP's collectives are torch's own and are not routed here.

Without a GPU every tensor is on the CPU, so a tensor that a GPU run would leave on the host cannot be told apart
by its device. ``TITAN_SFT_CHECK_COLLECTIVE_DEVICES=1`` makes the difference visible on a CPU run: tensors made by a
factory function (``torch.tensor``, ``torch.zeros``, ...) without an explicit ``device`` are marked as host tensors,
so are tensors computed only from such tensors, and ``.to(device)`` of one gives an unmarked copy (as on a GPU);
a collective on a marked tensor then fails exactly where NCCL would. The CPU tests run the trainer this way.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_device = torch.device("cpu")
CHECK_ENV = "TITAN_SFT_CHECK_COLLECTIVE_DEVICES"


class CollectiveDeviceError(RuntimeError):
    """A collective was given a tensor on another device than the run's compute device."""


def set_device(device: torch.device) -> None:
    """Sets the compute device the trainer's collectives run on (and, on a CPU run, turns on the host-tensor check
    when ``TITAN_SFT_CHECK_COLLECTIVE_DEVICES=1``; on a GPU the device itself tells)."""
    global _device
    _device = torch.device(device)
    if os.environ.get(CHECK_ENV) == "1" and _device.type == "cpu":
        enable_host_tensor_check()


def device() -> torch.device:
    """The run's compute device: where tensors meant for a collective are created."""
    return _device


def tensor(values: Sequence[float] | float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A tensor of ``values`` on the compute device, for a collective."""
    return torch.tensor(values, dtype=dtype, device=_device)


def zeros(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device=_device)


def _check(t: torch.Tensor, what: str) -> None:
    if t.device != _device or getattr(t, "_titan_host", False):
        where = "the host (made without device=)" if t.device == _device else str(t.device)
        raise CollectiveDeviceError(f"{what}: tensor on {where}, but this run's collectives run on {_device} "
                                    f"(NCCL takes CUDA tensors only); create it with titan_sft.parallel.comm.tensor "
                                    f"or move it with .to(comm.device())")


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM, group=None, what: str = "all_reduce") -> torch.Tensor:
    """In-place all-reduce of ``t`` (returned); a no-op without a process group."""
    _check(t, what)
    if dist.is_initialized():
        dist.all_reduce(t, op=op, group=group)
    return t


def all_reduce_autograd(t: torch.Tensor, group, what: str = "all_reduce") -> torch.Tensor:
    """The sum of ``t`` over ``group``, differentiable (the gradient is summed over the group on the way back)."""
    from torch.distributed.nn.functional import all_reduce as all_reduce_fn

    _check(t, what)
    return all_reduce_fn(t, group=group)


class _AllReduceSameLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, group):
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_reduce_same_loss(t: torch.Tensor, group, what: str = "all_reduce") -> torch.Tensor:
    """The sum of ``t`` over ``group`` for ranks that then compute the same loss from it and each backpropagate it
    whole (tensor-parallel ranks): the gradient passes back unchanged, not summed over the group."""
    _check(t, what)
    return _AllReduceSameLoss.apply(t, group)


def broadcast(t: torch.Tensor, src: int = 0, group=None, what: str = "broadcast") -> torch.Tensor:
    """In-place broadcast of ``t`` from global rank ``src`` (returned); a no-op without a process group."""
    _check(t, what)
    if dist.is_initialized():
        dist.broadcast(t, src, group=group)
    return t


def all_to_all_counts(counts: torch.Tensor, group, what: str = "expert-parallel counts") -> torch.Tensor:
    """Equal chunks of ``counts`` exchanged across ``group`` (chunk p goes to rank p); no gradient."""
    _check(counts, what)
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                    what: str = "expert-parallel rows") -> torch.Tensor:
    """Rows of ``x`` sent in blocks of ``input_splits`` to the ranks of ``group``, received in blocks of
    ``output_splits``; differentiable (the gradient takes the way back)."""
    from titan_sft.compat import all_to_all_single_autograd

    _check(x, what)
    return all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)


def all_gather_rows(x: torch.Tensor, group, what: str = "all-gather rows") -> torch.Tensor:
    """``x`` of every rank of ``group`` stacked along dim 0 (rank-major); differentiable (the gradient is
    reduce-scattered back)."""
    from titan_sft.compat import all_gather_tensor_autograd

    _check(x, what)
    return all_gather_tensor_autograd(x.contiguous(), 0, group)


class _HostTensorMarker(TorchFunctionMode):
    """Marks tensors a GPU run would hold on the host (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from titan_sft.compat import device_constructors

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not isinstance(out, torch.Tensor):
            return out
        if func in device_constructors() or func in (torch.from_numpy, torch.as_tensor):
            if kwargs.get("device") is None:
                out._titan_host = True
            return out
        if func in (torch.Tensor.to, torch.Tensor.cuda) and _moves_to_device(args, kwargs):
            # On a GPU this is a copy to the device; on CPU .to() may return the tensor itself.
            return out.clone() if getattr(out, "_titan_host", False) else out
        inputs = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor)]
        if inputs and all(getattr(a, "_titan_host", False) for a in inputs) and out is not inputs[0]:
            out._titan_host = True
        return out


def _moves_to_device(args, kwargs) -> bool:
    targets = [a for a in list(args[1:]) + [kwargs.get("device")] if isinstance(a, (torch.device, str))]
    return any(torch.device(a).type == _device.type for a in targets)


def _flat(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


_marker: _HostTensorMarker | None = None


def enable_host_tensor_check() -> None:
    """Turns on host-tensor marking in this thread until :func:`disable_host_tensor_check` (idempotent)."""
    global _marker
    if _marker is None:
        _marker = _HostTensorMarker()
        _marker.__enter__()


def disable_host_tensor_check() -> None:
    """Turns host-tensor marking off again (the trainer's shutdown calls it: a process may run more after)."""
    global _marker
    if _marker is not None:
        _marker.__exit__(None, None, None)
        _marker = None
