"""The rank-aware logger: rank 0 prints progress lines to stdout, every rank prints warnings and errors.

Lines keep the bracketed-tag format (``[resume] ...``, ``[export] wrote ...``) so users can grep them;
``torchrun --local-ranks-filter`` (``LOG_RANK``) still decides whose output is shown.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("titan_sft")


def init_logging(rank: int) -> None:
    """Routes titan_sft's log records to stdout: INFO on rank 0, WARNING and above on the others."""
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)
