"""The device mesh of a run, from [parallelism] and the world size.

One 4-D mesh ``(dp_replicate, dp_shard_mod_ep, ep, tp)`` (sizes may be 1) with named sub-meshes:

* ``dp_shard`` = (dp_shard_mod_ep, ep) flattened, and (dp_replicate, dp_shard): what FSDP2 shards every parameter
  but the experts over (HSDP: replicate across groups, shard within);
* ``dp_flat``: the data-parallel ranks as one dimension, the group of every data-parallel reduction;
* ``ep``: expert parallel, data-parallel ranks that each hold ``n_experts / ep`` experts and exchange tokens; the
  experts are FSDP-sharded over (dp_replicate, dp_shard_mod_ep), the ranks holding the same experts;
* ``tp``: tensor/sequence parallel; its ranks see the same data and hold slices of the same layers.
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
    world_size: int

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> "ParallelDims":
        """Validated layout (``config.check_layout``: one clear line on a bad mesh or batch split)."""
        return cls(*check_layout(cfg, world_size), world_size)

    @property
    def dp_world(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """The 3-D mesh and its flattened data-parallel sub-mesh (kept, not sliced again from the root)."""
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard // self.ep, self.ep, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
        mesh["dp_shard_mod_ep", "ep"]._flatten("dp_shard")
        return mesh, mesh["dp_replicate", "dp_shard_mod_ep", "ep"]._flatten("dp_flat")

    def describe(self) -> str:
        return (f"mesh dp_replicate {self.dp_replicate} x dp_shard {self.dp_shard} x tp {self.tp} = "
                f"{self.world_size} ranks ({'HSDP' if self.dp_replicate > 1 else 'FSDP'}"
                f"{' x TP + SP' if self.tp > 1 else ''}{f' x EP {self.ep}' if self.ep > 1 else ''})")
