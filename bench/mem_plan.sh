#!/usr/bin/env bash
# bench/mem_plan.sh - the memory planner (fsdp_plan_memory, fsdp-train
# --dry-run) against measured peaks for GPT-2 124M, global batch 4 x 256,
# AdamW, at 1, 2 and 4 ranks (bench/mem_plan.c): the library's accounted
# peak and the growth of the peak RSS over the process's RSS before the
# model, each as a ratio to the plan (target: within 10%); then 4 ranks with
# every Block checkpointed.
# Usage: bench/mem_plan.sh [MODEL B T STEPS]   (default gpt2 4 256 2)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
for n in 1 2 4; do
  mpirun -np "$n" --oversubscribe --bind-to none "$BUILD/bench/mem_plan" "${1:-gpt2}" "${2:-4}" "${3:-256}" "${4:-2}"
done
mpirun -np 4 --oversubscribe --bind-to none "$BUILD/bench/mem_plan" "${1:-gpt2}" "${2:-4}" "${3:-256}" "${4:-2}" ac
