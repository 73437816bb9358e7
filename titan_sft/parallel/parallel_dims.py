"""The device mesh of a run, from [parallelism] and the world size.

One 6-D mesh ``(pp, dp_replicate, dp_shard_mod_ep, cp, ep, tp)`` (sizes may be 1) with named sub-meshes:

* ``pp``: pipeline parallel (``parallel.pipeline_parallel``), outermost: each pp rank holds other layers, and
  every sub-mesh below is taken within one pp rank's slice (its stage's data-parallel, cp, ep and tp ranks);

* ``dp_shard`` = (dp_shard_mod_ep, ep) flattened: the data-parallel ranks within a replica;
* ``dp_shard_cp`` = (dp_shard_mod_ep, cp, ep) flattened, and (dp_replicate, dp_shard_cp): what FSDP2 shards every
  parameter but the experts over (HSDP: replicate across groups, shard within); the cp ranks hold different
  tokens of the same rows, so their gradients are summed like those of other data-parallel ranks;
* ``dp_flat``: the data-parallel ranks as one dimension, the group of every reduction over data (token counts);
* ``dp_cp``: the data-parallel and cp ranks as one dimension, the group of reductions over computed losses;
* ``cp``: context parallel (``parallel.context_parallel``): ranks that read the same rows and each run a part;
* ``ep``: expert parallel, data-parallel ranks that each hold ``n_experts / ep`` experts and exchange tokens; the
  experts are FSDP-sharded over (dp_replicate, dp_shard_mod_ep_cp), the ranks holding the same experts (the cp
  ranks among them route other tokens of the same rows to them). cp sits before ep in the mesh so that
  (dp_shard_mod_ep, cp) are adjacent dimensions: DTensor redistributes the experts' 2-D shards over a flattened
  mesh only when its dimensions come in order;
* ``tp``: tensor/sequence parallel; its ranks see the same data and hold slices of the same layers. Routed
  experts are the exception: each tp rank runs them on its own sequence slice, so their parameters (and the
  routers') are FSDP-sharded over the tp ranks as well (:func:`moe_fsdp_meshes`), and the objective sums the
  router statistics of whole rows over them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_sft.config import JobConfig, check_layout


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    cp: int
    pp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> "ParallelDims":
        """Validated layout (``config.check_layout``: one clear line on a bad mesh or batch split)."""
        return cls(*check_layout(cfg, world_size), world_size)

    @property
    def dp_world(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def stage_world(self) -> int:
        """The ranks of one pipeline stage."""
        return self.world_size // self.pp

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
        """The 6-D mesh, its flattened data-parallel sub-mesh and the data-parallel x cp one (kept, not sliced
        again from the root)."""
        mesh = init_device_mesh(device_type,
                                (self.pp, self.dp_replicate, self.dp_shard // self.ep, self.cp, self.ep, self.tp),
                                mesh_dim_names=("pp", "dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp"))
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        mesh["dp_shard_mod_ep", "cp", "ep"]._flatten("dp_shard_cp")
        if self.ep > 1 and self.cp > 1:  # the experts' FSDP ranks (a group made only where it differs)
            mesh["dp_shard_mod_ep", "cp"]._flatten("dp_shard_mod_ep_cp")
        dp_cp = mesh["dp_replicate", "dp_shard_mod_ep", "cp", "ep"]._flatten("dp_cp")
        return mesh, mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp_flat"), dp_cp

    def describe(self) -> str:
        return (f"mesh {f'pp {self.pp} x ' if self.pp > 1 else ''}dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x cp {self.cp} x tp {self.tp} = "
                f"{self.world_size} ranks ({'HSDP' if self.dp_replicate > 1 else 'FSDP'}"
                f"{f' x CP {self.cp}' if self.cp > 1 else ''}"
                f"{' x TP + SP' if self.tp > 1 else ''}{f' x EP {self.ep}' if self.ep > 1 else ''}"
                f"{f' x PP {self.pp}' if self.pp > 1 else ''})")


def flattened(mesh: DeviceMesh, dims: tuple[str, ...]) -> str:
    """The name of ``dims`` of ``mesh`` as one flattened dimension (made the first time it is asked for; every rank
    must ask in the same order, as it creates a process group); one dimension is its own name."""
    if len(dims) == 1:
        return dims[0]
    name = "_".join(dims)
    if name not in mesh._get_root_mesh()._flatten_mapping:
        mesh[dims]._flatten(name)
    return name


def moe_fsdp_meshes(mesh: DeviceMesh) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """The FSDP meshes of a model with routed experts, where they differ from the other parameters'
    (dp_replicate, dp_shard_cp): (routers' and, without ep, experts' mesh; experts' mesh under ep), None where
    they do not differ. Under tp the MoE's parameters are plain tensors every tp rank trains on its own tokens,
    so they are sharded over the tp ranks too. Under ep the experts are sharded over the ranks holding the same
    experts within a tp rank: their 2-D shards (FSDP x ep) need mesh dimensions in order, and tp comes after ep,
    so under ep x tp their gradients are summed over tp apart (``distributed.sum_gradients_over_tp``)."""
    tp, cp, ep = (mesh[d].size() > 1 for d in ("tp", "cp", "ep"))
    moe = mesh["dp_replicate", flattened(mesh, ("dp_shard_mod_ep", "cp", "ep", "tp"))] if tp else None
    experts = mesh["dp_replicate", flattened(mesh, ("dp_shard_mod_ep", "cp") if cp else ("dp_shard_mod_ep",))] if ep else None
    return moe, experts

