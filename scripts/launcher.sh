#!/usr/bin/env bash
# Launcher logic shared by run_train.sh (one node) and scripts/multinode_trainer.slurm (SLURM, many nodes).
# Source it; it defines:
#   titan_sft_prepare        cd to the repository, create/update .venv (scripts/setup_env.sh), set the run's env
#   titan_sft_nproc          processes per node: $NGPU, else GPUs of the SLURM allocation, else visible CUDA
#                            GPUs, else 1 (CPU)
#   titan_sft_torchrun RDZV_ARGS... -- CONFIG [OVERRIDES...]
#                            torchrun (titan_sft.launch) running `python -m titan_sft.train` with the flags
#                            both paths need
# Environment knobs: NGPU, LOG_RANK (ranks whose output is shown, default 0), OMP_NUM_THREADS,
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT (seconds a stopping rank may take to save its checkpoint, default 600).

titan_sft_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

titan_sft_prepare() {
  cd "$titan_sft_root" || return 1
  # setup_env.sh runs under `set -euo pipefail`; keep the caller's options (the SLURM script must not run with
  # -e while it waits for signals).
  local opts
  opts=$(set +o)
  # shellcheck disable=SC1091
  source scripts/setup_env.sh || { eval "$opts"; return 1; }
  eval "$opts"
  export TOKENIZERS_PARALLELISM=false
  # A stop signal makes every rank finish its step and save; give that save time before torchrun kills it.
  export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"
}

titan_sft_nproc() {
  local n="${NGPU:-${SLURM_GPUS_ON_NODE:-${SLURM_GPUS_PER_NODE:-}}}"
  n="${n##*:}"  # SLURM_GPUS_PER_NODE may read "h100:8"
  if [ -z "$n" ]; then
    n=$(python -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 1)")
  fi
  [ "$n" -ge 1 ] 2>/dev/null || n=1  # 0 GPUs (a CPU allocation): one process
  echo "$n"
}

titan_sft_torchrun() {
  local rdzv=()
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do rdzv+=("$1"); shift; done
  shift  # the --
  local config="$1"
  shift
  # titan_sft.launch is torchrun with a check pass (config, layout, output folder) before any rank starts, and
  # without torchrun's traceback after a rank's one-line error or a handled stop signal.
  # SIGUSR1 is forwarded to the ranks (a preemption or time-limit warning): they checkpoint at the next step
  # boundary and stop. Without it in the list torchrun would die on SIGUSR1 and leave the ranks unsaved.
  exec python -m titan_sft.launch "${rdzv[@]}" --signals-to-handle SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 \
    --local-ranks-filter="${LOG_RANK:-0}" --role rank --tee 3 \
    -m titan_sft.train --config "$config" "$@"
}
