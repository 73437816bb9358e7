"""Memory-mapped reader of the packed dataset written by ``titan_sft.data.prepare``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from titan_sft.data.prepare import FORMAT_VERSION


class DatasetError(ValueError):
    """The dataset directory is incomplete or its files disagree with the manifest; names the file."""


class PackedDataset:
    """``len(ds)`` packs; ``ds[i]`` -> (tokens [L] int32, assistant mask [L] uint8, doc_lens [k] int32)."""

    FILES = ("tokens.npy", "assistant_mask.npy", "doc_lens.npy", "pack_offsets.npy", "assistant_counts.npy")

    def __init__(self, path: str | Path):
        self.path = Path(path)
        mpath = self.path / "manifest.json"
        if not mpath.is_file():
            raise DatasetError(f"{mpath}: missing (is {self.path} a dataset written by titan_sft.data.prepare?)")
        try:
            self.manifest = m = json.loads(mpath.read_text())
        except json.JSONDecodeError as e:
            raise DatasetError(f"{mpath}: not valid JSON ({e})") from None
        for key in ("max_seq_len", "n_packs", "n_documents", "format_version"):
            if key not in m:
                raise DatasetError(f"{mpath}: no '{key}'")
        if m["format_version"] != FORMAT_VERSION:
            raise DatasetError(f"{mpath}: format_version {m['format_version']}, this titan_sft reads {FORMAT_VERSION}")
        arrays = {}
        for name in self.FILES:
            f = self.path / name
            if not f.is_file():
                raise DatasetError(f"{f}: missing")
            try:
                arrays[name] = np.load(f, mmap_mode="r")
            except (ValueError, OSError) as e:
                raise DatasetError(f"{f}: unreadable or truncated ({e})") from None
        P, L, D = m["n_packs"], m["max_seq_len"], m["n_documents"]
        expect = {
            "tokens.npy": ((P, L), "i"),
            "assistant_mask.npy": ((P, L), "u"),
            "doc_lens.npy": ((D,), "i"),
            "pack_offsets.npy": ((P + 1,), "i"),
            "assistant_counts.npy": ((P,), "i"),
        }
        for name, (shape, kind) in expect.items():
            a = arrays[name]
            if a.shape != shape or a.dtype.kind != kind:
                raise DatasetError(
                    f"{self.path / name}: shape {a.shape} dtype {a.dtype}, manifest implies shape {shape} ({kind}-kind)"
                )
        self.tokens = arrays["tokens.npy"]
        self.assistant_mask = arrays["assistant_mask.npy"]
        self.doc_lens = np.asarray(arrays["doc_lens.npy"])
        self.pack_offsets = np.asarray(arrays["pack_offsets.npy"])
        self.assistant_counts = np.asarray(arrays["assistant_counts.npy"]).astype(np.int64)
        off = self.pack_offsets
        if off[0] != 0 or off[-1] != D or np.any(np.diff(off) < 1):
            raise DatasetError(f"{self.path / 'pack_offsets.npy'}: must rise from 0 to n_documents={D}, >= 1 doc a pack")
        used = np.add.reduceat(self.doc_lens.astype(np.int64), off[:-1]) if D else np.zeros(P, np.int64)
        if np.any(used > L) or np.any(self.doc_lens < 1):
            raise DatasetError(f"{self.path / 'doc_lens.npy'}: documents of a pack exceed max_seq_len={L}")
        self.used = used
        self.seq_len = L

    def __len__(self) -> int:
        return int(self.manifest["n_packs"])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lo, hi = self.pack_offsets[i], self.pack_offsets[i + 1]
        return np.asarray(self.tokens[i]), np.asarray(self.assistant_mask[i]), self.doc_lens[lo:hi]
