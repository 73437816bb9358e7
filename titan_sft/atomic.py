"""Atomic output directories: write ``<name>.partial``, rename to ``<name>`` when complete (all ranks agree).

A crash mid-write leaves only a ``*.partial`` (never resumed from or exported) and the previous complete
directory untouched. Works in one process and under torch.distributed (rank 0 creates and renames; the others
wait at barriers).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def partial_dir(final: Path) -> Path:
    """The ``*.partial`` sibling of ``final``, freshly created (an old one is removed)."""
    tmp = final.with_name(final.name + ".partial")
    if rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    return tmp


def finalize(tmp: Path, final: Path) -> None:
    """Rank 0 renames the finished ``tmp`` to ``final`` (replacing an older one); all ranks wait."""
    barrier()
    if rank() == 0:
        if final.exists():
            old = final.with_name(final.name + ".old")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old)
        else:
            tmp.rename(final)
    barrier()


def atomic_write_text(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a ``*.partial`` sibling and a rename: readers never see half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(text)
    tmp.replace(path)
