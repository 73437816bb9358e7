#!/usr/bin/env bash
# Sourced by run_tests.sh and run_train.sh: makes sure a virtual environment with titan_sft and what it needs
# exists, installing what is missing (and saying so). Re-installs when pyproject.toml changes.
#   TITAN_SFT_VENV   where the environment lives (default: .venv in the repository)
#   TITAN_SFT_EXTRAS extras to install (default: dev for tests, none for training)
#   TITAN_SFT_TORCH_INDEX  index URL for torch on a machine without a GPU (the PyTorch CPU wheel index)
#   TITAN_SFT_TORCH  the torch version installed on a machine without a GPU (default 2.13.0, the pinned one; the
#                    oldest supported, 2.11.0, for CI's second leg: scripts/torch_range_leg.sh)
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_venv="${TITAN_SFT_VENV:-$_root/.venv}"
_extras="${TITAN_SFT_EXTRAS:-}"
_py="${PYTHON:-python3}"

if [ ! -x "$_venv/bin/python" ]; then
  echo "[setup] creating virtual environment $_venv"
  "$_py" -m venv "$_venv"
fi
# shellcheck disable=SC1091
source "$_venv/bin/activate"

_stamp="$_venv/.titan_sft_stamp"
# The project's dependencies and where it is installed from (a venv outside the checkout serves several clones).
_hash="$( (cat "$_root/pyproject.toml"; echo "$_root") | sha256sum | cut -c1-16)"
_torch="${TITAN_SFT_TORCH:-2.13.0}"
_want="$_hash extras=[$_extras]"
# An install with extras also serves a run that asks for none (run_train.sh after run_tests.sh).
_installed() {
  [ -f "$_stamp" ] || return 1
  if [ -z "$_extras" ]; then grep -q "^$_hash " "$_stamp"; else grep -qxF "$_want" "$_stamp"; fi
}
if ! _installed; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] GPU found: installing titan_sft with a CUDA build of torch"
  elif [ "$(python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)" != "$_torch" ]; then
    # No GPU: pin the CPU build so pip does not pull a multi-GB CUDA wheel.
    # The CPU build comes from the CPU wheel index where one is configured (TITAN_SFT_TORCH_INDEX); otherwise from
    # pip's own indexes (PyPI alone serves the CUDA build for Linux: torch 2.11's CUDA build runs on the CPU too).
    echo "[setup] no GPU: installing torch==$_torch${TITAN_SFT_TORCH_INDEX:+ from $TITAN_SFT_TORCH_INDEX}"
    python -m pip install -q "torch==$_torch" ${TITAN_SFT_TORCH_INDEX:+--index-url "$TITAN_SFT_TORCH_INDEX"}
  fi
  _spec="$_root"
  [ -n "$_extras" ] && _spec="$_root[$_extras]"
  echo "[setup] installing titan_sft${_extras:+[$_extras]} and its dependencies into $_venv"
  # keep the torch just installed (or found): a dependency's own torch requirement must not swap it
  _have="$(python -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)"
  python -m pip install -q -e "$_spec" ${_have:+"torch==$_have"}
  echo "$_want" > "$_stamp"
fi
