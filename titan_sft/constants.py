"""Names shared by several layers, defined once: config dtype strings and the no-loss label."""

from __future__ import annotations

import torch

# Config strings (training.param_dtype, checkpoint.hf_export_dtype, ...) -> torch dtypes.
DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}

# A label that carries no loss (PyTorch's cross_entropy default ignore_index).
IGNORE_INDEX = -100
