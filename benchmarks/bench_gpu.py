"""GPU training throughput of the real trainer: Qwen3-1.7B and 4B with random weights, packed 8k and 32k rows,
bf16 compute with fp32 master weights, chunked loss. One GPU.

    python benchmarks/bench_gpu.py --out benchmarks/results/gpu.jsonl [--flavors 1.7B,4B] [--seq-lens 8192,32768]
    python benchmarks/bench_gpu.py --matrix --out gpu_check.json --table gpu_check.md   # gpu_check.sh's cases

``--matrix`` runs the comparison of benchmarks/gpu_check.sh at 8k: bf16 vs float8 rowwise/tensorwise, compile on
and off (blocks, and the loss), activation checkpointing modes, and attention varlen vs flex vs flash_varlen.

Writes a synthetic packed dataset (random tokens, documents of random length, all positions loss-carrying),
runs ``python -m titan_sft.train`` for ``--steps`` steps per case, and prints the median tokens/s per GPU, MFU
and peak memory over the steps after the first two (warm-up).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def write_synthetic_dataset(path: Path, n_packs: int, seq_len: int, vocab: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    tokens = rng.integers(0, vocab, size=(n_packs, seq_len), dtype=np.int32)
    mask = np.ones((n_packs, seq_len), dtype=np.uint8)
    doc_lens, offsets = [], [0]
    for _ in range(n_packs):
        left = seq_len
        while left > 0:
            n = int(min(left, rng.integers(256, 4096)))
            doc_lens.append(n)
            left -= n
        offsets.append(len(doc_lens))
    np.save(path / "tokens.npy", tokens)
    np.save(path / "assistant_mask.npy", mask)
    np.save(path / "doc_lens.npy", np.asarray(doc_lens, dtype=np.int32))
    np.save(path / "pack_offsets.npy", np.asarray(offsets, dtype=np.int64))
    np.save(path / "assistant_counts.npy", np.full(n_packs, seq_len - 1, dtype=np.int64))
    (path / "manifest.json").write_text(json.dumps({
        "format_version": 1, "max_seq_len": seq_len, "n_packs": n_packs, "n_documents": len(doc_lens),
        "n_tokens": n_packs * seq_len, "n_assistant_tokens": n_packs * seq_len, "packing": "synthetic",
        "vocab_size": vocab, "tokenizer": ""}))


# (name, flavor, overrides) at 8k packed rows; the first is the reference the others are compared with.
MATRIX = [
    ("4B bf16 compile varlen AC full", "4B", ["--training.compile", "true", "--model.attention", "varlen"]),
    ("4B bf16 compile varlen AC selective", "4B", ["--training.compile", "true", "--model.attention", "varlen",
                                                   "--training.activation_checkpoint", "selective"]),
    ("4B float8 rowwise compile varlen", "4B", ["--training.compile", "true", "--model.attention", "varlen",
                                                "--training.float8", "true"]),
    ("4B float8 tensorwise compile varlen", "4B", ["--training.compile", "true", "--model.attention", "varlen",
                                                   "--training.float8", "true", "--training.float8_recipe", "tensorwise",
                                                   "--training.skip_startup_checks", "true"]),
    ("4B bf16 compile+loss varlen AC full", "4B", ["--training.compile", "true", "--model.attention", "varlen",
                                                  "--training.compile_loss", "true"]),
    ("4B bf16 eager varlen", "4B", ["--model.attention", "varlen"]),
    ("1.7B bf16 compile flex", "1.7B", ["--training.compile", "true", "--model.attention", "flex"]),
    ("1.7B bf16 compile flash_varlen", "1.7B", ["--training.compile", "true", "--model.attention", "flash_varlen"]),
]


def run_case(data: Path, dump: Path, flavor: str, steps: int, overrides: list[str]) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
           "-m", "titan_sft.train", "--config", "train_configs/qwen3_1_7b.toml",
           "--model.flavor", flavor, "--model.init_from_hf", "false", "--data.path", str(data),
           "--training.steps", str(steps), "--training.global_batch_size", "2", "--training.loss_groups", "1",
           "--checkpoint.enable", "false", "--checkpoint.hf_export_interval", "-1", "--metrics.log_freq", "1",
           "--metrics.enable_tensorboard", "false", "--validation.generation_eval_path", "",
           "--job.dump_folder", str(dump), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": (proc.stdout[-1000:] + proc.stderr[-2000:])}
    recs = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()][2:]
    return {"tokens_per_s": statistics.median(x["tokens_per_s"] for x in recs),
            "mfu": statistics.median(x["mfu"] for x in recs) if recs[0]["mfu"] is not None else None,
            "memory_gib": max(x["memory_gib"] for x in recs)}


def matrix(steps: int, out: str | None, table: str | None) -> None:
    results = []
    with tempfile.TemporaryDirectory() as d:
        data = Path(d) / "data8k"
        write_synthetic_dataset(data, 16, 8192, 151669)
        for i, (name, flavor, overrides) in enumerate(MATRIX):
            r = {"case": name, **run_case(data, Path(d) / f"run{i}", flavor, steps, overrides)}
            results.append(r)
            print(json.dumps(r), flush=True)
            if out:  # after every case: a time limit still leaves the finished ones
                Path(out).write_text(json.dumps(results, indent=2))
    ref = {r["case"].split()[0]: r for r in results if "error" not in r
           and r["case"].split()[1:3] == ["bf16", "compile"]}  # the bf16 + compile case of each size
    lines = ["| case | tokens/s/GPU | vs bf16 compile varlen | MFU % | peak GiB |", "|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'][-200:].splitlines()[-1] if r['error'] else ''} | | | |")
            continue
        base = ref.get(r["case"].split()[0])
        ratio = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mfu = f"{r['mfu']:.1f}" if r["mfu"] is not None else "n/a"
        lines.append(f"| {r['case']} | {r['tokens_per_s']:,.0f} | {ratio} | {mfu} | {r['memory_gib']:.1f} |")
    print("\n".join(lines))
    if out:
        Path(out).write_text(json.dumps(results, indent=2))
    if table:
        Path(table).write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--matrix", action="store_true", help="the gpu_check.sh comparison at 8k")
    ap.add_argument("--table", default=None, help="with --matrix: write the markdown table here")
    ap.add_argument("--flavors", default="1.7B,4B")
    ap.add_argument("--seq-lens", default="8192,32768")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--attention", default="flash_varlen", help="falls back to flex when flash-attn is missing")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.matrix:
        matrix(a.steps, a.out, a.table)
        return
    import importlib.util

    attention = a.attention
    if attention == "flash_varlen" and importlib.util.find_spec("flash_attn") is None:
        attention = "flex"
    results = []
    with tempfile.TemporaryDirectory() as d:
        for seq_len in map(int, a.seq_lens.split(",")):
            data = Path(d) / f"data{seq_len}"
            write_synthetic_dataset(data, 16, seq_len, 151669)
            for flavor in a.flavors.split(","):
                dump = Path(d) / f"run_{flavor}_{seq_len}"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                       "-m", "titan_sft.train", "--config", "train_configs/qwen3_1_7b.toml",
                       "--model.flavor", flavor, "--model.init_from_hf", "false", "--model.attention", attention,
                       "--data.path", str(data), "--training.steps", str(a.steps),
                       "--training.global_batch_size", "2", "--training.loss_groups", "1",
                       "--checkpoint.enable", "false", "--checkpoint.hf_export_interval", "-1",
                       "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump)]
                proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"{flavor} {seq_len}: FAILED\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}", flush=True)
                    results.append({"flavor": flavor, "seq_len": seq_len, "error": proc.stderr[-1000:]})
                    continue
                recs = [json.loads(x) for x in (dump / "metrics.jsonl").read_text().splitlines()][2:]
                r = {"flavor": flavor, "seq_len": seq_len, "attention": attention,
                     "tokens_per_s": statistics.median(x["tokens_per_s"] for x in recs),
                     "mfu": statistics.median(x["mfu"] for x in recs) if recs[0]["mfu"] is not None else None,
                     "memory_gib": max(x["memory_gib"] for x in recs)}
                results.append(r)
                print(f"Qwen3-{flavor} seq {seq_len}: {r['tokens_per_s']:,.0f} tokens/s/GPU, MFU "
                      f"{r['mfu'] if r['mfu'] is None else round(r['mfu'], 1)}%, peak {r['memory_gib']:.1f} GiB", flush=True)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
