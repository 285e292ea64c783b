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
# Usage: [ROUNDS=R] bench/step_limit.sh [STEPS]   (default 6 steps, 1 round)
#   Then issue 19's targets, each against this round's own probes: fp32 1 x 2
#   >= 0.88 of the fp32 GEMM rate (or within 5% of its limit where that is
#   lower), AMP_BF16 >= 0.78 of the bf16 rate (likewise), AMP_BF16's speedup
#   >= 0.85 x the probes' ratio, 4 x 1 / 1 x 2 <= 1.15. Where the bf16
#   products are widened to fp32 (no bf16 kernels on the CPU, or
#   FSDP_GEMM_BF16=widen), the two bf16 targets are the issue's for such CPUs
#   instead: AMP_BF16 1 x 2 no slower than fp32 (fp32 step / bf16 step >= 1),
#   printed with the limits' own ratio. This VM's figures move
#   10-20% between runs minutes apart, so ROUNDS=R repeats the whole (probes,
#   limits and the four runs) R times and also prints each figure's median
#   over the rounds and whether a majority of the rounds met it.
#   MODEL=tiny B=4 SEQ=32 SECS=0.01 bench/step_limit.sh 3   checks the script in seconds
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
MODEL=${MODEL:-gpt2}
B=${B:-4}
SEQ=${SEQ:-256}
SECS=${SECS:-0.2}
ROUNDS=${ROUNDS:-1}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
run() { # dir name nproc threads precision
  "$BUILD/fsdp-train" --model "$MODEL" --data synthetic --batch "$B" --seq "$SEQ" --steps "$STEPS" --warmup 1 \
    --threads "$4" --nproc "$3" --precision "$5" --sample 0 --log "$1/$2.jsonl" > "$1/$2.out" 2>&1 ||
    { cat "$1/$2.out"; exit 1; }
}
for k in $(seq 1 "$ROUNDS"); do
  d="$tmp/r$k"; mkdir "$d"
  [ "$ROUNDS" = 1 ] || echo "== round $k of $ROUNDS ($(date -u +%H:%M:%S) UTC) =="
  "$BUILD/bench/step_limit" "$MODEL" "$B" "$SEQ" 2 4 "$SECS" | tee "$d/limit.out"
  run "$d" fp32_1x2 1 2 FP32
  run "$d" bf16_1x2 1 2 AMP_BF16
  run "$d" fp32_4x1 4 1 FP32
  run "$d" bf16_4x1 4 1 AMP_BF16
  echo
  python3 - "$d" <<'PY'
import json, statistics, sys
d = sys.argv[1]
lim, ph, flushed, probe = {}, {}, {}, {}
widened = False
for line in open(f"{d}/limit.out"):
    f = line.split()
    if line.startswith("bf16 products:"):
        widened = "widened" in line
    if f and f[0] == "limit" and len(f) > 3 and "_" in f[1]:
        lim[f[1]] = (float(f[2]), float(f[3]))  # seconds, model FLOP/s at the limit over the GEMM probe
    if f[:1] == ["limit_flushed"]:
        flushed[f[1]] = (float(f[2]), float(f[3]))
    if f[:1] == ["phases"]:
        ph[f[1]] = [float(x) for x in f[2:5]]
    if f[:1] in (["gemm_gflops"], ["gemm_bf16_gflops"]):
        probe[f[0]] = float(f[1])
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
# issue 19's targets against this round's probes
out = {}
for p, want in (("fp32", 0.88),) if widened else (("fp32", 0.88), ("bf16", 0.78)):
    t, frac = lim[f"{p}_1x2"]
    step = m[f"{p}_1x2"]["step_ms"]
    rate = frac * t / step  # model FLOP/s over the probe: the limit's fraction scaled by limit / step
    # met: >= want of the rate, or (the limit itself below want) within 5% of the limit
    out[f"{p}_rate"] = (rate, want, rate >= want or (frac < want and step <= 1.05 * t), f"limit {frac:.3f} of the rate")
sp = m["fp32_1x2"]["step_ms"] / m["bf16_1x2"]["step_ms"]
ask = 1.0 if widened else 0.85 * probe["gemm_bf16_gflops"] / probe["gemm_gflops"]
out["widened_vs_fp32" if widened else "speedup"] = (sp, ask, sp >= ask,
                                                    f"limits' ratio {lim['fp32_1x2'][0] / lim['bf16_1x2'][0]:.3f}")
for p in ("fp32", "bf16"):
    r = m[f"{p}_4x1"]["step_ms"] / m[f"{p}_1x2"]["step_ms"]
    out[f"{p}_4x1"] = (r, 1.15, r <= 1.15, f"limits' ratio {lim[f'{p}_4x1'][0] / lim[f'{p}_1x2'][0]:.3f}")
json.dump(out, open(f"{d}/targets.json", "w"))
print("issue 19's targets, this round:")
for k, (v, want, ok, note) in out.items():
    print(f"  {k}: {v:.3f} ({'<=' if k.endswith('4x1') else '>='} {want:.3f}: {'met' if ok else 'NOT met'}; {note})")
PY
done
if [ "$ROUNDS" -gt 1 ]; then
  python3 - "$tmp" "$ROUNDS" <<'PY'
import json, statistics, sys
rounds = [json.load(open(f"{sys.argv[1]}/r{k}/targets.json")) for k in range(1, int(sys.argv[2]) + 1)]
print(f"\nissue 19's targets over {len(rounds)} rounds (each figure against its own round's probes):")
for k in rounds[0]:
    v = [r[k][0] for r in rounds]
    met = sum(r[k][2] for r in rounds)
    want = statistics.median(r[k][1] for r in rounds)
    up = not k.endswith("4x1")
    print(f"  {k}: median {statistics.median(v):.3f} ({'>=' if up else '<='} {want:.3f}, the median asked), "
          f"rounds {', '.join(f'{x:.3f}' for x in v)}; met in {met} of {len(rounds)} rounds: "
          f"{'met' if 2 * met > len(rounds) else 'NOT met'} (a majority of the rounds)")
PY
fi
