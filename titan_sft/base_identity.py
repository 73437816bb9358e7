"""The identity of a frozen base, so that a checkpoint can hold the trainable state only.

A LoRA run's regular, temporary and best checkpoints store the adapters (and trained norms), their optimizer
state, the data position and the RNG, and this identity instead of the frozen weights: where the base came from
(:func:`base_source`) and a fingerprint of its values (:func:`fingerprint`). A resume rebuilds the base the way
the run did (HF weights, a weights-only checkpoint, or the seeded init) and compares fingerprints before it
loads anything (:func:`first_difference`).

The fingerprint is, per frozen tensor, the float64 sum, sum of squares and sum of absolute values of its elements.
Unlike a hash of bytes it is the same for every layout (each rank adds its shard, the shards' sums are
all-reduced), so a checkpoint written on 8 FSDP ranks is checked on 1. Sums in another order differ in the last
bits only, so values are compared to a relative 1e-9; a different base (another model, another seed, a base
trained further) differs far more than that.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from titan_sft.parallel import comm

REL_TOL = 1e-9
_CHUNK = 1 << 24  # elements reduced at once in float64: at most 128 MiB of temporary memory


def base_source(cfg) -> dict:
    """Where a run's base weights come from, as its config says (a weights-only start sets its own)."""
    if cfg.model.init_from_hf:
        return {"kind": "hf", "path": cfg.model.hf_assets_path}
    return {"kind": "init", "name": cfg.model.name, "flavor": cfg.model.flavor, "seed": cfg.job.seed}


def describe(source: dict) -> str:
    """One phrase for a :func:`base_source` record."""
    if source["kind"] == "hf":
        return f"HF weights {source['path']}"
    if source["kind"] == "dcp":
        return f"weights-only checkpoint {source['path']}"
    return f"random init of {source['name']} flavor {source['flavor']} with job.seed {source['seed']}"


def _local_stats(t: torch.Tensor) -> torch.Tensor:
    """[sum, sum of squares, sum of |x|] of a local tensor, in float64."""
    flat = t.detach().reshape(-1)
    out = torch.zeros(3, dtype=torch.float64, device=t.device)
    for start in range(0, flat.numel(), _CHUNK):
        c = flat[start:start + _CHUNK].double()
        out += torch.stack([c.sum(), c.square().sum(), c.abs().sum()])
    return out


def fingerprint(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, list[float]]:
    """The fingerprint of ``state``'s tensors ``names`` (plain or DTensor shards), the same on every rank.

    Collective when torch.distributed is initialised: call on every rank, with each rank's own state (a pipeline
    stage's names only; the stages' fingerprints are merged)."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for name in sorted(names):
        t = state[name]
        if isinstance(t, DTensor):  # the shards' sums add up over the mesh dims that shard it
            dims = tuple(i for i, p in enumerate(t.placements) if p.is_shard())
            key = (id(t.device_mesh), dims)
            groups.setdefault(key, []).append((name, _local_stats(t.to_local()), t.device_mesh, dims))
        else:
            groups.setdefault(("plain",), []).append((name, _local_stats(t), None, ()))
    mine = {}
    for members in groups.values():
        stats = torch.stack([s for _, s, _, _ in members])
        mesh, dims = members[0][2], members[0][3]
        for i in dims:
            comm.all_reduce(stats, group=mesh.get_group(i), what="base fingerprint")
        mine.update({n: row for (n, *_), row in zip(members, stats.cpu().tolist())})
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    merged = {}
    for part in reversed(every):  # a tensor two stages hold (a tied head's copy): the lowest rank's numbers
        merged.update(part)
    return dict(sorted(merged.items()))


def first_difference(saved: dict[str, list[float]], now: dict[str, list[float]]) -> str | None:
    """None when the fingerprints agree; else what differs first, in words."""
    missing, extra = sorted(set(saved) - set(now)), sorted(set(now) - set(saved))
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which the checkpoint's base has not"
        return f"this base {which} ({len(missing)} missing, {len(extra)} extra tensors)"
    for name in saved:
        (s0, q0, a0), (s1, q1, a1) = saved[name], now[name]
        scale = max(a0, a1)
        if not (math.isclose(q0, q1, rel_tol=REL_TOL) and math.isclose(a0, a1, rel_tol=REL_TOL)
                and abs(s0 - s1) <= REL_TOL * scale):
            return f"{name} differs (sum of squares {q1:.9g}, the checkpoint's base {q0:.9g})"
    return None
