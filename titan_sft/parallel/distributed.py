"""Process-group set-up, gradient clipping and cross-rank agreement: the distributed plumbing of a run."""

from __future__ import annotations

import logging
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_sft.config import ConfigError, JobConfig
from titan_sft.parallel import comm
from titan_sft.parallel.parallel_dims import ParallelDims


@dataclass
class DistInfo:
    """Where this process stands: its rank, device, layout and mesh."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh  # (pp, dp_replicate, dp_shard_mod_ep, cp, ep, tp)
    dp_flat: DeviceMesh  # the data-parallel ranks as one dimension
    dp_cp: DeviceMesh  # the data-parallel and context-parallel ranks as one dimension

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (replica-major): it picks this rank's share of a batch.
        The tp ranks of one data-parallel rank get the same share."""
        return self.dp_flat.get_local_rank()

    @property
    def dp_world(self) -> int:
        return self.dims.dp_world

    @property
    def dp_group(self) -> dist.ProcessGroup:
        """The group of reductions over data (token counts, loss denominators): tp and cp ranks hold the same
        data."""
        return self.dp_flat.get_group()

    @property
    def loss_group(self) -> dist.ProcessGroup:
        """The group of reductions over computed losses: each cp rank computes the loss of its part of the rows."""
        return self.dp_cp.get_group()


def init_distributed(cfg: JobConfig) -> DistInfo:
    """Initialises the process group (NCCL on GPU, gloo on CPU) and the device mesh.

    A plain ``python -m titan_sft.train`` (no torchrun) runs as a one-process group. The attention backend is
    checked against the device here, so an impossible choice stops the run before any work.
    """
    from titan_sft.constants import DTYPES
    from titan_sft.log import init_logging, logger
    from titan_sft.models.attention import BackendUnavailable, check_backend, resolve_backend

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    # On GPU: NCCL for CUDA tensors and gloo for CPU ones (object collectives, DCP's planning). The trainer's
    # own collectives run on the GPU (comm checks it); gloo is there for torch's CPU-side exchanges.
    dist.init_process_group("cpu:gloo,cuda:nccl" if use_cuda else "gloo", timeout=timedelta(minutes=30))
    comm.set_device(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = ParallelDims.from_config(cfg, world)
    mesh, dp_flat, dp_cp = dims.build_mesh(device.type)
    init_logging(rank)
    cfg.model.attention, notice = resolve_backend(cfg.model.attention, device)
    if notice:
        logger.info(notice)
    try:
        check_backend(cfg.model.attention, device, DTYPES[cfg.training.param_dtype])
    except BackendUnavailable as e:
        raise ConfigError(str(e)) from None
    if cfg.training.deterministic:
        torch.use_deterministic_algorithms(True)
    return DistInfo(rank, world, local_rank, device, dims, mesh, dp_flat, dp_cp)


def sum_gradients_over_tp(model: torch.nn.Module) -> None:
    """Sums, over the tp ranks, the gradients of the parameters ``model.tp_summed_params`` names (expert parallel
    x tp: experts every tp rank trains on its own tokens, whose FSDP mesh cannot include tp); one all-reduce of
    the step's (sharded) gradients, before clipping. Nothing to do for other models."""
    from torch.distributed.tensor import DTensor

    params, group = getattr(model, "tp_summed_params", ((), None))
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if not grads:
        return
    flat = comm.all_reduce(torch.cat([g.reshape(-1) for g in grads]), group=group, what="expert gradients over tp")
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


def clip_grad_norm_(params, max_norm: float, pp_group=None, copies=()) -> float:
    """Global L2 norm of all gradients over all shards (pre-clip: what is logged), then clipping if max_norm > 0.

    A DTensor gradient whose placements differ from its parameter's (a replicated norm weight used on sharded
    activations gets a Partial gradient) is first brought to the parameter's placements, so the norm counts
    each element once and the optimizer sees gradients laid out like the parameters. Under pipeline parallel
    (``pp_group``) the norm is taken over the gradients of all stages; ``copies`` (a pipeline's second copy of a
    tied weight, whose gradient equals the first's) are clipped alike but not counted.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    # The norm of gradients sharded over (dp_shard, tp) is reduced one mesh dimension at a time: two all-reduces
    # of one scalar, about which DTensor warns on every step. Not worth a line per step.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    for p in params:
        if isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(placements=p.placements)
    # Gradients on different meshes (expert parallel: the experts' mesh is not the other parameters') cannot share
    # one foreach norm: one norm per mesh, combined.
    groups: dict = {}
    for p in params:
        groups.setdefault(id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None, []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], foreach=True)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    norm = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
    if pp_group is not None:  # pipeline parallel: every stage's share of the squared norm
        norm = comm.all_reduce(norm.double().square(), group=pp_group, what="grad norm over pipeline stages"
                               ).sqrt().to(norm.dtype)
    if max_norm > 0:
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm, foreach=True)
        if copies:
            torch.nn.utils.clip_grads_with_norm_(list(copies), max_norm, norm, foreach=True)
    return norm.item()


_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def unwrapped_name(name: str) -> str:
    """A parameter's name without the segments activation checkpointing and compile insert."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


@torch.no_grad()
def init_sharded(model: torch.nn.Module, reference: torch.nn.Module, device: torch.device) -> None:
    """Seeded random init of a parallelized ``model`` from ``reference`` (the same architecture on the meta device,
    exposing ``init_parts()``), identical for any world size and layout.

    Rank 0 materialises one part at a time (the embedding, each block, ...) on ``device``, draws its numbers with
    the current default generator in the model's own order, so the values equal ``reference.init_weights()`` on
    one device, and every rank takes its shards of each tensor (``distribute_tensor`` from rank 0). The whole
    model never exists in one place: the peak is the largest part (Qwen3's embedding), and a GPU run never builds it
    on the host. A GPU draws other numbers than a CPU (another generator), the same for every layout.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titan_sft import nf4
    from titan_sft.checkpoint import tied_aliases

    params = {unwrapped_name(n): p for n, p in model.named_parameters()}
    quantized = nf4.quantized_weights(model)  # NF4 weights (QLoRA): every rank quantizes the whole tensor
    # A pipeline's last stage holds a copy of a tied head: it takes the embedding's numbers.
    copies = {first: alias for alias, first in tied_aliases(reference).items() if alias in params}
    rank = dist.get_rank() if dist.is_initialized() else 0
    for name, init in reference.init_parts():
        part = reference.get_submodule(name)
        part.to_empty(device=device)  # shapes on every rank; the numbers come from rank 0
        if rank == 0:
            init(part)
        fulls = [full for _, full in part.named_parameters()]
        # Pipeline parallel: a rank holds only its stages' parameters.
        targets = [(full, params[f"{name}.{key}"]) for key, full in part.named_parameters() if f"{name}.{key}" in params]
        targets += [(full, params[copies[f"{name}.{key}"]]) for key, full in part.named_parameters()
                    if f"{name}.{key}" in copies]
        # A DTensor scatters from its mesh's first rank. A mesh without rank 0 (one tp rank's FSDP mesh, where
        # routed experts are replicated across tp; another pipeline stage's ranks) needs the numbers first: then
        # the whole part is broadcast and every rank cuts its own shard.
        sinks = [(full, quantized[f"{name}.{key}"]) for key, full in part.named_parameters()
                 if f"{name}.{key}" in quantized]
        outside = len(targets) != len(fulls) or any(isinstance(t, DTensor) and rank0_missing(t.device_mesh)
                                                   for _, t in targets)
        outside = dist.is_initialized() and bool(comm.all_reduce(
            comm.tensor(float(outside)), dist.ReduceOp.MAX, what="random init").item())  # the same on every rank
        if outside:
            for full in fulls:
                comm.broadcast(full.detach(), 0, what="random init")
        for full, target in targets:
            if isinstance(target, DTensor):
                shard = distribute_tensor(full.detach(), target.device_mesh, target.placements,
                                          src_data_rank=None if outside else 0)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(full.detach() if outside else comm.broadcast(full.detach(), 0, what="random init"))
        for full, (module, key) in sinks:
            nf4.fill(module, key, full.detach())
        part.to_empty(device="meta")


def rank0_missing(mesh) -> bool:
    """Whether global rank 0 is not one of ``mesh``'s ranks."""
    return 0 not in mesh.mesh.flatten().tolist()


def shutdown() -> None:
    """Waits for every rank, then tears the process group down (gloo needs the barrier first)."""
    dist.barrier()
    dist.destroy_process_group()
    comm.disable_host_tensor_check()


def exit_process(code: int) -> NoReturn:
    """Ends a command-line process (after :func:`shutdown`) without the interpreter's teardown.

    ``destroy_process_group`` drops c10d's own references only: the gloo groups that FSDP states and meshes still
    hold are freed during interpreter finalization, in native code racing the other ranks' exits. On torch 2.11 that
    teardown aborted (SIGABRT) one rank of a run that had finished and saved everything, which the launcher reports
    as a failed job (and a SLURM script would requeue). By this point every file the command writes is closed
    (checkpoints, metrics, TensorBoard, W&B), so the streams and log handlers are flushed and the process ends.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def new_transient_group() -> dist.ProcessGroup | None:
    """A fresh gloo group over all ranks for one checkpoint save or load (None when not distributed).

    DCP exchanges its (large) save/load plans with ``gather_object``; on gloo the copy runs in the group's worker
    thread as an OpenMP region, and libgomp then keeps an extra worker for that thread as long as the thread
    lives. With the long-lived default group that is the rest of the run: the compute threads stop spinning and
    every later step on CPU is up to 2x slower. A group destroyed after the save takes its thread (and that
    worker) with it. Call on every rank (creating a group is collective).
    """
    return dist.new_group(backend="gloo") if dist.is_initialized() else None


def release_group(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.destroy_process_group(group)


@contextmanager
def transient_group():
    """``with transient_group() as pg: dcp.save(..., process_group=pg)``; see :func:`new_transient_group`."""
    group = new_transient_group()
    try:
        yield group
    finally:
        release_group(group)
