#!/bin/bash
# Submit one hydra-submitit-launcher sweep per GPU count (the plugin sets Slurm resources once per launch, so a
# grid over world sizes is split here): every point becomes one Slurm job asking for exactly its GPUs.
#   slurm/sweep_by_gpus.sh paper_fig8_adp 2 4 8 [extra overrides...]
# Partition/account/QoS come from conf/local/default.yaml (see conf/local/README.md).
set -euo pipefail
experiment="${1:?usage: sweep_by_gpus.sh EXPERIMENT GPU_COUNT... [-- overrides...]}"
shift
counts=()
while [[ $# -gt 0 && "$1" != "--" ]]; do counts+=("$1"); shift; done
[[ "${1:-}" == "--" ]] && shift
cd "$(dirname "$0")/.."
for gpus in "${counts[@]}"; do
    echo "== ${experiment}: world size ${gpus}"
    python -m harness -m "experiment=${experiment}" "parallel.world_size=${gpus}" launcher=slurm "$@"
done
