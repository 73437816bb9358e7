"""Under torchrun: gradient bytes a rank holds between microbatches, per ``parallelism.grad_reduce`` policy.

    python -m torch.distributed.run --standalone --nproc_per_node=2 benchmarks/grad_memory.py [--flavor 100M]

Builds the model as the trainer does (FSDP2 over the ranks), runs 4 microbatches of forward/backward with each
policy and, after each backward, counts the bytes of the sharded gradients plus the whole (unsharded) gradients
FSDP keeps while it defers the reduce-scatter. Prints one line per policy from rank 0.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
import bench_families  # noqa: E402,F401  (registers qwen3_bench with the 100M flavor)

from titan_sft.config import load_config  # noqa: E402
from titan_sft.parallel import init_distributed  # noqa: E402
from titan_sft.registry import get_train_spec  # noqa: E402


def held_grad_bytes(model) -> int:
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    total = sum(p.grad.to_local().numel() * 4 for p in model.parameters() if p.grad is not None)
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        group = getattr(state, "_fsdp_param_group", None) if state else None
        for fp in (group.fsdp_params if group else []):
            acc = fp.unsharded_accumulated_grad
            if acc is not None:
                total += acc.numel() * acc.element_size()
            grad = fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
            if grad is not None:
                total += grad.numel() * grad.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="100M")
    a = ap.parse_args()
    cfg = load_config(None, ["--model.name", "qwen3_bench", "--model.flavor", a.flavor,
                             "--training.param_dtype", "float32", "--training.global_batch_size", "8"])
    d = init_distributed(cfg)
    spec = get_train_spec("qwen3_bench")
    args = spec.flavors[a.flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    spec.parallelize_fn(model, d.mesh, cfg, d.device, spec.tp_plan_fn())
    model.to_empty(device="cpu")
    model.init_weights()
    x = torch.randint(0, 256, (1, 256))
    for policy in ("per_microbatch", "last_microbatch"):
        peaks = []
        for k in range(4):
            model.set_requires_gradient_sync(policy == "per_microbatch" or k == 3)
            model(x, hidden_only=True).float().pow(2).mean().backward()
            peaks.append(held_grad_bytes(model))
        model.zero_grad(set_to_none=True)
        if d.rank == 0:
            print(f"{policy}: gradient MiB held after microbatches 1-4: "
                  f"{', '.join(f'{b / 2**20:.0f}' for b in peaks)} (max {max(peaks) / 2**20:.0f})", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
