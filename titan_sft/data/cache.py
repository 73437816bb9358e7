"""A cache of prepared datasets: one directory per key, the key a hash of everything that decides the output.

The key covers the inputs' identity (JSONL path, size and mtime; a datasets fingerprint and split), the tokenizer
(:func:`~titan_sft.data.chat.tokenizer_sha256`), the chat template's hash, the prepare mode and every option that
changes a byte of the output, and the format version. A hit is linked (hard links, else copies) into ``--out``
without reading or tokenizing a row; a miss prepares into the cache first. Entries are written through a
``*.partial`` directory and renamed, so an interrupted prepare never leaves an entry that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

KEY_FILE = "cache_key.json"


def cache_key(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def lookup(cache_dir: str | Path, fields: dict) -> tuple[Path, bool]:
    """(the entry's directory, whether a complete entry is there)."""
    entry = Path(cache_dir) / cache_key(fields)
    return entry, (entry / "manifest.json").is_file() and (entry / KEY_FILE).is_file()


def write_key(entry_tmp: Path, fields: dict) -> None:
    (entry_tmp / KEY_FILE).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")


def link_tree(src: Path, dst: Path, overwrite: bool) -> None:
    """Makes ``dst`` a copy of the entry ``src`` (hard links where the filesystem allows), atomically."""
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    dst.parent.mkdir(parents=True, exist_ok=True)

    def link(a, b):
        try:
            os.link(a, b)
        except OSError:  # another filesystem, or links not allowed
            shutil.copy2(a, b)

    try:
        shutil.copytree(src, tmp, copy_function=link, ignore=shutil.ignore_patterns(KEY_FILE))
        if dst.exists():
            if not overwrite:
                raise FileExistsError(dst)
            shutil.rmtree(dst)
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
