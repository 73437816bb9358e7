"""The device mesh of a run, from [parallelism] and the world size."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_sft.config import JobConfig, check_layout


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: JobConfig, world_size: int) -> "ParallelDims":
        """Validated layout (``config.check_layout``: one clear line on a bad mesh or batch split)."""
        return cls(*check_layout(cfg, world_size), world_size)

    @property
    def dp_world(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """2-D (replicate, shard) mesh; HSDP when dp_replicate > 1, plain FSDP otherwise."""
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))

    def dp_rank(self, mesh: DeviceMesh) -> int:
        """This rank's index among the data-parallel ranks (replica-major), which picks its share of a batch."""
        return mesh["dp_replicate"].get_local_rank() * self.dp_shard + mesh["dp_shard"].get_local_rank()
