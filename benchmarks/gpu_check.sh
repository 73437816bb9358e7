#!/usr/bin/env bash
# One call on a GPU machine (about 7 minutes on one H100/H200): the GPU tests, then the throughput matrix.
#   bash benchmarks/gpu_check.sh            results in $OUT (default benchmarks/results): gpu_tests.log,
#                                           gpu_check.json, gpu_check.md (table: tokens/s, ratios, MFU, peak memory)
# Uses the python that has a CUDA torch (the machine's, or .venv after scripts/setup_env.sh); installs titan_sft
# itself (editable, no dependencies) and tries flash-attn and the torchao GPU kernels when pip can reach an index.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && PY=.venv/bin/python
"$PY" - <<'PY' | tee "$OUT/gpu_env.txt"
import importlib.util, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
for m in ("torchao", "transformers", "flash_attn", "transformer_engine", "pytest"):
    print(m, "yes" if importlib.util.find_spec(m) else "no")
PY
"$PY" -m pip install -q --no-deps -e . 2>/dev/null || export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
timeout 120 "$PY" -m pip install -q "flash-attn>=2.7" --no-build-isolation >/dev/null 2>&1 || echo "flash-attn: not installed (no wheel or no index)"
timeout 150 "$PY" -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.log"
tail -3 "$OUT/gpu_tests.log"
timeout 330 "$PY" benchmarks/bench_gpu.py --matrix --steps 6 --out "$OUT/gpu_check.json" --table "$OUT/gpu_check.md"
