"""prepare_diffusion with 1 worker vs N: rows/s and peak RSS on the real Qwen3 tokenizer, side by side.

    python benchmarks/bench_prepare_diffusion.py --rows 20000 --workers 2

Each run is a fresh process on the same generated chat rows (every assistant turn an example, EOS-padded to
--seq-len); both outputs are compared byte for byte, since the worker count must not change them.
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prepare import QWEN_DIR, make_jsonl  # noqa: E402


def run(path: Path, out: Path, workers: int, seq_len: int) -> dict:
    code = (
        "import json, resource, time\n"
        "from titan_sft.data.prepare_diffusion import prepare_diffusion\n"
        "t = time.perf_counter()\n"
        f"m = prepare_diffusion([{str(path)!r}], {str(QWEN_DIR)!r}, {seq_len}, {str(out)!r}, eos_pad=True, "
        f"overlength='truncate', workers={workers})\n"
        "dt = time.perf_counter() - t\n"
        "rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
        "print(json.dumps({'rows_s': m['splits']['train']['rows'] / dt, 'seconds': dt, 'rss_mib': rss / 1024}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        make_jsonl(d / "rows.jsonl", a.rows)
        one = run(d / "rows.jsonl", d / "w1", 1, a.seq_len)
        many = run(d / "rows.jsonl", d / "wn", a.workers, a.seq_len)
        same = all((d / "w1" / "train" / f.name).read_bytes() == f.read_bytes()
                   for f in (d / "wn" / "train").glob("*.npy"))
    print(f"prepare_diffusion, {a.rows:,} rows, 1 worker: {one['rows_s']:,.0f} rows/s ({one['seconds']:.1f} s), "
          f"peak RSS {one['rss_mib']:,.0f} MiB")
    print(f"prepare_diffusion, {a.rows:,} rows, {a.workers} workers: {many['rows_s']:,.0f} rows/s "
          f"({many['seconds']:.1f} s), peak RSS {many['rss_mib']:,.0f} MiB (process + workers)")
    print(f"speed ratio {a.workers} workers / 1: {many['rows_s'] / one['rows_s']:.2f}x; outputs identical: {same}")


if __name__ == "__main__":
    main()
