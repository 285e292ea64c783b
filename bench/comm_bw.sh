#!/usr/bin/env bash
# bench/comm_bw.sh - all-gather and reduce-scatter bus bandwidth (fp32) from
# 1 MiB to 256 MiB at 2 and 4 ranks on this host: the shm backend vs Open MPI
# vs a single-thread memcpy, all measured in the same run (bench/comm_bw.c).
# Targets (issue 6): shm >= 3x Open MPI and >= 50% of memcpy at 64 MiB. Then
# bench/comm_bound.c: the fastest any copy engine can do both collectives on
# this host (straight from the owners' memory in a shared window) against
# Open MPI and memcpy.
# Usage: bench/comm_bw.sh [ITERS] [MAX_BYTES]   (default 5, 268435456)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ITERS=${1:-5}
MAX=${2:-268435456}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# as tests/run.sh and fsdp-train --nproc: Open MPI's single-copy (CMA) path
# is often denied in containers, so the baseline is its copy-in/copy-out path
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
for np in 2 4; do
  mpirun -np $np --oversubscribe --bind-to none "$BUILD/bench/comm_bw" --iters "$ITERS" --max "$MAX"
  # the bound for any copy engine: straight from the owners' memory
  mpirun -np $np --oversubscribe --bind-to none "$BUILD/bench/comm_bound" "$ITERS" 16777216 "$MAX"
  echo
done
