"""Memory-mapped reader of the packed dataset written by ``titan_sft.data.prepare``."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from titan_sft.data.prepare import FORMAT_VERSION


class DatasetError(ValueError):
    """The dataset directory is incomplete or its files disagree with the manifest; names the file."""


@dataclass(frozen=True)
class PackHistory:
    """The earlier turns of a pack's prompts, drawn each time a batch is built (``prepare_diffusion
    --history-draw batch``): ``spans`` [k, 2] is each document's (start, length) of history tokens (length 0:
    none), kept with probability ``prob``. Removing a span shifts the rest of the pack left; the freed tail becomes
    end-of-turn padding of the document (``eos_pad``: marked with the answer, as prepare pads) or pad tokens."""

    spans: np.ndarray
    prob: float
    eos_pad: bool
    eos_id: int
    pad_id: int

    def apply(self, pack: tuple, keep: np.ndarray) -> tuple:
        """``pack`` (tokens, mask, doc_lens, answer_lens) with the history of the documents where ``keep`` [k] is
        False cut out."""
        tokens, mask, doc_lens, answer_lens = pack
        out_t, out_m, lens, start = [], [], [], 0
        for d, n in enumerate(int(x) for x in doc_lens):
            a, h = (int(x) for x in self.spans[d])
            t, m = tokens[start : start + n], mask[start : start + n]
            if h and not keep[d]:
                t, m = np.concatenate([t[:a], t[a + h:]]), np.concatenate([m[:a], m[a + h:]])
                if self.eos_pad:  # the document fills its pack: more end-of-turn padding, marked as prepare marks it
                    t = np.concatenate([t, np.full(h, self.eos_id, t.dtype)])
                    m = np.concatenate([m, np.ones(h, m.dtype)])
            out_t.append(t)
            out_m.append(m)
            lens.append(len(t))
            start += n
        L = len(tokens)
        used = sum(lens)
        out_t.append(np.full(L - used, self.pad_id, tokens.dtype))
        out_m.append(np.zeros(L - used, mask.dtype))
        return np.concatenate(out_t), np.concatenate(out_m), np.asarray(lens, doc_lens.dtype), answer_lens


def first_documents(pack: tuple, r: int) -> tuple:
    """``pack`` holding only its first ``r`` documents: the rest of the row is padding outside every document (its
    tokens stay; attention keeps them apart and nothing reads a loss there)."""
    tokens, mask, doc_lens, *rest = pack
    rest = [x[:r] if isinstance(x, np.ndarray) else replace(x, spans=x.spans[:r]) for x in rest]
    return (tokens, mask, doc_lens[:r], *rest)


class PackedDataset:
    """``len(ds)`` packs; ``ds[i]`` -> (tokens [L] int32, assistant mask [L] 0/1, doc_lens [k] int32), plus
    ``answer_lens`` [k] (each document's own answer length, EOS padding excluded) for prompt/answer datasets
    (``titan_sft.data.prepare_diffusion``), whose mask marks the answers, and a :class:`PackHistory` for those
    whose history is drawn per batch.

    Also reads what the reference SFT pipeline writes: a manifest without ``n_packs``/``format_version`` (taken
    from tokens.npy) and a signed 0/1 mask. ``doc_sources`` ([n_documents, 2]: input file index in
    ``manifest["input_files"]``, line number) is there when prepare wrote it, so errors can name the source rows.
    """

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
        for key in ("max_seq_len", "n_documents"):
            if key not in m:
                raise DatasetError(f"{mpath}: no '{key}'")
        if m.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise DatasetError(f"{mpath}: format_version {m['format_version']}, this titan_sft reads {FORMAT_VERSION}")
        self.reference_format = "format_version" not in m  # written by the reference pipeline
        self.shards = None
        if "shards" in m:
            self._open_shards(m)
            return
        if "n_packs" not in m:
            try:  # the reference format: the packs are the rows of tokens.npy
                m["n_packs"] = int(np.load(self.path / "tokens.npy", mmap_mode="r").shape[0])
            except (OSError, ValueError) as e:
                raise DatasetError(f"{mpath}: no 'n_packs', and tokens.npy is unreadable ({e})") from None
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
            "assistant_mask.npy": ((P, L), "iu"),
            "doc_lens.npy": ((D,), "i"),
            "pack_offsets.npy": ((P + 1,), "i"),
            "assistant_counts.npy": ((P,), "i"),
        }
        for name, (shape, kind) in expect.items():
            a = arrays[name]
            if a.shape != shape or a.dtype.kind not in kind:
                raise DatasetError(
                    f"{self.path / name}: shape {a.shape} dtype {a.dtype}, manifest implies shape {shape} ({kind}-kind)"
                )
        self.tokens = arrays["tokens.npy"]
        self.assistant_mask = arrays["assistant_mask.npy"]
        if self.assistant_mask.dtype.kind == "i":  # signed (reference format): must still be 0/1
            first = np.asarray(self.assistant_mask[: min(P, 64)])
            if first.size and (first.min() < 0 or first.max() > 1):
                raise DatasetError(f"{self.path / 'assistant_mask.npy'}: values outside 0/1 in a signed mask; "
                                   "rewrite it as uint8 0/1 (np.save(path, (mask > 0).astype(np.uint8)))")
        sources = self.path / "doc_sources.npy"
        self.doc_sources = np.load(sources, mmap_mode="r") if sources.is_file() else None
        self.doc_lens = np.asarray(arrays["doc_lens.npy"])
        answer_lens = self.path / "answer_lens.npy"
        self.answer_lens = np.load(answer_lens) if answer_lens.is_file() else None
        if self.answer_lens is not None and self.answer_lens.shape != (D,):
            raise DatasetError(f"{answer_lens}: shape {self.answer_lens.shape}, manifest implies ({D},)")
        self.history_spans = None
        if "history_draw" in m:
            spans = self.path / "history_spans.npy"
            if not spans.is_file() or self.answer_lens is None:
                raise DatasetError(f"{spans}: missing (the manifest says history is drawn per batch)")
            self.history_spans = np.load(spans)
            if self.history_spans.shape != (D, 2):
                raise DatasetError(f"{spans}: shape {self.history_spans.shape}, manifest implies ({D}, 2)")
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

    def _open_shards(self, m: dict) -> None:
        """A sharded dataset (prepare --shard-packs): each ``shard-<k>/`` a packed dataset, memory-mapped; the
        per-document arrays are concatenated (small), packs are read from their shard."""
        self.shards = [PackedDataset(self.path / name) for name in m["shards"]]
        for sh in self.shards:
            if sh.seq_len != m["max_seq_len"] or (sh.answer_lens is None) != (self.shards[0].answer_lens is None):
                raise DatasetError(f"{sh.path}: its rows or kind differ from {self.path}/manifest.json")
        sizes = [len(sh) for sh in self.shards]
        if sum(sizes) != m["n_packs"]:
            raise DatasetError(f"{self.path / 'manifest.json'}: n_packs {m['n_packs']}, its shards hold {sum(sizes)}")
        self.shard_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        docs = np.concatenate([[0], np.cumsum([len(sh.doc_lens) for sh in self.shards])]).astype(np.int64)
        self.seq_len = m["max_seq_len"]
        self.doc_lens = np.concatenate([sh.doc_lens for sh in self.shards])
        self.pack_offsets = np.concatenate([sh.pack_offsets[:-1] + d for sh, d in zip(self.shards, docs)] + [docs[-1:]])
        self.assistant_counts = np.concatenate([sh.assistant_counts for sh in self.shards])
        self.used = np.concatenate([sh.used for sh in self.shards])
        has = lambda attr: all(getattr(sh, attr) is not None for sh in self.shards)  # noqa: E731
        self.answer_lens = np.concatenate([sh.answer_lens for sh in self.shards]) if has("answer_lens") else None
        self.doc_sources = np.concatenate([np.asarray(sh.doc_sources) for sh in self.shards]) if has("doc_sources") \
            else None

    def __len__(self) -> int:
        return int(self.manifest["n_packs"])

    def __getitem__(self, i: int) -> tuple[np.ndarray, ...]:
        if self.shards is not None:
            k = int(np.searchsorted(self.shard_starts, i, side="right") - 1)
            return self.shards[k][int(i - self.shard_starts[k])]
        lo, hi = self.pack_offsets[i], self.pack_offsets[i + 1]
        pack = np.asarray(self.tokens[i]), np.asarray(self.assistant_mask[i]), self.doc_lens[lo:hi]
        if self.answer_lens is None:
            return pack
        if self.history_spans is None:
            return (*pack, self.answer_lens[lo:hi])
        m = self.manifest
        history = PackHistory(self.history_spans[lo:hi], float(m["history_draw"]["prob"]), bool(m.get("eos_pad")),
                              int(m["eos_id"]), int(m["pad_id"]))
        return (*pack, self.answer_lens[lo:hi], history)

    def describe_sources(self, packs) -> str:
        """Where the documents of ``packs`` came from: ``file:line`` per document when prepare recorded it."""
        parts = []
        for p in packs:
            lo, hi = int(self.pack_offsets[p]), int(self.pack_offsets[p + 1])
            if self.doc_sources is None:
                parts.append(f"pack {p}: documents {lo}..{hi - 1}")
                continue
            files = self.manifest.get("input_files", [])
            rows = [f"{files[int(f)] if int(f) < len(files) else f'input {int(f)}'}:{int(line)}"
                    for f, line in np.asarray(self.doc_sources[lo:hi])]
            parts.append(f"pack {p}: {', '.join(rows)}")
        return "; ".join(parts)


class PackSubset:
    """The packs ``ids`` of ``dataset``, indexed 0..len-1 like a dataset (the held-out split of
    ``validation.holdout_fraction``)."""

    def __init__(self, dataset: PackedDataset, ids):
        self.dataset, self.ids = dataset, np.asarray(ids, dtype=np.int64)
        self.manifest, self.path, self.seq_len = dataset.manifest, dataset.path, dataset.seq_len

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        return self.dataset[int(self.ids[i])]


def check_tokenizer(dataset: "PackedDataset", tokenizer, allow_mismatch: bool, tokenizer_dir: str) -> None:
    """The dataset's ids must come from the run's tokenizer and template: a dataset prepared with another one trains
    on ids the model reads differently (and renders prompts unlike its exported tokenizer). Raises
    :class:`DatasetError` (one line) unless ``allow_mismatch``. Datasets written before these hashes were recorded
    (and the reference format) are checked on what they record."""
    from titan_sft.data.chat import sha256, tokenizer_sha256

    if tokenizer is None or allow_mismatch:
        return
    m, where = dataset.manifest, dataset.path / "manifest.json"
    if m.get("tokenizer_sha256") and m["tokenizer_sha256"] != tokenizer_sha256(tokenizer):
        raise DatasetError(f"{where}: prepared with another tokenizer ({m.get('tokenizer', '?')}) than the run's "
                           f"({tokenizer_dir}); prepare it again with this one, or set "
                           "data.allow_tokenizer_mismatch = true to train on it anyway")
    template = getattr(tokenizer, "chat_template", None)
    if m.get("chat_template_sha256") and isinstance(template, str) and m["chat_template_sha256"] != sha256(template):
        raise DatasetError(f"{where}: prepared with another chat template ({m.get('chat_template_source', 'sha256 ')}"
                           f"{'' if m.get('chat_template_source') else m['chat_template_sha256'][:12]}) than the "
                           f"run's tokenizer holds ({tokenizer_dir}); prepare it again, or set "
                           "data.allow_tokenizer_mismatch = true to train on it anyway")

