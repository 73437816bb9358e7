"""GPU training throughput of the real trainer, case by case, several cases in one process (imports, CUDA context
and compile caches shared): Qwen3-4B / 1.7B with random weights on packed 8k rows, bf16 compute with fp32 master
weights, chunked loss, one GPU. benchmarks/gpu_check.sh calls it once per phase.

    python benchmarks/bench_gpu.py --cases 4b_bf16_compile_varlen,4b_bf16_compile_varlen_sac \\
        --jsonl OUT/gpu_check.jsonl --table OUT/gpu_check.md [--steps 6] [--rehearse]
    python benchmarks/bench_gpu.py --list

Every case trains ``--steps`` steps on a synthetic packed dataset (random tokens, documents of 256-4096 tokens,
every position loss-carrying) and appends one JSON line: median tokens/s per GPU, both MFUs (``mfu``: the FLOPs the
step did, titan_sft.metrics.FlopCounter; ``mfu_torchtitan``: torchtitan's 6N + 12LHDS convention), TFLOP/s and peak
memory over the steps after the first two (warm-up, compile). The markdown table is rewritten from all lines after
every case, with each case's tokens/s as a ratio to the baseline case it names. A failing case (OOM, missing
kernel) is a line with its error, and the next case runs.

``--rehearse`` runs the same cases with tiny shapes on the CPU (debug flavor, 256-token rows, sdpa, no compile):
every path and output file of the GPU check, proven without a GPU. The memory decision is still taken for the
real shapes against ``--free-gib`` (default: an H100's 79 GiB) and printed as what the GPU would do.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 151669  # Qwen3's tokenizer
DEBUG_VOCAB = 512  # the debug flavor's embedding rows

_C = ["--training.compile", "true"]
_VARLEN = ["--model.attention", "varlen"]
_SAC = ["--training.activation_checkpoint", "selective"]
_F8 = ["--training.float8", "true"]
_MOE = ["--model.name", "qwen3_moe"]
# name: (flavor, overrides, baseline case for the ratio column, what it shows). AC is off unless named.
CASES: dict[str, tuple[str, list[str], str | None, str]] = {
    "4b_bf16_compile_varlen": ("4B", _C + _VARLEN, None, "the MFU goal's case on a 141 GB H200"),
    "4b_bf16_compile_varlen_sac": ("4B", _C + _VARLEN + _SAC, "4b_bf16_compile_varlen", "selective AC's cost"),
    "4b_f8_rowwise_compile_varlen": ("4B", _C + _VARLEN + _F8, "4b_bf16_compile_varlen",
                                     "float8 goal on an H200: >= 1.25x"),
    "4b_f8_tensorwise_compile_varlen": ("4B", _C + _VARLEN + _F8 + [
        "--training.float8_recipe", "tensorwise", "--training.skip_startup_checks", "true"],
        "4b_bf16_compile_varlen", "float8 on an H200: >= 1.25x"),
    "1.7b_bf16_compile_varlen": ("1.7B", _C + _VARLEN, None, "the MFU goal's case on an 80 GB H100"),
    "1.7b_f8_rowwise_compile_varlen": ("1.7B", _C + _VARLEN + _F8, "1.7b_bf16_compile_varlen",
                                       "float8 goal on an 80 GB H100: >= 1.25x"),
    "4b_bf16_eager_varlen": ("4B", _VARLEN, "4b_bf16_compile_varlen", "what compile buys"),
    "4b_bf16_compile_loss_varlen": ("4B", _C + _VARLEN + ["--training.compile_loss", "true"],
                                    "4b_bf16_compile_varlen", "compiled loss math"),
    "4b_bf16_compile_varlen_full_ac": ("4B", _C + _VARLEN + ["--training.activation_checkpoint", "full"],
                                       "4b_bf16_compile_varlen", "the recipe configs' AC; 4B on an 80 GB H100"),
    "1.7b_bf16_compile_flex": ("1.7B", _C + ["--model.attention", "flex"], "1.7b_bf16_compile_varlen",
                               "flex in the trainer"),
    "1.7b_bf16_compile_flash_varlen": ("1.7B", _C + ["--model.attention", "flash_varlen"],
                                       "1.7b_bf16_compile_varlen", "flash-attn (where installed)"),
    # One GPU cannot run cp > 1: the 32k single-GPU baselines that context parallel divides (run with --seq-len 32768;
    # the multi-GPU command is in docs/performance.md).
    "4b_32k_bf16_compile_varlen_full_ac": ("4B", _C + _VARLEN + ["--training.activation_checkpoint", "full"], None,
                                           "32k rows on one GPU, full AC: the cp baseline"),
    "4b_32k_bf16_compile_flex_full_ac": ("4B", _C + ["--model.attention", "flex", "--training.activation_checkpoint",
                                                     "full"], "4b_32k_bf16_compile_varlen_full_ac",
                                         "32k rows, flex (ring cp's kernel)"),
    "moe_30b_a3b_4l_bf16_varlen": ("30B-A3B-4L", _MOE + _VARLEN, None,
                                   "4 Qwen3-30B-A3B layers, grouped GEMM; MFU on active parameters"),
    "moe_30b_a3b_4l_f8_rowwise_varlen": ("30B-A3B-4L", _MOE + _VARLEN + _F8, "moe_30b_a3b_4l_bf16_varlen",
                                         "float8 attention and experts (float8 grouped GEMM, groups padded to 16 rows)"),
    "moe_30b_a3b_4l_bf16_compile_varlen": ("30B-A3B-4L", _MOE + _C + _VARLEN, "moe_30b_a3b_4l_bf16_varlen",
                                           "compiled MoE blocks (fullgraph, unbacked expert row counts)"),
}


def _register_bench_flavors() -> None:
    """30B-A3B-4L: four layers of Qwen3-30B-A3B (its attention, 128 experts of 768, top 8), so that the layer
    shapes the real model trains fit one GPU with FSDP's fp32 state."""
    import dataclasses

    from titan_sft.models.qwen3_moe import QWEN3_MOE_FLAVORS

    QWEN3_MOE_FLAVORS.setdefault("30B-A3B-4L", dataclasses.replace(QWEN3_MOE_FLAVORS["30B-A3B"], n_layers=4))


def packed_doc_lengths(n_packs: int, seq_len: int, rng: np.random.Generator) -> list[list[int]]:
    """Per pack, documents of 256-4096 tokens (scaled down for short rows) filling the row exactly."""
    lo, hi = min(256, seq_len // 4), min(4096, seq_len)
    packs = []
    for _ in range(n_packs):
        lens, left = [], seq_len
        while left > 0:
            lens.append(int(min(left, rng.integers(lo, hi))))
            left -= lens[-1]
        packs.append(lens)
    return packs


def write_synthetic_dataset(path: Path, n_packs: int, seq_len: int, vocab: int, seed: int = 0) -> None:
    """A packed dataset in titan_sft's layout: random tokens, documents of random length, all loss-carrying."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    tokens = rng.integers(0, vocab, size=(n_packs, seq_len), dtype=np.int32)
    doc_lens, offsets = [], [0]
    for lens in packed_doc_lengths(n_packs, seq_len, rng):
        doc_lens += lens
        offsets.append(len(doc_lens))
    np.save(path / "tokens.npy", tokens)
    np.save(path / "assistant_mask.npy", np.ones((n_packs, seq_len), dtype=np.uint8))
    np.save(path / "doc_lens.npy", np.asarray(doc_lens, dtype=np.int32))
    np.save(path / "pack_offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(path / "assistant_counts.npy", np.full(n_packs, seq_len - 1, dtype=np.int64))
    (path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "max_seq_len": seq_len, "n_packs": n_packs, "n_documents": len(doc_lens),
        "n_tokens": n_packs * seq_len, "n_assistant_tokens": n_packs * seq_len, "packing": "synthetic",
        "vocab_size": vocab, "tokenizer": ""}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def case_argv(name: str, data: Path, dump: Path, steps: int, rehearse: bool) -> list[str]:
    flavor, overrides, _, _ = CASES[name]
    if rehearse:  # tiny shapes on the CPU: no compile, sdpa for the GPU-only kernels
        flavor = "debug_moe" if "qwen3_moe" in overrides else "debug"
        swap = {"varlen": "sdpa", "flash_varlen": "sdpa", "flex": "sdpa"}
        out, i = [], 0
        while i < len(overrides):
            key, value = overrides[i], overrides[i + 1]
            if key == "--training.compile" or key == "--training.compile_loss":
                value = "false"
            if key == "--model.attention":
                value = swap.get(value, value)
            out += [key, value]
            i += 2
        overrides = out
    return ["--model.flavor", flavor, "--model.init_from_hf", "false", "--model.hf_assets_path", "",
            "--model.tokenizer_path", "", "--data.path", str(data), "--training.steps", str(steps),
            "--training.global_batch_size", "2", "--training.loss_groups", "1",
            "--training.param_dtype", "float32" if rehearse else "bfloat16",
            "--training.activation_checkpoint", "none", "--checkpoint.enable", "false",
            "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1", "--metrics.enable_tensorboard",
            "false", "--job.dump_folder", str(dump), *overrides]


H100_GIB = 79.0  # what an 80 GB H100 lends to tensors (an H200: ~139 GiB)


def goal_cases(total_gib: float) -> dict[str, list[str]]:
    """The cases the GPU goals are measured on, by the GPU's memory: Qwen3-4B without AC needs ~108 GiB by the
    plan (59.9 GiB of weights, gradients and AdamW state), so it is the MFU goal only where it fits (an H200);
    on an 80 GB H100 the goal is Qwen3-1.7B (~52 GiB). float8 is measured against the same model's bf16 case."""
    if total_gib >= 120:
        return {"mfu": ["4b_bf16_compile_varlen"],
                "float8": ["4b_f8_rowwise_compile_varlen", "4b_f8_tensorwise_compile_varlen"]}
    return {"mfu": ["1.7b_bf16_compile_varlen"], "float8": ["1.7b_f8_rowwise_compile_varlen"]}


def memory_decision(name: str, seq_len: int, free_gib: float) -> tuple[bool, float, str]:
    """Whether case ``name`` (its real shapes, ``seq_len``-token rows) fits in ``free_gib`` by the dry run's
    per-rank plan: (fits, planned GiB, the one line that says so)."""
    from titan_sft.config import load_config
    from titan_sft.dry_run import peak_memory_estimate

    _register_bench_flavors()
    with tempfile.TemporaryDirectory() as d:
        cfg = load_config("train_configs/qwen3_1_7b.toml", case_argv(name, Path(d), Path(d), 1, False))
    est = peak_memory_estimate(cfg, seq_len)
    gib = est["total"] / 2**30
    fits = gib <= free_gib
    why = (f"{name}: planned {gib:.1f} GiB per GPU (weights, gradients and AdamW state {est['state'] / 2**30:.1f}, "
           f"activations {est['activations'] / 2**30:.1f}) {'fits' if fits else 'exceeds'} {free_gib:.1f} GiB free")
    return fits, gib, why


def run_case(name: str, data: Path, dump: Path, steps: int, rehearse: bool) -> dict:
    """One case in this process; returns its JSON record (an ``error`` field where it failed)."""
    import torch
    import torch.distributed as dist

    from titan_sft.config import load_config
    from titan_sft.train import Trainer

    os.environ["MASTER_PORT"] = str(_free_port())  # a fresh process group per case
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    trainer = None
    try:
        _register_bench_flavors()
        cfg = load_config("train_configs/qwen3_1_7b.toml", case_argv(name, data, dump, steps, rehearse))
        trainer = Trainer(cfg)
        trainer.train()
        attention = cfg.model.attention
    except Exception as e:  # a case's failure is its record; the next case still runs
        return {"case": name, "baseline": CASES[name][2], "note": CASES[name][3],
                "error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:],
                "wall_s": time.monotonic() - t0}
    finally:
        if trainer is not None:
            trainer.close()
        elif dist.is_initialized():
            dist.destroy_process_group()
        del trainer
        gc.collect()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    recs = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()]
    recs = [r for r in recs if r.get("split") == "train"][2:]  # warm-up and compile steps left out

    def median(key):
        values = [r[key] for r in recs if r.get(key) is not None]
        return statistics.median(values) if values else None

    mem = [r["memory_gib"] for r in recs if r.get("memory_gib") is not None]
    reserved = [r["memory_reserved_gib"] for r in recs if r.get("memory_reserved_gib") is not None]
    return {"case": name, "baseline": CASES[name][2], "note": CASES[name][3],
            "flavor": CASES[name][0] if not rehearse else cfg.model.flavor, "attention": attention,
            "steps_measured": len(recs), "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
            "mfu_torchtitan": median("mfu_torchtitan"), "tflops": median("tflops"),
            "memory_gib": max(mem) if mem else None, "memory_reserved_gib": max(reserved) if reserved else None,
            "loss_last": recs[-1]["loss"] if recs else None,
            "wall_s": time.monotonic() - t0, "rehearsal": rehearse}


def _fmt(v, spec):
    return "n/a" if v is None else format(v, spec)


def kernel_record(seconds: float, tokens: int, flops: float, peak: float | None, cuda: bool) -> dict:
    """The measured fields of a kernel-only case (attention, the delta rule): time, throughput, TFLOP/s, MFU
    against ``peak`` and, on a GPU, the peak memory since the last reset."""
    import torch

    return dict(ms=seconds * 1e3, tokens_per_s=tokens / seconds, tflops=flops / seconds / 1e12,
                mfu=100 * flops / seconds / peak if peak else None, mfu_torchtitan=None,
                memory_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
                memory_reserved_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None)


def append_record(jsonl: Path, table: Path, record: dict) -> None:
    """One case's record appended to ``jsonl``, the table rewritten, the record printed."""
    with jsonl.open("a") as f:
        f.write(json.dumps(record) + "\n")
    write_table(jsonl, table)
    print(json.dumps(record), flush=True)


def write_table(jsonl: Path, table: Path) -> None:
    """The markdown table of every case in ``jsonl`` (the latest record of each), ratios to named baselines."""
    results: dict[str, dict] = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        r = json.loads(line)
        results[r["case"]] = r
    lines = ["| case | tokens/s/GPU | vs baseline | MFU % (done) | MFU % (torchtitan) | TFLOP/s | peak GiB "
             "allocated / reserved | note |", "|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        note = r.get("note", "")
        if "error" in r:
            lines.append(f"| {name} | failed: {r['error'].splitlines()[0][:160]} | | | | | | {note} |")
            continue
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | | | {note} |")
            continue
        base_name = r.get("baseline")
        base = results.get(base_name) if base_name else None
        ratio = (f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x {base_name}"
                 if base and "error" not in base and base.get("tokens_per_s") and r.get("tokens_per_s") else "")
        lines.append(f"| {name} | {_fmt(r['tokens_per_s'], ',.0f')} | {ratio} | {_fmt(r['mfu'], '.1f')} | "
                     f"{_fmt(r.get('mfu_torchtitan'), '.1f')} | {_fmt(r['tflops'], '.3g')} | "
                     f"{_fmt(r['memory_gib'], '.1f')} / {_fmt(r.get('memory_reserved_gib'), '.1f')} | {note} |")
    tmp = table.with_suffix(table.suffix + ".partial")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(table)


def measured(r: dict | None) -> bool:
    """Whether a case's record holds numbers (it ran: neither failed nor skipped)."""
    return bool(r) and "error" not in r and "skipped" not in r and bool(r.get("tokens_per_s"))


def summary(jsonl: Path, table: Path, total_gib: float) -> int:
    """The table, then one line per GPU goal of docs/performance.md for a GPU of ``total_gib``, and a count of
    the cases; 0 when every goal case produced numbers, 1 otherwise."""
    write_table(jsonl, table)
    print(table.read_text())
    results = {}
    for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
        r = json.loads(line)
        results[r["case"]] = r
    goals = goal_cases(total_gib)
    missing = []
    for case in goals["mfu"]:
        r = results.get(case)
        if measured(r) and r.get("mfu") is None:  # the rehearsal: no peak FLOP/s for a CPU
            print(f"goal: {case} MFU (FLOPs done) >= 45% on a {total_gib:.0f} GiB GPU: "
                  f"{r['tokens_per_s']:,.0f} tokens/s, MFU n/a (no peak FLOP/s for this device)")
        elif measured(r):
            print(f"goal: {case} MFU (FLOPs done) >= 45% on a {total_gib:.0f} GiB GPU: {r['mfu']:.1f}% "
                  f"{'met' if r['mfu'] >= 45 else 'NOT met'}")
        else:
            missing.append(case)
            print(f"goal: {case} MFU (FLOPs done) >= 45% on a {total_gib:.0f} GiB GPU: not measured "
                  f"({_why_not(r)})")
    for case in goals["float8"]:
        r, base = results.get(case), results.get(CASES[case][2])
        if measured(r) and measured(base):
            x = r["tokens_per_s"] / base["tokens_per_s"]
            print(f"goal: {case} >= 1.25x {CASES[case][2]} tokens/s: {x:.2f}x {'met' if x >= 1.25 else 'NOT met'}")
        else:
            missing.append(case)
            print(f"goal: {case} >= 1.25x {CASES[case][2]} tokens/s: not measured ({_why_not(r)}; baseline "
                  f"{_why_not(base)})")
    n = {k: sum(1 for r in results.values() if k(r)) for k in (measured, _failed, _skipped)}
    print(f"cases: {n[measured]} measured, {n[_failed]} failed, {n[_skipped]} skipped for memory; goal cases "
          f"{'all measured' if not missing else 'not measured: ' + ', '.join(missing)}")
    return 1 if missing else 0


def _failed(r: dict) -> bool:
    return "error" in r


def _skipped(r: dict) -> bool:
    return "skipped" in r


def _why_not(r: dict | None) -> str:
    if not r:
        return "did not run"
    if "error" in r:
        return "failed: " + r["error"].splitlines()[0][:120]
    if "skipped" in r:
        return "skipped: " + r["skipped"]
    return "measured"


def gpu_memory_gib(stated: float | None) -> tuple[float, float]:
    """(free, total) GiB of GPU 0, or ``stated`` for both where given (the rehearsal, tests)."""
    import torch

    if stated is not None or not torch.cuda.is_available():
        return (stated or H100_GIB,) * 2
    free, total = torch.cuda.mem_get_info()
    return free / 2**30, total / 2**30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="", help="comma-separated case names (--list shows them)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--summary", action="store_true", help="print the table and the goals from --jsonl, and exit")
    ap.add_argument("--steps", type=int, default=6, help="steps per case; the first two are not measured")
    ap.add_argument("--seq-len", type=int, default=8192, help="packed row length (rehearsal: 256)")
    ap.add_argument("--gpu-gib", type=float, default=None,
                    help="the GPU's free and total memory in GiB, instead of reading them (rehearsal default: 79)")
    ap.add_argument("--jsonl", required=False, default="benchmarks/results/gpu_check.jsonl")
    ap.add_argument("--table", required=False, default="benchmarks/results/gpu_check.md")
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU (see the module docstring)")
    a = ap.parse_args()
    if a.list:
        for name, (flavor, overrides, base, note) in CASES.items():
            print(f"{name:36s} {flavor:5s} vs {base or '-':28s} {note}")
        return 0
    os.chdir(ROOT)
    if a.summary:
        return summary(Path(a.jsonl), Path(a.table), gpu_memory_gib(a.gpu_gib)[1])
    names = [n for n in a.cases.split(",") if n]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"error: unknown case(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    jsonl, table = Path(a.jsonl), Path(a.table)
    jsonl.parent.mkdir(parents=True, exist_ok=True)
    seq_len = 256 if a.rehearse else a.seq_len
    failed = 0
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data"
        write_synthetic_dataset(data, 16, seq_len, DEBUG_VOCAB if a.rehearse else VOCAB)
        for i, name in enumerate(names):
            free, _ = gpu_memory_gib(a.gpu_gib)
            fits, planned, why = memory_decision(name, a.seq_len, free)
            if not fits and not a.rehearse:
                print(f"[bench_gpu] case {name}: skipped: {why}", flush=True)
                r = {"case": name, "baseline": CASES[name][2], "note": CASES[name][3], "skipped": why,
                     "planned_gib": planned, "free_gib": free}
            else:
                if a.rehearse:  # tiny shapes run regardless; the GPU's decision is shown
                    print(f"[bench_gpu] on a {free:.0f} GiB GPU this case would be {'run' if fits else 'skipped'}: "
                          f"{why}", flush=True)
                print(f"[bench_gpu] case {name} ...", flush=True)
                r = run_case(name, data, Path(d) / f"run{i}", a.steps, a.rehearse)
                r.update(planned_gib=planned, free_gib=free)
                failed += "error" in r
            with jsonl.open("a") as f:
                f.write(json.dumps(r) + "\n")
            write_table(jsonl, table)
            print(json.dumps({k: v for k, v in r.items() if k != "trace"}), flush=True)
            if "trace" in r:
                print(r["trace"], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
