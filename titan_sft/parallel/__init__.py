from titan_sft.parallel.distributed import DistInfo, clip_grad_norm_, init_distributed, shutdown
from titan_sft.parallel.parallel_dims import ParallelDims
from titan_sft.parallel.parallelize import parallelize_transformer

__all__ = ["DistInfo", "ParallelDims", "clip_grad_norm_", "init_distributed", "parallelize_transformer",
           "shutdown"]
