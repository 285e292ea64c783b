#!/usr/bin/env bash
# bench/overlap.sh - FULL_SHARD on 2 ranks x 1 thread against 1 rank x 2
# threads, same global batch (4 x 256 tokens), fp32, AdamW, GPT-2 124M:
# median step time of each, their ratio (target <= 1.10), and the exposed
# communication fraction (time the compute thread waited on collectives /
# step time), with --overlap on (prefetch + asynchronous reduce-scatters)
# and off, all measured in the same run. Also HYBRID_SHARD and NO_SHARD on
# 2 ranks for reference, and FULL_SHARD on the MPI backend (--comm mpi) with
# its progress thread forced on (FSDP_MPI_PROGRESS=1; by default it runs
# only when a core is free for it) and off (FSDP_MPI_PROGRESS=0).
# Usage: bench/overlap.sh [STEPS] [MODEL]   (defaults 6, gpt2; the first step
# is not timed; MODEL tiny makes a smoke run)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
MODEL=${2:-gpt2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
SEQ=256
[ "$MODEL" = tiny ] && SEQ=64
run() { # name nproc threads flags...
  local name=$1 n=$2 t=$3; shift 3
  "$BUILD/fsdp-train" --model "$MODEL" --data synthetic --batch 4 --seq "$SEQ" --steps "$STEPS" --warmup 1 \
    --threads "$t" --nproc "$n" --sample 0 --log "$tmp/$name.jsonl" "$@" > "$tmp/$name.out" 2>&1 \
    || { cat "$tmp/$name.out"; exit 1; }
}
run r1 1 2
run full_on 2 1 --sharding FULL_SHARD --overlap on
run full_off 2 1 --sharding FULL_SHARD --overlap off
run hybrid 2 1 --sharding HYBRID_SHARD --shard-group 1
run ddp 2 1 --sharding NO_SHARD
FSDP_MPI_PROGRESS=1 run mpi_on 2 1 --sharding FULL_SHARD --comm mpi
FSDP_MPI_PROGRESS=0 run mpi_off 2 1 --sharding FULL_SHARD --comm mpi
python3 - "$tmp" "$MODEL" <<'PY'
import json, statistics, sys
d, model = sys.argv[1], sys.argv[2]
def med(name):
    all_rows = [r for r in map(json.loads, open(f"{d}/{name}.jsonl")) if "step" in r]
    rows = all_rows[1:] or all_rows
    t = statistics.median(r["step_ms"] for r in rows)
    exposed = statistics.median(r.get("exposed_comm_ms", r["comm_ms"]) for r in rows)
    return t / 1e3, exposed / t
t1, _ = med("r1")
print(f"{model}, global batch 4 sequences; 1 rank x 2 threads: {t1:.3f} s/step (reference)")
for name, what in [("full_on", "FULL_SHARD, overlap on "), ("full_off", "FULL_SHARD, overlap off"),
                   ("hybrid", "HYBRID_SHARD group 1 (replicated)"), ("ddp", "NO_SHARD (DDP)"),
                   ("mpi_on", "FULL_SHARD, --comm mpi, FSDP_MPI_PROGRESS=1"),
                   ("mpi_off", "FULL_SHARD, --comm mpi, FSDP_MPI_PROGRESS=0")]:
    t, f = med(name)
    print(f"2 ranks x 1 thread, {what}: {t:.3f} s/step = {t / t1:.2f}x 1 rank "
          f"(target <= 1.10 for FULL_SHARD), exposed communication {100 * f:.1f}% of the step")
PY
