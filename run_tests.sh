#!/usr/bin/env bash
# Installs what the tests need on a fresh machine (a local .venv), then runs the test suite.
# Usage: ./run_tests.sh [PYTEST ARGS]      exits with pytest's status
set -euo pipefail
cd "$(dirname "$0")"
TITAN_SFT_EXTRAS="${TITAN_SFT_EXTRAS:-dev}" source scripts/setup_env.sh
export TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec python -m pytest "$@"
