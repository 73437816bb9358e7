"""The device mesh of a run, from [parallelism] and the world size."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_sft.config import ConfigError, Parallelism


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        if cfg.tp != 1:
            raise ConfigError("config key 'parallelism.tp': tensor parallelism is not available yet; allowed: 1")
        rest = world_size // (cfg.dp_replicate * cfg.tp)
        shard = rest if cfg.dp_shard == -1 else cfg.dp_shard
        if cfg.dp_replicate * shard * cfg.tp != world_size:
            raise ConfigError(
                f"config key 'parallelism': dp_replicate={cfg.dp_replicate} x dp_shard={cfg.dp_shard} x tp={cfg.tp} "
                f"does not multiply to the world size {world_size}"
            )
        return cls(cfg.dp_replicate, shard, cfg.tp, world_size)

    @property
    def dp_world(self) -> int:
        return self.dp_replicate * self.dp_shard

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """2-D (replicate, shard) mesh; HSDP when dp_replicate > 1, plain FSDP otherwise."""
        return init_device_mesh(device_type, (self.dp_replicate, self.dp_shard), mesh_dim_names=("dp_replicate", "dp_shard"))
