#!/usr/bin/env bash
# bench/mpi_reduce.sh - ordered vs native MPI reductions (bench/mpi_reduce.c):
# 2 and 4 ranks on this host (--comm mpi, Open MPI's shared-memory transport),
# then 2 hosts x 1 rank and 2 hosts x 2 ranks across simulated hosts
# (scripts/simhosts.sh: TCP over veths; skipped where namespaces cannot be made).
# Usage: bench/mpi_reduce.sh [ITERS] [MAX_BYTES]   (default 5, 67108864)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ITERS=${1:-5}
MAX=${2:-67108864}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=${OMPI_MCA_btl_vader_single_copy_mechanism:-none}
B="$BUILD/bench/mpi_reduce --iters $ITERS --max $MAX"
echo "$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) CPUs; $(date -u '+%Y-%m-%d %H:%M UTC')"
for np in 2 4; do
  echo "== one host, $np ranks"
  mpirun -np $np --oversubscribe --bind-to none $B
done
if ! why=$(scripts/simhosts.sh check 2>&1); then echo "no simulated hosts: $why"; exit 0; fi
rig=$(scripts/simhosts.sh up 2 2) || exit 1
trap 'scripts/simhosts.sh down "$rig"' EXIT
for l in 1 2; do
  echo "== 2 simulated hosts x $l ranks (TCP over veths)"
  scripts/simhosts.sh run "$rig" bash -c "mpirun \$SIMHOSTS_MPIRUN --oversubscribe --bind-to none -np $((2 * l)) --npernode $l $B"
done
