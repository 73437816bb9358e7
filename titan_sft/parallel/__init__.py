from titan_sft.parallel.parallel_dims import ParallelDims
from titan_sft.parallel.parallelize import parallelize_transformer

__all__ = ["ParallelDims", "parallelize_transformer"]
