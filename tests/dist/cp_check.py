"""Run under torchrun with 2 ranks (gloo, fp32): context parallel against the unsharded model, on packed rows of
ragged documents. Every rank builds the same model twice (seeded), one given context parallel over both ranks.

For each case (cp_mode ulysses / ring, causal / bidirectional, 2 or 1 key/value heads: 1 is fewer than cp, so
Ulysses repeats them) it checks, and rank 0 prints one ``case ...`` line with the measured differences:

* the loss (weighted CE sum, the objectives' form) of the rows sharded over cp, summed over the ranks, equals the
  unsharded loss within 1e-6 relative, and every parameter's gradient (summed over the ranks, as FSDP does)
  equals the unsharded one within 1e-5 relative of the largest;
* a document leak: changing the earlier documents of a row changes no hidden state of its last document in any
  shard (bit for bit); bidirectional cases also change the last document and compare the others.

Then ``memory ...``: bytes of the tensors autograd saves for backward (activation memory, each storage counted
once; sdpa's mask apart, see :func:`saved_bytes`) in one forward of a long row at cp 2 and on one rank, and their
ratio.
"""

import dataclasses
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from titan_sft.loss import chunked_cross_entropy_sum
from titan_sft.models import build_model
from titan_sft.parallel import comm
from titan_sft.parallel.context_parallel import apply_context_parallel
from titan_sft.registry import get_train_spec

DEBUG = get_train_spec("qwen3").flavors["debug"]
DOCS = [[37, 101, 5, 113], [200, 56], [1, 90, 64, 40, 61]]  # three rows of 256 tokens, ragged documents


def models(args, mode, mesh):
    torch.manual_seed(0)
    ref = build_model(args, "cpu")
    ref.init_weights()
    cp = build_model(args, "cpu")
    cp.load_state_dict(ref.state_dict())
    return ref, cp, apply_context_parallel(cp, mesh, mode)


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    length = sum(DOCS[0])
    ids = torch.randint(0, DEBUG.vocab_size, (len(DOCS), length), generator=g)
    labels = torch.randint(0, DEBUG.vocab_size, (len(DOCS), length), generator=g)
    labels[torch.rand(labels.shape, generator=g) < 0.3] = -100
    weights = torch.rand(labels.shape, generator=g).float() * (labels != -100)
    cu = torch.tensor([0] + [sum(DOCS[r]) * r + sum(d[:i + 1]) for r, d in enumerate(DOCS) for i in range(len(d))],
                      dtype=torch.int32)
    return ids, labels, weights, cu


def loss_of(model, ids, labels, weights, cu, positions):
    hidden = model(ids, cu_seqlens=cu, positions=positions, hidden_only=True)
    return chunked_cross_entropy_sum(hidden, model.output.weight, labels, 100, weights)


def check_case(mode, causal, kv_heads, mesh):
    args = dataclasses.replace(DEBUG, causal=causal, n_kv_heads=kv_heads)
    ref, cp, shard = models(args, mode, mesh)
    ids, labels, weights, cu = batch()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    full = loss_of(ref, ids, labels, weights, cu, positions)
    full.backward()
    part = loss_of(cp, *(shard.rows(x) for x in (ids, labels, weights)), cu, shard.rows(positions))
    part.backward()
    total = comm.all_reduce(part.detach().double().clone(), what="cp loss")
    loss_rel = abs(total.item() - full.item()) / abs(full.item())
    assert loss_rel <= 1e-6, (mode, causal, kv_heads, total.item(), full.item())
    grad_rel = 0.0
    for (name, p), q in zip(ref.named_parameters(), cp.parameters()):
        g = comm.all_reduce(q.grad.clone(), what="cp grad")
        grad_rel = max(grad_rel, ((g - p.grad).abs().max() / p.grad.abs().max()).item())
    assert grad_rel <= 1e-5, (mode, causal, kv_heads, grad_rel)

    # Document leak: the last document of row 0 must not see the others (nor, bidirectional, they it).
    with torch.no_grad():
        last = sum(DOCS[0][:-1])
        here = shard.index(ids.shape[1])
        base = cp(shard.rows(ids), cu_seqlens=cu, positions=shard.rows(positions), hidden_only=True)
        checks = [(slice(0, last), here >= last)] + ([(slice(last, None), here < last)] if not causal else [])
        for changed, kept in checks:
            other = ids.clone()
            other[0, changed] = (other[0, changed] + 1) % DEBUG.vocab_size
            out = cp(shard.rows(other), cu_seqlens=cu, positions=shard.rows(positions), hidden_only=True)
            assert torch.equal(out[0, kept], base[0, kept]), (mode, causal, "leak")
            if (~kept).any():  # the change itself is seen where it should be
                assert not torch.equal(out[0, ~kept], base[0, ~kept])
    return loss_rel, grad_rel


def saved_bytes(model, fn) -> tuple[int, int]:
    """Bytes of the distinct storages autograd saves for backward while ``fn`` runs, ``model``'s parameters
    excluded: (activations, the outputs of differentiable ops; the rest, inputs that need no gradient). The rest
    is sdpa's dense document mask, which the CPU kernel saves as an fp32 [T, T] additive mask: whole rows on
    every rank under Ulysses (varlen and flex on GPU build none)."""
    seen, rest = {}, {}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t):
        try:
            s = t.untyped_storage()
            key, size = s.data_ptr(), s.nbytes()
        except RuntimeError:  # a wrapper subclass (a collective's pending result): count its elements
            key, size = id(t), t.numel() * t.element_size()
        if key not in params:
            (seen if t.requires_grad else rest)[key] = size
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return sum(seen.values()), sum(rest.values())


def check_memory(mesh, length):
    args = dataclasses.replace(DEBUG, n_layers=2)
    ref, cp, shard = models(args, "ulysses", mesh)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, DEBUG.vocab_size, (1, length), generator=g)
    labels = torch.randint(0, DEBUG.vocab_size, (1, length), generator=g)
    cu = torch.tensor([0, length // 3, length], dtype=torch.int32)
    pos = torch.arange(length).unsqueeze(0)
    one = saved_bytes(ref, lambda: loss_of(ref, ids, labels, None, cu, pos))
    two = saved_bytes(cp, lambda: loss_of(cp, shard.rows(ids), shard.rows(labels), None, cu, shard.rows(pos)))
    return one, two


def main():
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    for mode in ("ulysses", "ring"):
        for causal in (True, False):
            for kv in (2, 1):
                loss_rel, grad_rel = check_case(mode, causal, kv, mesh)
                if dist.get_rank() == 0:
                    print(f"case {mode} causal={causal} kv_heads={kv} loss_rel {loss_rel:.2e} grad_rel {grad_rel:.2e}",
                          flush=True)
    (one, one_mask), (two, two_mask) = check_memory(mesh, int(sys.argv[1]) if len(sys.argv) > 1 else 4096)
    worst = torch.tensor([float(two), float(two_mask)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        print(f"memory activations cp1 {one / 2**20:.1f} MiB cp2 {worst[0].item() / 2**20:.1f} MiB ratio "
              f"{worst[0].item() / one:.3f}; sdpa mask cp1 {one_mask / 2**20:.1f} MiB cp2 {worst[1].item() / 2**20:.1f} "
              "MiB", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
