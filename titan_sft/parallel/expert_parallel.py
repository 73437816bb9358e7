"""Expert parallel: each MoE layer's experts split across the ``ep`` mesh dimension, tokens sent to them.

``apply_expert_parallel`` shards every stacked expert tensor by expert (``Shard(0)`` on the ep mesh: rank r of
ep holds experts ``[r E / ep, (r + 1) E / ep)``) and installs :class:`AllToAllDispatch` as the MoE modules'
``dispatch``. The ep ranks are data-parallel ranks: each routes its own tokens, and per layer

1. the (token, slot) rows, already sorted by expert, are counted per expert and the counts exchanged
   (all-to-all of E integers), so every rank knows how many rows it sends to and receives from each peer;
2. the rows go to the ranks holding their experts (all-to-all, uneven splits; autograd carries the gradient back
   the same way), are regrouped expert-major, and run through the local experts as one grouped GEMM;
3. the outputs return by the inverse all-to-all, in the order they left, and the MoE combines them as without EP.

The split sizes reach the host (one sync per layer and direction), as torch's all-to-all needs them there. FSDP
then shards the experts over the ranks that hold the same experts (parallelize.apply_fsdp).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from titan_sft.models.moe import MoE
from titan_sft.parallel import comm


class AllToAllDispatch:
    """``MoE.dispatch`` under expert parallel (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int):
        self.group, self.ep = group, dist.get_world_size(group)
        self.local = n_experts // self.ep

    def __call__(self, experts: nn.Module, rows: torch.Tensor, counts: torch.Tensor, impl: str) -> torch.Tensor:
        P, L = self.ep, self.local
        received = comm.all_to_all_counts(counts, self.group)  # [P * L]: from peer p, for my local expert l
        send = counts.view(P, L).sum(1).tolist()
        recv_pl = received.view(P, L)
        recv = recv_pl.sum(1).tolist()
        x = comm.all_to_all_rows(rows, recv, send, self.group)
        # Arrived peer-major (peer, local expert); the grouped GEMM needs expert-major rows.
        order = _peer_to_expert_major(recv_pl)
        y = experts(x[order], recv_pl.sum(0), impl)
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order), device=order.device)
        return comm.all_to_all_rows(y[back], send, recv, self.group)


def _peer_to_expert_major(counts: torch.Tensor) -> torch.Tensor:
    """Row indices that reorder rows laid out in blocks (peer p, expert l) of ``counts[p, l]`` rows, peer-major,
    into expert-major order (all of expert 0's rows from every peer, then expert 1's, ...)."""
    P, L = counts.shape
    flat = counts.flatten()
    starts = torch.cumsum(flat, 0) - flat  # where each (p, l) block begins in the peer-major layout
    blocks = torch.arange(P * L, device=counts.device).view(P, L).t().flatten()  # (l, p) order of the blocks
    sizes = flat[blocks]
    first = torch.repeat_interleave(starts[blocks], sizes)
    within = torch.arange(int(sizes.sum()), device=counts.device) - torch.repeat_interleave(
        torch.cumsum(sizes, 0) - sizes, sizes)
    return first + within


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards the experts of every MoE layer over ``ep_mesh`` by expert and routes tokens by all-to-all."""
    group = ep_mesh.get_group()
    for module in model.modules():
        if isinstance(module, MoE):
            experts = module.experts
            for name, p in list(experts.named_parameters(recurse=False)):
                sharded = distribute_tensor(p.data, ep_mesh, [Shard(0)])
                experts.register_parameter(name, nn.Parameter(sharded, requires_grad=p.requires_grad))
            module.dispatch = AllToAllDispatch(group, module.n_experts)
