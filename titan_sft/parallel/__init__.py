from titan_sft.parallel.distributed import DistInfo, clip_grad_norm_, init_distributed, init_sharded, shutdown
from titan_sft.parallel.parallel_dims import ParallelDims
from titan_sft.parallel.parallelize import parallelize_transformer

__all__ = ["DistInfo", "ParallelDims", "clip_grad_norm_", "init_distributed", "init_sharded", "parallelize_transformer",
           "shutdown"]
