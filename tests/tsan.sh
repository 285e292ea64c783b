#!/usr/bin/env bash
# tests/tsan.sh - ThreadSanitizer over the threaded parts (after `make tsan`):
# the shm backend's progress thread against the compute thread, through the
# collective conformance suite (tests/test_mpi_comm.c) at 2 and 4 ranks and
# short fsdp-train runs on shm (2 and 3 ranks). Any report fails the run
# (TSan exits 66). Prints "N passed, N failed" at the end.
# Usage: BUILD=build-tsan tests/tsan.sh   (the default BUILD here is build-tsan)
#
# Caveats, each the reason for a setting below:
#  - OMP_NUM_THREADS=1: libgomp is not built with TSan, so the ordering its
#    barriers and futexes give an OpenMP team is invisible to it, and every
#    `omp parallel for` over a shared buffer (e.g. dtype.c's conversions, also
#    run by the progress thread for BF16/F16 reductions) is reported as a race
#    between team threads. With one thread per team, libgomp runs each region
#    on the calling thread, so what is checked is our own threads (compute vs
#    progress), which is what this run is for.
#  - OMPI_MCA_btl=self,vader: Open MPI's TCP transport (unused on one host)
#    locks two of its own mutexes in both orders while it adds and removes
#    peers at MPI_Init (mca_btl_tcp_add_procs / _proc_remove), which TSan
#    reports as a potential deadlock inside Open MPI.
# With these two, no suppression file is needed: every report is ours.
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-tsan}
export BUILD
. tests/lib.sh
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_btl=self,vader OMP_NUM_THREADS=1
export TSAN_OPTIONS="second_deadlock_stack=1 ${TSAN_OPTIONS:-}"
export FSDP_CHECK_COLLECTIVES=1

reports() { grep -c "WARNING: ThreadSanitizer" "$1"; }

for n in 2 4; do
  timeout -k 10 900 mpirun -np $n --bind-to none "$BUILD/tests/test_mpi_comm" > "$tmp/comm$n" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && [ "$(reports "$tmp/comm$n")" -eq 0 ] && grep -qE "^[0-9]+ passed, 0 failed" "$tmp/comm$n"; then
    ok "test_mpi_comm at $n ranks: $(grep -E '^[0-9]+ passed' "$tmp/comm$n"), no TSan report"
  else bad "test_mpi_comm at $n ranks" "exit $rc, $(reports "$tmp/comm$n") TSan reports" \
           "$(grep -E 'FAIL|SUMMARY' "$tmp/comm$n" | sort | uniq -c | head -10)"; fi
done

for n in 2 3; do
  timeout -k 10 600 "$TRAIN" --model tiny --data synthetic --batch 6 --seq 32 --steps 4 --threads 1 --sample 0 \
    --nproc $n --comm shm --log "$tmp/train$n.jsonl" > "$tmp/train$n" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && [ "$(reports "$tmp/train$n")" -eq 0 ] && [ "$(wc -l < "$tmp/train$n.jsonl")" -eq 4 ]; then
    ok "fsdp-train --comm shm at $n ranks: 4 steps, no TSan report"
  else bad "fsdp-train --comm shm at $n ranks" "exit $rc, $(reports "$tmp/train$n") TSan reports" \
           "$(grep -E 'SUMMARY|error' "$tmp/train$n" | sort | uniq -c | head -10)"; fi
done

finish
