"""``python -m titan_sft.data.prepare_diffusion``: prompt/answer examples -> packed datasets for masked diffusion.

Input rows (JSON Lines, ``.jsonl.gz`` too), either
* chat: ``{"messages": [...]}``; every assistant turn becomes one example whose prompt is the turns before it
  (``--max-history-turns`` / ``--history-prob`` keep fewer of them: drawn once here, seeded per row, or with
  ``--history-draw batch`` each time a training batch is built, as the reference trainer's ``multi_turn_prob``), or
* instruction: ``{"instruction": ..., "input": optional, "output": ...}``; the user turn is the instruction,
  followed by a blank line and the input when there is one.
An example whose answer is empty is skipped and counted; any other bad row follows ``--on-bad-row``.

Each example is rendered with the chat template: the prompt ends with the assistant header, the answer is the
assistant turn up to and including its end-of-turn token. Output (``--out``): ``train/``, ``validation/`` and
``test/`` (the last two when asked for), each in the packed-dataset layout of docs/formats.md, where the
"assistant mask" marks the answer (the positions diffusion may mask; ``--no-include-answer-eos`` ends it before
its end-of-turn token) and ``answer_lens.npy`` [n_documents] gives
each example's own answer length. With ``--eos-pad`` every example fills its own pack: the answer is followed by
end-of-turn tokens up to ``--seq-len``, marked with the answer; training's ``objective.eos_padding_loss`` says
whether it is noised and supervised (so the model learns where answers stop) or stays clean outside the loss. Without it examples are packed greedily and attention keeps them apart.
Splits are whole input rows (turns of one conversation never straddle splits): separate files, or a seeded
choice of ``--validation-size`` / ``--test-size`` rows. Nothing is written unless the whole job succeeds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from titan_sft.data import cache
from titan_sft.data.chat import ROLES, Conversation, _check_tool_calls, encoder_for, load_tokenizer, tokenizer_sha256
from titan_sft.data.prepare import (BATCH_LINES, FORMAT_VERSION, PrepareError, _batches, check_out, open_input,
                                    pack_greedy)
from titan_sft.data.sources import iter_rows

SPLITS = ("train", "validation", "test")


class SkipRow(ValueError):
    """A row that yields no example by design (an empty answer): counted, never an error."""


def _text(value, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    return value


def examples_from_row(row, rng: np.random.Generator, max_history: int, history_prob: float,
                      batch_draw: bool = False) -> list[tuple]:
    """(prompt messages, answer message, prompt without its earlier turns or None) of one input row; raises
    ValueError (bad row) or SkipRow. ``batch_draw``: the earlier turns (up to ``max_history`` pairs) are always
    in the prompt and the third element is the prompt without them (None: it has none), for a draw per batch;
    otherwise they are kept here with ``history_prob`` and the third element is None."""
    if not isinstance(row, dict):
        raise ValueError("a row must be a JSON object")
    if "messages" in row:
        msgs = row["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError("'messages' must be a non-empty list")
        tools = row.get("tools")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("'tools' must be a list of function schemas (objects)")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise ValueError(f"every message needs a role among {', '.join(ROLES)}")
            if m["role"] == "assistant" and m.get("tool_calls") is not None:
                _check_tool_calls(i, m["tool_calls"])  # as prepare: a tool call is an answer, content may be empty
                if m.get("content") is None:
                    m["content"] = ""
            _text(m.get("content"), "content")
        turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
        if not turns:
            raise ValueError("no assistant turn")
        out = []
        for k in turns:
            if is_empty_answer(msgs[k]):
                continue  # counted by the caller when the row yields nothing
            system = [m for m in msgs[:k] if m["role"] == "system"]
            history = [m for m in msgs[:k] if m["role"] != "system"]
            # The current user turn is always kept; earlier turns (user/assistant pairs) with history_prob.
            last_user = max((i for i, m in enumerate(history) if m["role"] == "user"), default=None)
            if last_user is None:
                raise ValueError(f"assistant turn {k} has no user turn before it")
            earlier, current = history[:last_user], history[last_user:]
            keep = batch_draw or max_history < 0 or rng.random() < history_prob
            if not keep:
                earlier = []
            elif max_history >= 0:
                earlier = earlier[-2 * max_history:] if max_history else []
            prompt = Conversation(system + earlier + current)
            prompt.tools = tools or None  # the schemas the template renders into the system turn
            bare = None
            if batch_draw and earlier:
                bare = Conversation(system + current)
                bare.tools = prompt.tools
            out.append((prompt, msgs[k], bare))
        if not out:
            raise SkipRow("every assistant turn is empty")
        return out
    if "instruction" in row:
        instruction = _text(row.get("instruction"), "instruction")
        extra = _text(row.get("input"), "input")
        answer = _text(row.get("output"), "output")
        if not instruction.strip():
            raise ValueError("empty 'instruction'")
        if not answer.strip():
            raise SkipRow("empty 'output'")
        user = instruction + (f"\n\n{extra}" if extra.strip() else "")
        return [([{"role": "user", "content": user}], {"role": "assistant", "content": answer}, None)]
    raise ValueError("a row needs 'messages' or 'instruction' + 'output'")


def is_empty_answer(message: dict) -> bool:
    """An assistant turn with nothing to learn: no content, no reasoning and no tool call."""
    return not (str(message.get("content") or "").strip() or str(message.get("reasoning_content") or "").strip()
                or message.get("tool_calls"))


@dataclass
class SplitStats:
    rows: int = 0
    examples: int = 0
    skipped_empty_answer: int = 0
    dropped_overlength: int = 0
    truncated: int = 0
    bad_rows: int = 0
    first_bad: list = field(default_factory=list)


class ExampleEncoder:
    """Renders (prompt, answer) with the chat template: (prompt ids, answer ids ending with the end-of-turn, or
    without it when ``include_answer_eos`` is false)."""

    def __init__(self, tokenizer, chat_template: str | None, include_answer_eos: bool = True):
        self.encoder, self.resolved = encoder_for(tokenizer, chat_template)
        self.eot = tokenizer.eos_token_id
        self.include_answer_eos = include_answer_eos

    def __call__(self, prompt: list, answer: dict) -> tuple[np.ndarray, np.ndarray]:
        conversation = Conversation([*prompt, answer])
        conversation.tools = getattr(prompt, "tools", None)
        ids, mask = self.encoder.encode([conversation])[0]
        on = np.flatnonzero(mask)
        # The answer is the last assistant span (earlier ones belong to the prompt's history), cut after its
        # end-of-turn token (the template's trailing newline is not part of what the model generates).
        start = int(on[-1])
        while start > 0 and mask[start - 1]:
            start -= 1
        answer_ids = ids[start:]
        ends = np.flatnonzero(answer_ids == self.eot)
        if len(ends):
            answer_ids = answer_ids[: ends[0] + int(self.include_answer_eos)]
        return ids[:start], answer_ids


def history_span(with_history: np.ndarray, without: np.ndarray) -> tuple[int, int]:
    """(start, length) of the tokens that the earlier turns add to a prompt: ``with_history`` with that span cut
    out must be ``without`` token for token (a chat template that renders turns independently of each other);
    raises ValueError otherwise."""
    h = len(with_history) - len(without)
    n = min(len(with_history), len(without))
    start = int(np.argmax(with_history[:n] != without[:n])) if np.any(with_history[:n] != without[:n]) else n
    if h <= 0 or not np.array_equal(np.concatenate([with_history[:start], with_history[start + h:]]), without):
        raise ValueError("the chat template does not render the earlier turns as a removable span of the prompt "
                         "(needed by --history-draw batch; use --history-draw prepare)")
    return start, h


_WORK: tuple | None = None  # (encoder, max_history_turns, history_prob, split_seed), set before the pool forks


def _encode_rows(job: tuple[str, list[tuple[int, int, str]]]) -> list[tuple]:
    """Worker: per row ('ok', [(prompt ids, answer ids, (history start, length))], empty assistant turns) |
    ('skip',) | ('bad', reason). ``job``: (history mode, rows); the mode is 'prepare' (drawn here), 'batch'
    (kept with its span, drawn per training batch) or 'none' (held-out splits under --history-draw batch: the
    reference trainer draws history for training only)."""
    enc, max_history, history_prob, seed = _WORK
    mode, batch = job
    if mode == "none":
        max_history, history_prob = 0, 1.0
    out = []
    for fidx, lineno, line in batch:
        try:
            row = json.loads(line)
            # A generator per row (seed, input, line): history sampling never depends on other rows.
            triples = examples_from_row(row, np.random.default_rng([seed, fidx, lineno]), max_history, history_prob,
                                        batch_draw=mode == "batch")
            encoded = []
            for prompt, answer, bare in triples:
                p, a = enc(prompt, answer)
                span = (0, 0)
                if bare is not None:
                    b, a_bare = enc(bare, answer)
                    if not np.array_equal(a, a_bare):
                        raise ValueError("the answer renders differently without the earlier turns (needed by "
                                         "--history-draw batch; use --history-draw prepare)")
                    span = history_span(p, b)
                encoded.append((p, a, span))
        except SkipRow:
            out.append(("skip",))
            continue
        except (ValueError, json.JSONDecodeError) as e:
            out.append(("bad", f"not JSON ({e.msg})" if isinstance(e, json.JSONDecodeError) else str(e)))
            continue
        empty = sum(1 for m in row.get("messages", []) if isinstance(m, dict)
                    and m.get("role") == "assistant" and is_empty_answer(m))
        out.append(("ok", encoded, empty))
    return out


def _encode_in_order(pool, rows: list, mode: str) -> Iterator[tuple[tuple, tuple]]:
    """(row, result) for every row in input order, batches encoded by the pool's workers (or here); ``mode``: how
    history is drawn (:func:`_encode_rows`)."""
    batches = list(_batches(iter(rows), BATCH_LINES))
    jobs = [(mode, b) for b in batches]
    results = pool.imap(_encode_rows, jobs, chunksize=1) if pool else map(_encode_rows, jobs)
    for batch, res_batch in zip(batches, results):
        yield from zip(batch, res_batch)


def _write_split(out: Path, docs: list, sources: list, seq_len: int, eos_pad: bool, eot: int, pad_id: int,
                 history: dict | None = None) -> dict:
    """Writes one split in the packed layout; ``docs`` are (prompt ids, answer ids, (history start, length)).
    ``history`` ({"prob", "max_turns"}): the split's history is drawn per batch; ``history_spans.npy`` keeps
    each document's span and the manifest's ``history_draw`` the probability."""
    out.mkdir(parents=True)
    lens = np.asarray([len(p) + len(a) for p, a, _ in docs], dtype=np.int64)
    packs = [[i] for i in range(len(docs))] if eos_pad else pack_greedy(lens, seq_len, max_docs=64)
    P = len(packs)
    tokens = np.full((P, seq_len), pad_id, dtype=np.int32)
    amask = np.zeros((P, seq_len), dtype=np.uint8)
    doc_lens, answer_lens, doc_sources = [], [], []
    offsets, counts = np.zeros(P + 1, dtype=np.int64), np.zeros(P, dtype=np.int64)
    for p, members in enumerate(packs):
        pos = 0
        for i in members:
            prompt, answer, _ = docs[i]
            n = len(prompt) + len(answer)
            tokens[p, pos : pos + len(prompt)] = prompt
            tokens[p, pos + len(prompt) : pos + n] = answer
            amask[p, pos + len(prompt) : pos + n] = 1
            if eos_pad:  # marked with the answer; objective.eos_padding_loss decides whether it is supervised
                tokens[p, pos + n :] = eot
                amask[p, pos + n :] = 1
                n = seq_len
            doc_lens.append(n)
            answer_lens.append(len(answer))
            doc_sources.append(sources[i])
            pos += n
        offsets[p + 1] = len(doc_lens)
        counts[p] = int(amask[p, 1:pos].sum())
    np.save(out / "tokens.npy", tokens)
    np.save(out / "assistant_mask.npy", amask)
    np.save(out / "doc_lens.npy", np.asarray(doc_lens, dtype=np.int32))
    np.save(out / "answer_lens.npy", np.asarray(answer_lens, dtype=np.int32))
    np.save(out / "doc_sources.npy", np.asarray(doc_sources, dtype=np.int64).reshape(-1, 2))
    np.save(out / "pack_offsets.npy", offsets)
    np.save(out / "assistant_counts.npy", counts)
    if history is not None:
        order = [i for members in packs for i in members]
        np.save(out / "history_spans.npy", np.asarray([docs[i][2] for i in order], dtype=np.int32).reshape(-1, 2))
    n_tokens = int(sum(doc_lens))
    return {"format_version": FORMAT_VERSION, "kind": "prompt_answer", "max_seq_len": seq_len, "n_packs": P,
            "n_documents": len(doc_lens), "n_tokens": n_tokens, "n_assistant_tokens": int(amask.sum()),
            "n_answer_tokens": int(sum(answer_lens)), "n_loss_targets": int(counts.sum()),
            "packing": "one_per_pack" if eos_pad else "greedy", "eos_pad": eos_pad,
            **({"history_draw": history} if history is not None else {})}


def prepare_diffusion(inputs: list[str], tokenizer_path: str, seq_len: int, out: str, *, eos_pad: bool = False,
                      validation: list[str] | None = None, test: list[str] | None = None, validation_size: int = 0,
                      test_size: int = 0, split_seed: int = 0, max_history_turns: int = -1, history_prob: float = 1.0,
                      chat_template: str | None = None, overlength: str = "drop", on_bad_row: str = "error",
                      overwrite: bool = False, log=None, workers: int = 1, max_rows: int = 0,
                      cache_dir: str | None = None, include_answer_eos: bool = True,
                      history_draw: str = "prepare") -> dict:
    """Runs the whole job; returns the top-level manifest. Raises :class:`PrepareError` with one clear message.

    Inputs are input specs (:mod:`titan_sft.data.sources`). ``workers`` processes render and tokenize rows
    (output identical for any count); ``max_rows`` keeps the first training rows only (0: all); with ``cache_dir``
    the result is looked up in / added to that cache (:mod:`titan_sft.data.cache`). ``include_answer_eos`` (the
    reference trainer's setting, true by default): the answer ends with its one end-of-turn token; false stops
    before it. ``history_draw``: "prepare" draws each example's history once here; "batch" keeps up to
    ``max_history_turns`` earlier pairs with their token span and draws them (with ``history_prob``) each time a
    training batch is built, so every epoch sees other histories; held-out splits then get none.
    """
    log = log or (lambda msg: None)
    if history_draw not in ("prepare", "batch"):
        raise PrepareError(f"--history-draw must be prepare or batch, got {history_draw!r}")
    if workers < 1:
        raise PrepareError(f"--workers must be at least 1, got {workers}")
    if max_rows < 0:
        raise PrepareError(f"--max-rows must be 0 (all) or positive, got {max_rows}")
    if seq_len < 2:
        raise PrepareError(f"--seq-len must be at least 2, got {seq_len}")
    if not 0.0 <= history_prob <= 1.0:
        raise PrepareError(f"--history-prob must be in [0, 1], got {history_prob}")
    if (validation and validation_size) or (test and test_size):
        raise PrepareError("give a split either as files (--validation/--test) or as a size, not both")
    out_dir = Path(out)
    if out_dir.exists() and not overwrite:
        raise PrepareError(f"{out_dir} already exists; choose another --out or pass --overwrite")
    try:
        tokenizer = load_tokenizer(tokenizer_path)
        enc = ExampleEncoder(tokenizer, chat_template, include_answer_eos)
    except (OSError, ValueError) as e:
        raise PrepareError(f"--tokenizer {tokenizer_path}: {e}") from None
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else enc.eot
    tok_hash = tokenizer_sha256(tokenizer)

    # Rows of every split, in input order: (input index, line, text).
    sources = {s: open_input(p) for s, p in (("train", inputs), ("validation", validation), ("test", test)) if p}
    all_sources = [x for xs in sources.values() for x in xs]
    labels = [x.label for x in all_sources]
    if len(set(labels)) != len(labels):
        raise PrepareError(f"{next(x for x in labels if labels.count(x) > 1)}: given for more than one split")
    file_index = {label: i for i, label in enumerate(labels)}
    key = {"mode": "diffusion", "format_version": FORMAT_VERSION, "tokenizer_sha256": tok_hash,
           "chat_template_sha256": enc.resolved.sha256, "seq_len": seq_len, "eos_pad": eos_pad,
           **({} if include_answer_eos else {"include_answer_eos": False}),  # earlier caches keep their keys
           "inputs": {s: [x.identity for x in xs] for s, xs in sources.items()}, "validation_size": validation_size,
           "test_size": test_size, "split_seed": split_seed, "max_history_turns": max_history_turns,
           "history_prob": history_prob, "overlength": overlength, "on_bad_row": on_bad_row, "max_rows": max_rows,
           "pad_id": pad_id, **({"history_draw": history_draw} if history_draw != "prepare" else {})}
    target = out_dir
    if cache_dir:
        target, hit = cache.lookup(cache_dir, key)
        if hit:
            log(f"reusing cached {target} (same inputs, tokenizer, template and options)")
            cache.link_tree(target, out_dir, overwrite)
            return json.loads((out_dir / "manifest.json").read_text())
    rows = {s: [(file_index[f], n, line) for f, n, line in iter_rows(xs, max_rows if s == "train" else 0)]
            for s, xs in sources.items()}
    carve = {"validation": validation_size, "test": test_size}
    if validation_size or test_size:
        train = rows["train"]
        if validation_size + test_size >= len(train):
            raise PrepareError(f"--validation-size {validation_size} + --test-size {test_size} leave no training "
                               f"rows out of {len(train)}")
        order = np.random.default_rng(split_seed).permutation(len(train))
        taken = 0
        for s in ("validation", "test"):
            if carve[s]:
                rows[s] = [train[i] for i in sorted(order[taken : taken + carve[s]].tolist())]
                taken += carve[s]
        held = set(order[:taken].tolist())
        rows["train"] = [r for i, r in enumerate(train) if i not in held]

    tmp = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    manifest = {"format_version": FORMAT_VERSION, "kind": "prompt_answer_splits", "tokenizer": str(tokenizer_path),
                "tokenizer_sha256": tok_hash, "chat_template_sha256": enc.resolved.sha256,
                "vocab_size": len(tokenizer), "eos_id": enc.eot, "pad_id": pad_id, "max_seq_len": seq_len,
                "eos_pad": eos_pad, "include_answer_eos": include_answer_eos, "input_files": labels, "max_rows": max_rows,
                "history": {"max_turns": max_history_turns, "prob": history_prob, "draw": history_draw},
                "overlength": overlength,
                "split_seed": split_seed, "splits": {}}
    global _WORK
    _WORK = (enc, max_history_turns, history_prob, split_seed)
    pool = mp.get_context("fork").Pool(workers) if workers > 1 else None
    try:
        for split, split_rows in rows.items():
            stats = SplitStats()
            docs, kept = [], []
            mode = history_draw if split == "train" or history_draw == "prepare" else "none"
            for (fidx, lineno, _), res in _encode_in_order(pool, split_rows, mode):
                stats.rows += 1
                if res[0] == "skip":
                    stats.skipped_empty_answer += 1
                    continue
                if res[0] == "bad":
                    where = f"{labels[fidx]}:{lineno}"
                    if on_bad_row == "error":
                        raise PrepareError(f"{where}: {res[1]} (use --on-bad-row skip to skip bad rows)")
                    stats.bad_rows += 1
                    if len(stats.first_bad) < 20:
                        stats.first_bad.append(f"{where}: {res[1]}")
                    continue
                _, encoded, empty_turns = res
                stats.skipped_empty_answer += empty_turns
                for prompt, answer, span in encoded:
                    if len(prompt) + len(answer) > seq_len:  # with all the history it may carry
                        if overlength == "drop" or len(prompt) >= seq_len:
                            stats.dropped_overlength += 1
                            continue
                        answer = answer[: seq_len - len(prompt)]
                        stats.truncated += 1
                    docs.append((prompt, answer, span))
                    kept.append((fidx, lineno))
                    stats.examples += 1
            if not docs:
                raise PrepareError(f"split '{split}': no usable examples")
            drawn = {"prob": history_prob, "max_turns": max_history_turns} if mode == "batch" else None
            m = _write_split(tmp / split, docs, kept, seq_len, eos_pad, enc.eot, pad_id, drawn)
            m.update(tokenizer=str(tokenizer_path), tokenizer_sha256=tok_hash, chat_template_sha256=enc.resolved.sha256,
                     vocab_size=len(tokenizer), eos_id=enc.eot, pad_id=pad_id, input_files=manifest["input_files"],
                     split=split, rows=stats.rows, skipped_empty_answer=stats.skipped_empty_answer,
                     overlength={"policy": overlength, "dropped": stats.dropped_overlength,
                                 "truncated": stats.truncated},
                     bad_rows={"policy": on_bad_row, "skipped": stats.bad_rows, "first": stats.first_bad})
            (tmp / split / "manifest.json").write_text(json.dumps(m, indent=2) + "\n")
            manifest["splits"][split] = {k: m[k] for k in ("n_packs", "n_documents", "n_answer_tokens", "rows",
                                                          "skipped_empty_answer")}
            log(f"{split}: {stats.rows} rows -> {stats.examples} examples in {m['n_packs']} packs "
                f"({stats.skipped_empty_answer} empty answers skipped, {stats.dropped_overlength} over-length "
                f"dropped, {stats.truncated} truncated, {stats.bad_rows} bad rows)")
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        if cache_dir:
            cache.write_key(tmp, key)
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if pool:
            pool.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    if cache_dir:
        cache.link_tree(target, out_dir, overwrite)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_sft.data.prepare_diffusion", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", nargs="+", required=True,
                    help="training rows: .jsonl(.gz) files or directories; parquet/arrow/json files or directories, a "
                         "saved dataset or a hub id in the datasets cache, each optionally SPEC@SPLIT (train[:8])")
    ap.add_argument("--tokenizer", required=True, help="local HF tokenizer directory (with a chat template)")
    ap.add_argument("--seq-len", type=int, required=True, help="pack length (tokens)")
    ap.add_argument("--out", required=True, help="output directory: train/, validation/, test/")
    ap.add_argument("--eos-pad", action="store_true", help="pad each answer with end-of-turn tokens to --seq-len")
    ap.add_argument("--include-answer-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="the answer ends with its end-of-turn token, noised and supervised (default; the reference "
                         "trainer's include_answer_eos)")
    ap.add_argument("--validation", nargs="+", default=None, help="validation rows (input specs, as --input)")
    ap.add_argument("--test", nargs="+", default=None, help="test rows (input specs, as --input)")
    ap.add_argument("--validation-size", type=int, default=0, help="rows of --input held out for validation")
    ap.add_argument("--test-size", type=int, default=0, help="rows of --input held out for test")
    ap.add_argument("--split-seed", type=int, default=0, help="seed of the held-out choice and history sampling")
    ap.add_argument("--max-history-turns", type=int, default=-1,
                    help="earlier user/assistant pairs kept in a prompt (-1: all)")
    ap.add_argument("--history-prob", type=float, default=1.0,
                    help="with --max-history-turns: probability of keeping that history (else none)")
    ap.add_argument("--history-draw", choices=["prepare", "batch"], default="prepare",
                    help="draw the kept history once here (prepare), or each time a training batch is built "
                         "(batch: the reference trainer's multi_turn_prob; held-out splits get no history)")
    ap.add_argument("--chat-template", default=None, help="Jinja chat template file with {%% generation %%} markers")
    ap.add_argument("--overlength", choices=["drop", "truncate"], default="drop",
                    help="an example longer than --seq-len: drop it, or cut its answer")
    ap.add_argument("--on-bad-row", choices=["error", "skip"], default="error")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--workers", type=int, default=1, help="processes rendering and tokenizing rows")
    ap.add_argument("--max-rows", type=int, default=0, help="use only the first N training input rows (0: all)")
    ap.add_argument("--cache-dir", default=os.environ.get("TITAN_SFT_DATA_CACHE"),
                    help="reuse / keep prepared datasets here, keyed by inputs, tokenizer, template and options "
                         "(default: $TITAN_SFT_DATA_CACHE; unset: no cache)")
    a = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        check_out(a.out)
        prepare_diffusion(a.input, a.tokenizer, a.seq_len, a.out, eos_pad=a.eos_pad, validation=a.validation,
                          test=a.test, validation_size=a.validation_size, test_size=a.test_size,
                          split_seed=a.split_seed, max_history_turns=a.max_history_turns,
                          history_prob=a.history_prob, chat_template=a.chat_template, overlength=a.overlength,
                          on_bad_row=a.on_bad_row, overwrite=a.overwrite, workers=a.workers, max_rows=a.max_rows,
                          cache_dir=a.cache_dir, include_answer_eos=a.include_answer_eos,
                          history_draw=a.history_draw,
                          log=lambda msg: print(f"prepare_diffusion: {msg}", file=sys.stderr))
    except PrepareError as e:
        print(f"prepare_diffusion: error: {e}", file=sys.stderr)
        return 2
    print(f"prepare_diffusion: wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
