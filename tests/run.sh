#!/usr/bin/env bash
# tests/run.sh - runs the whole suite and prints "N passed, N failed, N skipped".
#  - build/tests/test_*      C unit tests (the harness forks each test)
#  - build/tests/test_mpi_*  run under mpirun at 1..4 ranks, test_mpi_comm and
#                            test_mpi_comm_backends at 1..5
#                            (TEST_RANKS overrides)
#  - tests/t_*.sh            end-to-end checks of the tools; each prints its own
#                            "N passed, N failed" line
# Usage: tests/run.sh [FILTER]   (FILTER: substring of a test file name)
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
export BUILD
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# every collective of the suite checks that all ranks call the same one (src/comm)
export FSDP_CHECK_COLLECTIVES=${FSDP_CHECK_COLLECTIVES:-1}
# every gather from a unit's 16-bit shard copy checks it against the shard (src/fsdp/mixed.c)
export FSDP_CHECK_LP_COPY=${FSDP_CHECK_LP_COPY:-1}
# the MPI backend's progress thread on, though CI's 2 cores leave no core free for it (src/comm/mpi.c)
export FSDP_MPI_PROGRESS=${FSDP_MPI_PROGRESS:-1}
# OpenMP threads sleep at barriers instead of spinning: with another busy process on a shared
# 2-core box, spinning threads took test_nn_bf16 from 0.9 s to 39 s (0.9 s passive); quiet, it
# costs about 10%
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
case "$BUILD" in *asan*) # sanitized suite: leaks of our code fail, Open MPI's own are
  # suppressed (tests/lsan.supp), by the module of the frame that allocated: the build keeps
  # Open MPI's plugins loaded to exit, so their frames still name one under the fast unwinder
  # ([Note: plugins kept loaded], tests/lsan_keep_plugins.c)
  export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/tests/lsan.supp:print_suppressions=0}
  export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1} ;;
esac
filter=${1:-}
P=0 F=0 S=0
failed_names=()

tally() { # $1 = name, $2 = output file, $3 = exit code
  local line
  line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$2" | tail -n 1)
  if [ -z "$line" ]; then
    echo "FAIL $1 (no summary line, exit $3)"; F=$((F + 1)); failed_names+=("$1"); return
  fi
  local p f s
  p=$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')
  f=$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')
  s=$(echo "$line" | sed -nE 's/.*, ([0-9]+) skipped.*/\1/p'); s=${s:-0}
  if [ "$3" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "FAIL $1 (exit $3)"; fi
  P=$((P + p)); F=$((F + f)); S=$((S + s))
  [ "$f" -ne 0 ] && failed_names+=("$1")
}

run_one() { # $1 = name, rest = command
  local name=$1; shift
  local out; out=$(mktemp)
  echo "== $name"
  local t0=$SECONDS
  timeout -k 10 "${SUITE_TIMEOUT:-600}" "$@" > "$out" 2>&1
  local rc=$?
  grep -vE '^ok ' "$out" | tail -n 60
  echo "   ($((SECONDS - t0)) s)"
  tally "$name" "$out" "$rc"
  rm -f "$out"
}

# The library's own vector paths at each level up to the CPU's ([Note: vector paths at run
# time], src/core/cpu.c): the conversions, the softmax rows and the 16-bit layers over them,
# shm's copies and sums, the CRC-32C of checkpoint files.
# A level above the CPU's would run the CPU's again (the default run's): the levels stop at the
# CPU's, as the library detects it (test_dtype prints it; all three if it says nothing).
cpu_level=$("$BUILD"/tests/test_dtype vector_level 2>&1 | sed -n "s/.*the CPU's level \([a-z0-9]*\);.*/\1/p")
every_level() { # name command...
  local name=$1; shift
  for isa in scalar avx2 avx512; do
    run_one "$name (FSDP_MAX_CPU_ISA=$isa)" env FSDP_MAX_CPU_ISA=$isa "$@"
    [ "$isa" = "$cpu_level" ] && break
  done
}

for t in "$BUILD"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && continue
  case "$name" in
    test_mpi_*)
      ranks="1 2 3 4" sanitized="1 2 3"
      # the collectives' tests: world sizes 1-5
      case "$name" in test_mpi_comm|test_mpi_comm_backends) ranks="1 2 3 4 5" sanitized="1 2 3 5" ;; esac
      # sanitized builds: one world, two ranks and uneven shares are the code paths; the
      # numerics at every world size are the plain suite's (it keeps CI within its time)
      case "$BUILD" in *asan*|*tsan*) ranks=$sanitized ;; esac
      for n in ${TEST_RANKS:-$ranks}; do
        run_one "$name -np $n" mpirun -np "$n" --oversubscribe "$t"
      done
      # shm's streaming copies and sums (src/comm/shm.c) at each level, uneven shares
      [ "$name" = test_mpi_comm ] && every_level "$name -np 3" mpirun -np 3 --oversubscribe "$t" ;;
    test_gemm_lp|test_nn_bf16|test_nn_lp_exact|test_nn_vision_lp) # and once more with bf16 products widened to fp32, the
      # path of CPUs without native bf16 kernels (src/nn/gemm_lp.c, src/nn/conv.c), and on each of
      # oneDNN's two bf16 matmuls where it has them ([Note: bf16 kernels]; widened where it has none)
      run_one "$name" "$t"
      for how in widen matmul gemm; do run_one "$name (FSDP_GEMM_BF16=$how)" env FSDP_GEMM_BF16=$how "$t"; done
      [ "$name" = test_nn_bf16 ] && every_level "$name" "$t" ;;
    test_dtype|test_nn|test_safetensors) run_one "$name" "$t"; every_level "$name" "$t" ;;
    *) run_one "$name" "$t" ;;
  esac
done
for t in tests/t_*.sh; do
  [ -f "$t" ] || continue
  name=$(basename "$t")
  [ -n "$filter" ] && [[ "$name" != *"$filter"* ]] && continue
  run_one "$name" bash "$t"
done

echo
[ ${#failed_names[@]} -gt 0 ] && echo "failed in: ${failed_names[*]}"
echo "$P passed, $F failed, $S skipped"
[ "$F" -eq 0 ]
