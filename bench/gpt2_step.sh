#!/usr/bin/env bash
# bench/gpt2_step.sh - GPT-2 124M, global batch 4 x 256 tokens, fp32, AdamW:
#  1. median step time at 1 rank x 2 threads, model FLOP/s, and its ratio to
#     the fp32 GEMM rate measured in the same run (bench/gemm_rate);
#  2. the same at 2 ranks x 1 thread and 4 ranks x 1 thread (oversubscribed,
#     FULL_SHARD): step time relative to 1 rank and peak RSS per rank.
# Usage: bench/gpt2_step.sh [STEPS]   (default 6; the first step is not timed)
#
# BEFORE=DIR (a build folder of another commit, e.g. a worktree's build/):
# instead, a before/after comparison of the 1-rank step in one run: ROUNDS
# (default 3) rounds, each running DIR's fsdp-train and then $BUILD's, same
# flags (FLAGS adds fsdp-train flags to both, e.g. FLAGS='--precision AMP_BF16');
# prints each build's median step over all its timed steps and the ratio
# after/before.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if [ -n "${BEFORE:-}" ]; then
  [ -x "$BEFORE/fsdp-train" ] || { echo "gpt2_step: BEFORE=$BEFORE: no fsdp-train there"; exit 1; }
  for r in $(seq "${ROUNDS:-3}"); do
    for side in before after; do
      b=$BUILD; [ $side = before ] && b=$BEFORE
      "$b/fsdp-train" --model gpt2 --data synthetic --batch 4 --seq 256 --steps "$STEPS" --warmup 1 --threads 2 \
        --sample 0 ${FLAGS:-} --log "$tmp/$side$r.jsonl" > "$tmp/$side$r.out" 2>&1 || { cat "$tmp/$side$r.out"; exit 1; }
    done
  done
  python3 - "$tmp" "${ROUNDS:-3}" <<'PY'
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
med, runs = {}, {}
for side in ("before", "after"):
    ms, runs[side] = [], []
    for r in range(1, rounds + 1):  # the log's step lines, without each run's first step
        m = [x["step_ms"] for x in map(json.loads, open(f"{d}/{side}{r}.jsonl")) if "step" in x][1:]
        ms += m
        runs[side].append(statistics.median(m) / 1e3)
    med[side] = statistics.median(ms) / 1e3
    print(f"{side}: {med[side]:.3f} s/step median of {len(ms)} steps (min {min(ms) / 1e3:.3f}, max {max(ms) / 1e3:.3f}); "
          f"per run: {', '.join(f'{x:.3f}' for x in runs[side])}")
pairs = [a / b for a, b in zip(runs["after"], runs["before"])]
print(f"after / before: {med['after'] / med['before']:.3f} (medians of all steps); per round {', '.join(f'{x:.3f}' for x in pairs)}, "
      f"median {statistics.median(pairs):.3f}")
PY
  exit 0
fi
gemm=$("$BUILD/bench/gemm_rate" 2 | awk '{print $2}')
echo "fp32 GEMM rate (2 threads): $gemm GFLOP/s"
run() { # name nproc threads
  "$BUILD/fsdp-train" --model gpt2 --data synthetic --batch 4 --seq 256 --steps "$STEPS" --warmup 1 \
    --threads "$3" --nproc "$2" --sample 0 --log "$tmp/$1.jsonl" > "$tmp/$1.out" 2>&1 || { cat "$tmp/$1.out"; exit 1; }
}
run r1 1 2
run r2 2 1
run r4 4 1
python3 - "$tmp" "$gemm" <<'PY'
import json, statistics, sys
d, gemm = sys.argv[1], float(sys.argv[2])
# forward FLOPs per token of GPT-2 124M at T=256 (matmuls incl. lm_head + attention), x3 for training
L, C, V, T = 12, 768, 50257, 256
fwd = 2 * (L * 12 * C * C + C * V) + 2 * 2 * L * T * C
def med(name):
    rows = [r for r in map(json.loads, open(f"{d}/{name}.jsonl")) if "step" in r][1:]
    return statistics.median(r["step_ms"] for r in rows) / 1e3, max(r["peak_rss_mb"] for r in rows)
t1, m1 = med("r1"); t2, m2 = med("r2"); t4, m4 = med("r4")
flops = 3 * fwd * 4 * 256 / t1 / 1e9
print(f"1 rank x 2 threads: {t1:.3f} s/step median, {flops:.1f} GFLOP/s model = {flops / gemm:.2f} of GEMM rate, peak RSS {m1:.0f} MB")
print(f"2 ranks x 1 thread: {t2:.3f} s/step = {t2 / t1:.2f}x 1 rank, peak RSS {m2:.0f} MB per rank")
print(f"4 ranks x 1 thread (oversubscribed): {t4:.3f} s/step = {t4 / t1:.2f}x 1 rank, peak RSS {m4:.0f} MB per rank")
PY
