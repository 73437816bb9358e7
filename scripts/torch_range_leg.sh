#!/usr/bin/env bash
# CI's second leg: the tests marked torch_range (every layout family against one rank, the debug job through
# ./run_train.sh, the GPU check's rehearsal, the pipeline's exchange under synchronous sends) on the oldest
# supported torch, in a virtual environment of its own. The first leg (./run_tests.sh) runs the whole suite on the
# pinned torch.
#   TITAN_SFT_OLD_TORCH       the torch version (default 2.11.0: the floor of pyproject's range)
#   TITAN_SFT_OLD_TORCH_VENV  where its environment lives (default ~/.cache/titan_sft/venv-torch<version>; outside
#                             the checkout, so that later runs reuse its ~5 GB: PyPI serves torch 2.11 for Linux
#                             only as the CUDA build, which runs on the CPU)
# Usage: scripts/torch_range_leg.sh [PYTEST ARGS]     exits with pytest's status
set -euo pipefail
cd "$(dirname "$0")/.."
export TITAN_SFT_TORCH="${TITAN_SFT_OLD_TORCH:-2.11.0}"
export TITAN_SFT_VENV="${TITAN_SFT_OLD_TORCH_VENV:-$HOME/.cache/titan_sft/venv-torch$TITAN_SFT_TORCH}"
mkdir -p "$(dirname "$TITAN_SFT_VENV")"
TITAN_SFT_EXTRAS=dev source scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
echo "[torch_range] torch $(python -c 'import torch; print(torch.__version__)') in $TITAN_SFT_VENV"
# run_train.sh and the rehearsal, started by the tests, find this environment through TITAN_SFT_VENV
export REHEARSE_BASE_PYTHON="$TITAN_SFT_VENV/bin/python"
exec python -m pytest -m torch_range "$@"
