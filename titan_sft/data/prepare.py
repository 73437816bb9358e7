"""``python -m titan_sft.data.prepare``: chat JSONL -> packed, assistant-masked dataset (the layout of docs/formats.md).

Streaming in three passes with bounded memory:
1. read lines in order, tokenize batches of them across ``--workers`` processes (results come back in input
   order, so the output is byte-identical for any worker count) and append ids and masks to flat scratch files;
2. choose packs from the document lengths alone (greedy in input order, or best-fit-decreasing);
3. write ``tokens.npy`` etc. through memory maps, copying documents from the scratch files.
Everything is written into a hidden ``*.partial`` sibling of ``--out`` and renamed only when complete.
"""

from __future__ import annotations

import argparse
import bisect
import json
import multiprocessing as mp
import os
import tempfile
import shutil
import sys
import time
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from titan_sft.data import cache
from titan_sft.data.chat import (BadRow, ChatEncoder, encoder_for, load_tokenizer, parse_line, split_conversation,
                                 tokenizer_sha256)
from titan_sft.data.sources import SourceError, iter_rows, open_sources

FORMAT_VERSION = 1
BATCH_LINES = 256  # lines per work item: fixed, so results never depend on the worker count


class PrepareError(RuntimeError):
    """Stops the job with one message; nothing is written to --out."""


def _batches(lines: Iterator, size: int) -> Iterator[list]:
    batch = []
    for item in lines:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_ENCODER: ChatEncoder | None = None
_SPLIT: tuple[int, int] | None = None  # (seq_len, max history segments) with --overlength split


def _encode_batch(batch: list[tuple[str, int, str]]) -> list[tuple]:
    """Worker: ('ok', ids, mask, file, line) or ('bad', file, line, reason) per input line, in order; with
    ``--overlength split`` an over-long conversation gives ('split', [(ids, mask, truncated), ...], file, line)."""
    out = _encode_lines(batch)
    if _SPLIT is None:
        return out
    seq_len, history = _SPLIT
    for k, res in enumerate(out):
        if res[0] == "ok" and len(res[1]) > seq_len:
            messages = parse_line(batch[k][2])
            out[k] = ("split", split_conversation(messages, _ENCODER, seq_len, history), res[3], res[4])
    return out


def _encode_lines(batch: list[tuple[str, int, str]]) -> list[tuple]:
    good, out = [], []
    for file, lineno, line in batch:
        try:
            good.append((len(out), parse_line(line)))
            out.append(None)
        except BadRow as e:
            out.append(("bad", file, lineno, str(e)))
    if good:
        try:
            encoded = _ENCODER.encode([m for _, m in good])
        except Exception:
            # A template error in one conversation should name that line: redo one by one.
            encoded = []
            for slot, messages in good:
                try:
                    encoded.extend(_ENCODER.encode([messages]))
                except Exception as e:  # noqa: BLE001 - the template's own error, reported per row
                    file, lineno, _ = batch[slot]
                    encoded.append(("bad", file, lineno, f"chat template failed: {e}"))
        for (slot, _), enc in zip(good, encoded):
            out[slot] = enc if isinstance(enc[0], str) else ("ok", enc[0], enc[1], batch[slot][0], batch[slot][1])
    return out


@dataclass
class Stats:
    conversations: int = 0
    tokens: int = 0
    bad_rows: int = 0
    truncated: int = 0
    dropped_overlength: int = 0
    dropped_no_loss: int = 0
    split: int = 0  # over-long conversations split at assistant turns (--overlength split)
    split_documents: int = 0  # the documents they became
    first_bad: list = field(default_factory=list)
    first_no_loss: list = field(default_factory=list)


class Progress:
    """One stderr line, refreshed at most once a second: conversations/s and tokens/s."""

    def __init__(self, enabled: bool):
        self.enabled, self.t0, self.last = enabled, time.monotonic(), 0.0

    def update(self, s: Stats, final: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not final and now - self.last < 1.0):
            return
        self.last = now
        dt = max(now - self.t0, 1e-9)
        end = "\n" if final else "\r"
        sys.stderr.write(
            f"prepare: {s.conversations:,} conversations ({s.conversations / dt:,.0f}/s), "
            f"{s.tokens:,} tokens ({s.tokens / dt:,.0f} tok/s), {s.bad_rows} bad rows{end}"
        )
        sys.stderr.flush()


def pack_greedy(lens: np.ndarray, seq_len: int, max_docs: int) -> list[list[int]]:
    """The recipe's packing: input order, a new pack when the next document does not fit."""
    packs: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lens.tolist()):
        if cur and (used + n > seq_len or len(cur) == max_docs):
            packs.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        packs.append(cur)
    return packs


def pack_bfd(lens: np.ndarray, seq_len: int, max_docs: int) -> list[list[int]]:
    """Best-fit-decreasing: longest first, each into the open pack with the least room that still fits it."""
    order = np.argsort(-lens, kind="stable")
    packs: list[list[int]] = []
    room: list[tuple[int, int]] = []  # sorted (remaining room, pack id) of packs that can take more documents
    for i in order.tolist():
        n = int(lens[i])
        k = bisect.bisect_left(room, (n, -1))
        if k < len(room):
            r, pid = room.pop(k)
        else:
            r, pid = seq_len, len(packs)
            packs.append([])
        packs[pid].append(i)
        if len(packs[pid]) < max_docs and r - n > 0:
            bisect.insort(room, (r - n, pid))
    return packs


def check_out(out: str) -> None:
    """Raises PrepareError (one line) when ``--out``'s parent folder cannot be created or written: the output is
    written next to it (``<out>.partial``) and renamed."""
    parent = Path(out).absolute().parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PrepareError(f"--out {out}: cannot create {parent} ({e.strerror})") from None
    try:  # a real probe: os.access says yes to root even where nothing can be created (/proc, read-only mounts)
        os.rmdir(tempfile.mkdtemp(prefix=f".{Path(out).name}.probe-", dir=parent))
    except OSError as e:
        raise PrepareError(f"--out {out}: cannot write in {parent} ({e.strerror})") from None


def prepare(
    inputs: list[str],
    tokenizer_path: str,
    seq_len: int,
    out: str,
    chat_template: str | None = None,
    packing: str = "greedy",
    overlength: str = "truncate",
    on_bad_row: str = "error",
    workers: int | None = None,
    max_docs_per_pack: int = 64,
    overwrite: bool = False,
    progress: bool = True,
    max_rows: int = 0,
    cache_dir: str | None = None,
    split_history: int = -1,
    shard_packs: int = 0,
) -> dict:
    """Runs the whole job; returns the manifest. Raises :class:`PrepareError` with one clear message.

    ``inputs`` are input specs (:mod:`titan_sft.data.sources`); ``max_rows`` keeps the first rows only (0: all);
    ``overlength = "split"`` cuts over-long conversations at assistant turns (``chat.split_conversation``, at most
    ``split_history`` earlier turns of context, -1: as many as fit); ``shard_packs`` > 0 writes the packs as
    ``shard-00000/``, ... of that many packs each (the reader concatenates them);
    with ``cache_dir`` the result is looked up in / added to that cache (:mod:`titan_sft.data.cache`).
    """
    if seq_len < 2:
        raise PrepareError(f"--seq-len must be at least 2, got {seq_len}")
    if max_docs_per_pack < 1:
        raise PrepareError(f"--max-docs-per-pack must be at least 1, got {max_docs_per_pack}")
    out_dir = Path(out)
    if out_dir.exists() and not overwrite:
        raise PrepareError(f"{out_dir} already exists; choose another --out or pass --overwrite")
    if max_rows < 0:
        raise PrepareError(f"--max-rows must be 0 (all) or positive, got {max_rows}")
    if shard_packs < 0:
        raise PrepareError(f"--shard-packs must be 0 (one directory) or positive, got {shard_packs}")
    if overlength not in ("truncate", "drop", "split"):
        raise PrepareError(f"--overlength must be truncate, drop or split, got {overlength!r}")
    sources = open_input(inputs)
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except (OSError, ValueError) as e:
        raise PrepareError(f"--tokenizer {tokenizer_path}: {e}") from None
    try:
        encoder, resolved = encoder_for(tokenizer, chat_template)
    except (OSError, ValueError) as e:
        raise PrepareError(str(e)) from None
    log = (lambda msg: print(f"prepare: {msg}", file=sys.stderr)) if progress else (lambda msg: None)
    log(f"chat template: {resolved.source}")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    workers = workers or os.cpu_count() or 1
    tok_hash = tokenizer_sha256(tokenizer)
    key = {"mode": "causal", "format_version": FORMAT_VERSION, "inputs": [s.identity for s in sources],
           "tokenizer_sha256": tok_hash, "chat_template_sha256": resolved.sha256, "seq_len": seq_len,
           "packing": packing, "overlength": overlength, "on_bad_row": on_bad_row, "max_docs_per_pack": max_docs_per_pack,
           "max_rows": max_rows, "pad_id": pad_id, "split_history": split_history, "shard_packs": shard_packs}
    target = out_dir
    if cache_dir:
        target, hit = cache.lookup(cache_dir, key)
        if hit:
            log(f"reusing cached {target} (same inputs, tokenizer, template and options)")
            cache.link_tree(target, out_dir, overwrite)
            return json.loads((out_dir / "manifest.json").read_text())

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        manifest = _prepare_into(
            tmp, sources, max_rows, encoder, seq_len, packing, overlength, on_bad_row, workers, max_docs_per_pack,
            progress, log, split_history, pad_id
        )
        manifest.update(
            tokenizer=str(tokenizer_path),
            tokenizer_sha256=tok_hash,
            chat_template_sha256=resolved.sha256,
            chat_template_source=resolved.source,
            vocab_size=len(tokenizer),
            eos_id=tokenizer.eos_token_id,
            pad_id=pad_id,
            max_rows=max_rows,
        )
        if shard_packs:
            _split_into_shards(tmp, manifest, shard_packs)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if cache_dir:
            cache.write_key(tmp, key)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if cache_dir:
        cache.link_tree(target, out_dir, overwrite)
    return manifest


def open_input(specs: list[str]):
    """The sources of the input specs; an unreadable one is a :class:`PrepareError` naming it."""
    try:
        return open_sources(specs)
    except SourceError as e:
        raise PrepareError(str(e)) from None


SHARD_ARRAYS = ("tokens.npy", "assistant_mask.npy", "doc_lens.npy", "doc_sources.npy", "pack_offsets.npy",
                "assistant_counts.npy")


def _split_into_shards(tmp: Path, manifest: dict, shard_packs: int) -> None:
    """Moves the finished arrays of ``tmp`` into ``shard-<k>/`` directories of ``shard_packs`` packs each, every one
    a packed dataset of its own (with its documents, offsets from 0 and a manifest); ``manifest`` gets their names.
    The arrays are copied from memory maps slice by slice, so no shard is built in memory whole."""
    arr = {name: np.load(tmp / name, mmap_mode="r") for name in SHARD_ARRAYS}
    P, offsets = manifest["n_packs"], np.asarray(arr["pack_offsets.npy"])
    carried = {k: manifest[k] for k in ("format_version", "max_seq_len", "tokenizer", "tokenizer_sha256",
                                        "chat_template_sha256", "vocab_size", "eos_id", "pad_id", "input_files")
               if k in manifest}
    names = []
    for k, a in enumerate(range(0, P, shard_packs)):
        b = min(a + shard_packs, P)
        d0, d1 = int(offsets[a]), int(offsets[b])
        out = tmp / f"shard-{k:05d}"
        out.mkdir()
        for name in ("tokens.npy", "assistant_mask.npy", "assistant_counts.npy"):
            np.save(out / name, arr[name][a:b])
        for name in ("doc_lens.npy", "doc_sources.npy"):
            np.save(out / name, arr[name][d0:d1])
        np.save(out / "pack_offsets.npy", offsets[a : b + 1] - d0)
        doc_lens = np.asarray(arr["doc_lens.npy"][d0:d1])
        (out / "manifest.json").write_text(json.dumps({**carried, "n_packs": b - a, "n_documents": d1 - d0,
                                                       "n_tokens": int(doc_lens.sum()), "shard": k}, indent=2) + "\n")
        names.append(out.name)
    del arr
    for name in SHARD_ARRAYS:
        os.remove(tmp / name)
    manifest["shards"] = names


def _npy_writer(path: Path, shape: tuple[int, ...], dtype):
    """An open file that takes a C-order .npy array of ``shape`` row block by row block (header written)."""
    f = open(path, "wb")
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             "fortran_order": False, "shape": shape})
    return f


def _prepare_into(tmp, sources, max_rows, encoder, seq_len, packing, overlength, on_bad_row, workers, max_docs,
                  progress, log, split_history=-1, pad_id=0):
    global _ENCODER, _SPLIT
    _ENCODER = encoder
    _SPLIT = (seq_len, split_history) if overlength == "split" else None
    stats = Stats()
    bar = Progress(progress)
    # Compact per-document records (8 bytes per number, not a Python object each: millions of documents).
    lens = array("q")
    kept = array("q")  # input index, line number of every kept document, interleaved
    file_index = {s.label: i for i, s in enumerate(sources)}
    tok_f = open(tmp / "_scratch_tokens.bin", "wb")
    mask_f = open(tmp / "_scratch_mask.bin", "wb")
    batches = _batches(iter_rows(sources, max_rows), BATCH_LINES)
    pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        results = pool.imap(_encode_batch, batches, chunksize=1) if pool else map(_encode_batch, batches)
        for batch in results:
            for res in batch:
                if res[0] == "bad":
                    _, file, lineno, reason = res
                    if on_bad_row == "error":
                        raise PrepareError(f"{file}:{lineno}: {reason} (use --on-bad-row skip to skip bad rows)")
                    stats.bad_rows += 1
                    if len(stats.first_bad) < 20:
                        stats.first_bad.append(f"{file}:{lineno}: {reason}")
                    continue
                if res[0] == "split":
                    _, docs, file, lineno = res
                    stats.conversations += 1
                    stats.split += 1
                    for ids, mask, truncated in docs:
                        if not mask[1:].any():
                            continue  # a context-only piece (its turns were trained elsewhere) or nothing left
                        stats.split_documents += 1
                        stats.truncated += truncated
                        stats.tokens += len(ids)
                        tok_f.write(ids.tobytes())
                        mask_f.write(mask.tobytes())
                        lens.append(len(ids))
                        kept.extend((file_index[file], lineno))
                    continue
                _, ids, mask, file, lineno = res
                stats.conversations += 1
                stats.tokens += len(ids)
                if len(ids) > seq_len:
                    if overlength == "drop":
                        stats.dropped_overlength += 1
                        continue
                    ids, mask = ids[:seq_len], mask[:seq_len]
                    if not mask[1:].any():
                        stats.dropped_no_loss += 1
                        if len(stats.first_no_loss) < 20:
                            stats.first_no_loss.append(f"{file}:{lineno}")
                        continue
                    stats.truncated += 1
                tok_f.write(ids.tobytes())
                mask_f.write(mask.tobytes())
                lens.append(len(ids))
                kept.extend((file_index[file], lineno))
            bar.update(stats)
    finally:
        if pool:
            pool.terminate()
        tok_f.close()
        mask_f.close()
    bar.update(stats, final=True)
    if stats.bad_rows:
        log(f"skipped {stats.bad_rows} bad rows; first: {stats.first_bad[0]}")
    if stats.dropped_no_loss:
        log(f"dropped {stats.dropped_no_loss} conversations whose assistant tokens were all truncated away by "
            f"--seq-len {seq_len}; first: {', '.join(stats.first_no_loss[:5])}")
    if not lens:
        raise PrepareError("no usable conversations in the input")

    lens_arr = np.frombuffer(lens, dtype=np.int64)
    kept = np.frombuffer(kept, dtype=np.int64).reshape(-1, 2)
    packs = (pack_bfd if packing == "bfd" else pack_greedy)(lens_arr, seq_len, max_docs)
    n_packs = len(packs)
    starts = np.concatenate([[0], np.cumsum(lens_arr)])
    doc_lens = np.empty(len(lens_arr), dtype=np.int32)
    doc_sources = np.empty((len(lens_arr), 2), dtype=np.int64)  # in pack order, like doc_lens
    offsets = np.zeros(n_packs + 1, dtype=np.int64)
    counts = np.zeros(n_packs, dtype=np.int64)
    n_assist = 0
    # Plain reads and sequential writes, a block of packs at a time: memory maps of the scratch and output files
    # would keep every page touched resident in this process (1M conversations: ~4 GiB of file-backed RSS).
    block = max(1, (16 << 20) // (5 * seq_len))  # ~16 MiB of tokens and masks per block
    d = 0
    with open(tmp / "_scratch_tokens.bin", "rb") as src_tok, open(tmp / "_scratch_mask.bin", "rb") as src_mask, \
            _npy_writer(tmp / "tokens.npy", (n_packs, seq_len), np.int32) as out_tok, \
            _npy_writer(tmp / "assistant_mask.npy", (n_packs, seq_len), np.uint8) as out_mask:
        for b0 in range(0, n_packs, block):
            rows = min(block, n_packs - b0)
            tokens = np.full((rows, seq_len), pad_id, dtype=np.int32)
            amask = np.zeros((rows, seq_len), dtype=np.uint8)
            for r in range(rows):
                p = b0 + r
                pos = 0
                for i in packs[p]:
                    n = int(lens_arr[i])
                    src_tok.seek(4 * int(starts[i]))
                    src_mask.seek(int(starts[i]))
                    tokens[r, pos : pos + n] = np.frombuffer(src_tok.read(4 * n), dtype=np.int32)
                    amask[r, pos : pos + n] = np.frombuffer(src_mask.read(n), dtype=np.uint8)
                    doc_lens[d] = n
                    doc_sources[d] = kept[i]
                    d += 1
                    pos += n
                offsets[p + 1] = d
                # Position i carries loss iff m[i+1] == 1: the pack's first token never does.
                counts[p] = int(amask[r, 1:pos].sum())
            n_assist += int(amask.sum(dtype=np.int64))
            out_tok.write(tokens.data)  # C-contiguous: written without a copy
            out_mask.write(amask.data)
    os.remove(tmp / "_scratch_tokens.bin")
    os.remove(tmp / "_scratch_mask.bin")
    np.save(tmp / "doc_lens.npy", doc_lens)
    np.save(tmp / "doc_sources.npy", doc_sources)
    np.save(tmp / "pack_offsets.npy", offsets)
    np.save(tmp / "assistant_counts.npy", counts)
    n_tokens = int(lens_arr.sum())
    padding_fraction = 1.0 - n_tokens / (n_packs * seq_len)
    return {
        "format_version": FORMAT_VERSION,
        "max_seq_len": seq_len,
        "n_packs": n_packs,
        "n_documents": int(len(lens_arr)),
        "n_tokens": n_tokens,
        "n_assistant_tokens": n_assist,
        "n_loss_targets": int(counts.sum()),
        "packing": packing,
        "max_docs_per_pack": max_docs,
        "padding_fraction": round(padding_fraction, 6),
        "packing_efficiency": round(1.0 - padding_fraction, 6),
        "overlength": {"policy": overlength, "truncated": stats.truncated,
                       "dropped": stats.dropped_overlength, "dropped_no_loss_after_truncation": stats.dropped_no_loss,
                       "first_dropped_no_loss": stats.first_no_loss, "split": stats.split,
                       "split_documents": stats.split_documents},
        "input_files": [s.label for s in sources],
        "bad_rows": {"policy": on_bad_row, "skipped": stats.bad_rows, "first": stats.first_bad},
        "tokens_dtype": "int32",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.data.prepare", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True,
                    help=".jsonl(.gz) files or directories of them; parquet/arrow/json files or directories, a saved "
                         "dataset or a hub id in the datasets cache, each optionally SPEC@SPLIT (train[:8], "
                         "train[10%%:])")
    ap.add_argument("--tokenizer", required=True, help="local HF tokenizer directory")
    ap.add_argument("--seq-len", type=int, required=True, help="packed example length (tokens)")
    ap.add_argument("--out", required=True, help="output directory (must not exist unless --overwrite)")
    ap.add_argument("--chat-template", default=None, help="Jinja chat template file with {%% generation %%} markers")
    ap.add_argument("--packing", choices=["greedy", "bfd"], default="greedy")
    ap.add_argument("--overlength", choices=["truncate", "drop", "split"], default="truncate",
                    help="a conversation longer than --seq-len: cut it, drop it, or split it at assistant turns into "
                         "documents that fit, each with the earlier turns that fit as context (no loss there)")
    ap.add_argument("--split-history", type=int, default=-1,
                    help="with --overlength split: earlier assistant turns carried as context at most (-1: all that fit)")
    ap.add_argument("--on-bad-row", choices=["error", "skip"], default="error")
    ap.add_argument("--workers", type=int, default=None, help="tokenizer processes (default: all cores)")
    ap.add_argument("--max-docs-per-pack", type=int, default=64)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--max-rows", type=int, default=0, help="use only the first N input rows (0: all)")
    ap.add_argument("--shard-packs", type=int, default=0,
                    help="write shard-00000/, ... of this many packs each, read as one dataset (0: one directory)")
    ap.add_argument("--cache-dir", default=os.environ.get("TITAN_SFT_DATA_CACHE"),
                    help="reuse / keep prepared datasets here, keyed by inputs, tokenizer, template and options "
                         "(default: $TITAN_SFT_DATA_CACHE; unset: no cache)")
    ap.add_argument("--quiet", action="store_true")
    a = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_out(a.out)
        m = prepare(a.input, a.tokenizer, a.seq_len, a.out, a.chat_template, a.packing, a.overlength,
                    a.on_bad_row, a.workers, a.max_docs_per_pack, a.overwrite, progress=not a.quiet,
                    max_rows=a.max_rows, cache_dir=a.cache_dir, split_history=a.split_history,
                    shard_packs=a.shard_packs)
    except PrepareError as e:
        print(f"prepare: error: {e}", file=sys.stderr)
        return 2
    print(f"prepare: wrote {a.out}: {m['n_packs']} packs of {m['max_seq_len']} tokens, {m['n_documents']} documents, "
          f"{m['n_assistant_tokens']} assistant tokens, padding {m['padding_fraction']:.1%}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
