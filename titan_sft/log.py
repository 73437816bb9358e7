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


class _DropKnownNoise(logging.Filter):
    """Drops log records that say nothing to a titan_sft user, matched exactly (everything else passes):

    * torchao's "Failed to load .../_C_*.so": optional kernel libraries built for other GPUs or torch builds;
      torchao runs without them (a float8 run that needs a missing kernel still fails loudly);
    * torch's pytree note that torchao registers Enum constants it no longer needs to (a deprecation for torchao).
    """

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.name.startswith("torchao") and msg.startswith("Failed to load ") and "/torchao/_C" in msg:
            return False
        return not (record.name == "torch.utils._pytree" and "is an Enum subclass and is now natively supported" in msg)


def quiet_known_noise() -> None:
    """Installs :class:`_DropKnownNoise` on the loggers it concerns (idempotent; before torchao is imported)."""
    for name in ("torchao", "torch.utils._pytree"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownNoise) for f in lg.filters):
            lg.addFilter(_DropKnownNoise())
