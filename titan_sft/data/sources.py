"""Where the prepare commands read rows from: JSON Lines files, or anything the ``datasets`` library loads.

An input spec is one of
* a ``.jsonl`` / ``.jsonl.gz`` file, or a directory holding only such files (read line by line, streaming);
* a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
* a ``.parquet`` / ``.arrow`` / ``.json`` file, or a directory of files of one of those kinds;
* a hub id (``org/name``): loaded by ``datasets.load_dataset``, which finds it in the local datasets cache
  (set ``HF_HUB_OFFLINE=1`` to keep it off the network).
A ``datasets`` input may end in ``@SPLIT`` with a split expression as ``datasets`` writes them (``train``,
``train[:8]``, ``train[10%:]``, ``train[:100]+validation[:10]``); the default is ``train``.

Each row becomes one JSON text, so every input kind reaches the tokenizer through the same parser and the prepared
output of a dataset equals that of the same rows as JSON Lines, byte for byte. Arrow gives every row of a table the
same fields, filling a field a row lacks with null; those nulls are dropped again (a message without
``tool_calls`` does not gain ``"tool_calls": null``).
"""

from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json"}
ROW_BATCH = 1024  # rows converted from Arrow at a time


class SourceError(ValueError):
    """An input spec that cannot be read; the message names it."""


@dataclass
class Source:
    """One input: ``label`` names it in manifests and errors; ``identity`` says what its rows are, for cache keys."""

    label: str
    identity: dict
    path: Path | None = None  # a JSON Lines file
    dataset: object = field(default=None, repr=False)  # a datasets.Dataset

    def rows(self) -> Iterator[tuple[int, str]]:
        """(1-based line or row number, JSON text) of every row, streaming; blank JSONL lines are skipped."""
        if self.path is not None:
            raw = gzip.open(self.path, "rb") if self.path.name.endswith(".gz") else open(self.path, "rb")
            with io.TextIOWrapper(raw, encoding="utf-8", errors="strict") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        yield lineno, line
            return
        n = 0
        for table in self.dataset.with_format("arrow").iter(batch_size=ROW_BATCH):
            for row in table.to_pylist():
                n += 1
                yield n, json.dumps(_drop_nulls(row), ensure_ascii=False)


def _drop_nulls(value):
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def open_sources(specs: list[str]) -> list[Source]:
    """The sources of a list of input specs, in order (a JSONL directory gives one source per file)."""
    out: list[Source] = []
    for spec in specs:
        out.extend(_open(spec))
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        dup = next(x for x in labels if labels.count(x) > 1)
        raise SourceError(f"{dup}: given more than once")
    return out


def iter_rows(sources: list[Source], max_rows: int = 0) -> Iterator[tuple[str, int, str]]:
    """(source label, row number, JSON text) of every row of every source in order; at most ``max_rows`` (0: all)."""
    n = 0
    for s in sources:
        for lineno, text in s.rows():
            if max_rows and n == max_rows:
                return
            n += 1
            yield s.label, lineno, text


def _split_spec(spec: str) -> tuple[str, str | None]:
    if Path(spec).exists() or "@" not in spec:
        return spec, None
    base, split = spec.rsplit("@", 1)
    return base, split


def _open(spec: str) -> list[Source]:
    base, split = _split_spec(spec)
    p = Path(base)
    if p.is_file() and p.name.endswith(JSONL_SUFFIXES):
        _no_split(spec, split)
        return [_jsonl(p)]
    if p.is_dir():
        if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():
            return [_from_disk(spec, p, split or "train")]
        files = sorted(x for x in p.iterdir() if x.is_file() and not x.name.startswith("."))
        jsonl = [x for x in files if x.name.endswith(JSONL_SUFFIXES)]
        others = [x for x in files if x.suffix in DATASETS_BUILDERS]
        if jsonl and not others:
            _no_split(spec, split)
            return [_jsonl(x) for x in jsonl]
        kinds = {x.suffix for x in others}
        if len(kinds) == 1:
            return [_builder(spec, DATASETS_BUILDERS[kinds.pop()], others, split or "train")]
        if kinds:
            raise SourceError(f"{p}: holds {', '.join(sorted(kinds | ({'.jsonl'} if jsonl else set())))} files; "
                              "a directory input must hold one kind")
        raise SourceError(f"{p}: holds no .jsonl, .jsonl.gz, .parquet, .arrow or .json files and no saved dataset")
    if p.is_file():
        if p.suffix not in DATASETS_BUILDERS:
            raise SourceError(f"{p}: unknown input kind (allowed: .jsonl, .jsonl.gz, .parquet, .arrow, .json, a "
                              "saved dataset directory, a hub id)")
        return [_builder(spec, DATASETS_BUILDERS[p.suffix], [p], split or "train")]
    if base.count("/") <= 1 and not base.startswith((".", "/")):
        return [_hub(spec, base, split or "train")]
    raise SourceError(f"{base}: no such file or directory")


def _no_split(spec: str, split: str | None) -> None:
    if split is not None:
        raise SourceError(f"{spec}: a split expression applies to datasets inputs, not to JSON Lines files")


def _jsonl(p: Path) -> Source:
    st = p.stat()
    return Source(str(p), {"kind": "jsonl", "path": str(p.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns},
                  path=p)


def _datasets():
    try:
        import datasets
    except ImportError:
        raise SourceError("reading parquet/arrow/json, saved datasets or hub ids needs the datasets library "
                          "(pip install datasets)") from None
    datasets.disable_progress_bars()
    return datasets


def _wrap(spec: str, ds, split: str) -> Source:
    # The fingerprint is datasets' own hash of where the rows came from (files and their mtimes, or the
    # saved state) and every transform since: what the cache key needs.
    return Source(spec, {"kind": "datasets", "spec": spec, "split": split, "fingerprint": ds._fingerprint,
                         "rows": len(ds)}, dataset=ds)


def _builder(spec: str, builder: str, files: list[Path], split: str) -> Source:
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split)
    except ValueError as e:  # a bad split expression
        raise SourceError(f"{spec}: {e}") from None
    return _wrap(spec, ds, split)


def _hub(spec: str, repo: str, split: str) -> Source:
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(repo, split=split)
    except (ConnectionError, FileNotFoundError) as e:
        hint = "" if os.environ.get("HF_HUB_OFFLINE") else " (set HF_HUB_OFFLINE=1 to read only the local cache)"
        raise SourceError(f"{repo}: not a local path, and not loadable as a hub dataset{hint}: {e}") from None
    except ValueError as e:
        raise SourceError(f"{spec}: {e}") from None
    return _wrap(spec, ds, split)


def _from_disk(spec: str, p: Path, split: str) -> Source:
    datasets = _datasets()
    saved = datasets.load_from_disk(str(p))
    if isinstance(saved, datasets.DatasetDict):
        splits = {k: len(v) for k, v in saved.items()}
    else:
        splits = {"train": len(saved)}  # a saved Dataset is one split; its expressions call it train
    try:
        instructions = datasets.ReadInstruction.from_spec(split).to_absolute(splits)
    except (ValueError, KeyError) as e:
        raise SourceError(f"{spec}: split expression {split!r}: {e} (splits here: {', '.join(splits)})") from None
    parts = []
    for ins in instructions:
        ds = saved[ins.splitname] if isinstance(saved, datasets.DatasetDict) else saved
        parts.append(ds.select(range(ins.from_, ins.to)))
    ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return _wrap(spec, ds, split)
