#!/usr/bin/env bash
# Trains with a TOML config. Usage: ./run_train.sh [CONFIG.toml] [--section.key VALUE ...]
#   NGPU      processes on this node (default: visible CUDA GPUs, else 1)
#   LOG_RANK  ranks whose output is shown (default 0)
set -euo pipefail
cd "$(dirname "$0")"
CONFIG="train_configs/debug_model.toml"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then CONFIG="$1"; shift; fi
source scripts/setup_env.sh
if [ -z "${NGPU:-}" ]; then
  NGPU=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)")
fi
export TOKENIZERS_PARALLELISM=false
[ "$NGPU" -gt 1 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
exec torchrun --standalone --nproc_per_node="$NGPU" --local-ranks-filter="${LOG_RANK:-0}" --role rank --tee 3 \
  -m titan_sft.train --config "$CONFIG" "$@"
