"""Run under torchrun with N ranks: peak resident memory of one vocab-parallel loss forward+backward on a tp mesh
of N ranks (the head split N ways), printed by rank 0 as 'peak_loss_mib <value>'.

The peak is taken from the kernel's high-water mark (VmHWM), reset just before the loss, so it counts the
loss's own buffers: one chunk of [tokens, vocab / tp] fp32 logits, plus the hidden-state gradient.
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from titan_sft.loss import vocab_parallel_cross_entropy_sum


def hwm_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM")


def rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


vocab, dim, tokens, chunk = int(sys.argv[1]), 64, int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
torch.manual_seed(0)
hidden = distribute_tensor(torch.randn(1, tokens, dim), mesh, [Replicate()]).requires_grad_()
weight = distribute_tensor(torch.randn(vocab, dim) * 0.02, mesh, [Shard(0)]).requires_grad_()
labels = torch.randint(0, vocab, (1, tokens))
dist.barrier()
with open("/proc/self/clear_refs", "w") as f:  # reset the high-water mark to the current RSS
    f.write("5")
base = rss_kib()
loss = vocab_parallel_cross_entropy_sum(hidden, weight, labels, chunk)
loss.backward()
peak = torch.tensor(float(hwm_kib() - base))
dist.all_reduce(peak, op=dist.ReduceOp.MAX)
if dist.get_rank() == 0:
    print(f"peak_loss_mib {peak.item() / 1024:.1f} loss {loss.item():.6f}", flush=True)
dist.barrier()
dist.destroy_process_group()
