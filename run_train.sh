#!/usr/bin/env bash
# Trains with a TOML config on this node. Usage: ./run_train.sh [CONFIG.toml] [--section.key VALUE ...]
#   NGPU      processes on this node (default: visible CUDA GPUs, else 1)
#   LOG_RANK  ranks whose output is shown (default 0)
# Across SLURM nodes: sbatch [-N NODES] scripts/multinode_trainer.slurm CONFIG.toml [overrides] (README).
set -euo pipefail
CONFIG="train_configs/debug_model.toml"
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then CONFIG="$1"; shift; fi
source "$(dirname "$0")/scripts/launcher.sh"
titan_sft_prepare
NGPU=$(titan_sft_nproc)
[ "$NGPU" -gt 1 ] || export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(nproc)}"
titan_sft_torchrun --standalone --nproc_per_node="$NGPU" -- "$CONFIG" "$@"
