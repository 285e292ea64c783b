#!/usr/bin/env bash
# bench/step_limit.sh - issue 19's limits against the real step, in one run:
#  1. build/bench/step_limit: the GEMM rate of every product class of the
#     step (forward, dW, dX of each Linear, the attention products), the
#     memory bandwidth, and the step's limit (products at their rates plus
#     the memory-bound passes at the bandwidth), fp32 and AMP_BF16, 1 rank x
#     2 threads and 4 ranks x 1 thread; and a second limit with each class
#     at its mean rate after the caches are flushed ([Note: flushed caches]
#     in bench/step_limit.c), nearer what a step's products meet;
#  2. fsdp-train on the same step (--batch 4 --seq 256, synthetic data):
#     fp32 and AMP_BF16, each at 1 rank x 2 threads and 4 ranks x 1 thread;
#     median of steps 2..STEPS, its forward / backward / update phases, and
#     measured / limit.
# Usage: bench/step_limit.sh [STEPS]   (default 6)
#   MODEL=tiny B=4 SEQ=32 SECS=0.01 bench/step_limit.sh 3   checks the script in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
MODEL=${MODEL:-gpt2}
B=${B:-4}
SEQ=${SEQ:-256}
SECS=${SECS:-0.2}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$BUILD/bench/step_limit" "$MODEL" "$B" "$SEQ" 2 4 "$SECS" | tee "$tmp/limit.out"
run() { # name nproc threads precision
  "$BUILD/fsdp-train" --model "$MODEL" --data synthetic --batch "$B" --seq "$SEQ" --steps "$STEPS" --warmup 1 \
    --threads "$3" --nproc "$2" --precision "$4" --sample 0 --log "$tmp/$1.jsonl" > "$tmp/$1.out" 2>&1 ||
    { cat "$tmp/$1.out"; exit 1; }
}
run fp32_1x2 1 2 FP32
run bf16_1x2 1 2 AMP_BF16
run fp32_4x1 4 1 FP32
run bf16_4x1 4 1 AMP_BF16
echo
python3 - "$tmp" <<'PY'
import json, statistics, sys
d = sys.argv[1]
lim, ph, flushed = {}, {}, {}
for line in open(f"{d}/limit.out"):
    f = line.split()
    if f and f[0] == "limit" and len(f) > 3 and "_" in f[1]:
        lim[f[1]] = (float(f[2]), float(f[3]))
    if f[:1] == ["limit_flushed"]:
        flushed[f[1]] = (float(f[2]), float(f[3]))
    if f[:1] == ["phases"]:
        ph[f[1]] = [float(x) for x in f[2:5]]
def med(name):  # the log's step lines, without the first step
    rows = [r for r in map(json.loads, open(f"{d}/{name}.jsonl")) if "step" in r][1:]
    return {k: statistics.median(r[k] for r in rows) / 1e3 for k in ("step_ms", "forward_ms", "backward_ms", "update_ms")}
m = {n: med(n) for n in ("fp32_1x2", "bf16_1x2", "fp32_4x1", "bf16_4x1")}
print("measured (median of steps 2..) against the limit:")
for n, x in m.items():
    t, frac = lim[n]
    print(f"{n}: step {x['step_ms']:.3f} s (forward {x['forward_ms']:.3f}, backward {x['backward_ms']:.3f}, "
          f"update {x['update_ms']:.3f}); limit {t:.3f} s = {frac:.3f} of the GEMM rate; measured / limit {x['step_ms'] / t:.3f}")
    print(f"    by phase, measured / limit: " + ", ".join(
        f"{k} {x[k + '_ms']:.3f} / {l:.3f} = {x[k + '_ms'] / l:.2f}" for k, l in zip(("forward", "backward", "update"), ph[n])))
    tf, ff = flushed[n]
    print(f"    against the flushed-cache limit (products at their mean rate on operands from memory): "
          f"{tf:.3f} s = {ff:.3f} of the GEMM rate; measured / that {x['step_ms'] / tf:.3f}")
for p in ("fp32", "bf16"):
    r = m[f"{p}_4x1"]["step_ms"] / m[f"{p}_1x2"]["step_ms"]
    lr = lim[f"{p}_4x1"][0] / lim[f"{p}_1x2"][0]
    print(f"{p}: 4 ranks x 1 thread / 1 rank x 2 threads: measured {r:.3f} (target <= 1.15), limits {lr:.3f}")
PY
