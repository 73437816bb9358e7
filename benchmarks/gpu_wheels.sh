#!/usr/bin/env bash
# Run on the CPU machine, where PyPI is reachable: downloads the wheels of benchmarks/gpu_wheels.txt for the target
# GPU machine (CPython 3.12, manylinux x86_64) into benchmarks/wheels/ (git-ignored; WHEELS_DIR overrides), checks
# they stay under the 64 MiB the device tool carries, and prints the `carry` list for the run.
#   bash benchmarks/gpu_wheels.sh     then: run(command="bash benchmarks/gpu_check.sh", carry=[printed list])
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${WHEELS_DIR:-benchmarks/wheels}"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="${PYTHON:-.venv/bin/python}"
mkdir -p "$DIR"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" -r benchmarks/gpu_wheels.txt 2> >(grep -v "^WARNING: Location" >&2)
kib=$(du -sk "$DIR" | cut -f1)
ls -1 "$DIR"
echo "[gpu_wheels] $DIR: $((kib / 1024)) MiB"
if [ "$kib" -gt $((60 * 1024)) ]; then
  echo "[gpu_wheels] error: over 60 MiB; the device tool carries 64 MiB in all" >&2
  exit 1
fi
echo "carry: [\"$DIR\"]"
