#!/usr/bin/env bash
# bench/gpt2_scaling.sh - does the step cost the same per model FLOP as the
# model grows, and what is the largest GPT this machine trains?
#  1. the fp32 GEMM rate of the machine (bench/gemm_rate, all threads), in the
#     same run;
#  2. for each of MODELS (default gpt2 gpt2-medium gpt2-large): NPROC ranks x 1
#     thread FULL_SHARD fp32 AdamW, SEQ tokens per sequence, the largest global
#     batch (a multiple of NPROC) that `fsdp-train --dry-run` says fits this
#     host's memory (--mem-limit auto: the library's measured plan against
#     MemAvailable), STEPS steps; the median step of steps 3..STEPS (the first
#     two fault in fresh pages: the arena's chunks are merged after step 1), the model
#     FLOP/s (3 x fsdp_gpt_flops_per_token: 6 N_matmul + 12 L T C per token),
#     its ratio to the GEMM rate, peak RSS per rank, and the spread of the
#     per-FLOP step times (target: every model within 10% of each other);
#  3. the largest GPT of gpt2-large's width (n_embd 1280, 20 heads) by layers:
#     the most layers whose plan fits at a global batch of NPROC sequences,
#     then one real step of it (LARGEST=0 skips this part).
# Usage: bench/gpt2_scaling.sh [STEPS]   (default 5; the first two steps are not timed)
#   env MODELS="..." (empty: only part 3), NPROC (2), SEQ (256), MAXB (the largest batch tried, 256)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-5}
MODELS=${MODELS-gpt2 gpt2-medium gpt2-large}
NPROC=${NPROC:-2}
SEQ=${SEQ:-256}
MAXB=${MAXB:-256}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
make -s -j2 "$BUILD/fsdp-train" "$BUILD/bench/gemm_rate" >/dev/null
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores," \
     "$(awk '/MemTotal/ {printf "%.1f GB", $2 / 1e6}' /proc/meminfo); $(date -u '+%Y-%m-%d %H:%M UTC');" \
     "load $(cut -d' ' -f1-3 /proc/loadavg)"
gemm=$("$BUILD/bench/gemm_rate" "$(nproc)" | awk '{print $2}')
echo "fp32 GEMM rate: $gemm GFLOP/s ($(nproc) threads)"

# fits MODEL_FLAGS... : 0 when --dry-run's plan fits the host (every rank), else 1
fits() {
  "$BUILD/fsdp-train" "$@" --seq "$SEQ" --nproc "$NPROC" --threads 1 --dry-run > "$tmp/dry" 2>&1 || true
  grep -q -- "--mem-limit auto.*: fits" "$tmp/dry"
}
# largest B (a multiple of NPROC, at most MAXB) with `fits ... --batch B`; 0 if none
largest_batch() {
  local lo=0 hi=$NPROC
  while [ $hi -le "$MAXB" ] && fits "$@" --batch $hi; do lo=$hi; hi=$((hi * 2)); done
  [ $hi -gt "$MAXB" ] && hi=$((MAXB + NPROC))
  while [ $((hi - lo)) -gt "$NPROC" ]; do # lo fits (or is 0), hi does not
    local mid=$(( (lo + hi) / 2 / NPROC * NPROC ))
    if fits "$@" --batch $mid; then lo=$mid; else hi=$mid; fi
  done
  echo $lo
}

echo "| model | parameters | global batch (largest that fits) | plan per rank | median step | model GFLOP/s | of the GEMM rate | s per PFLOP | peak RSS per rank |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
for m in $MODELS; do
  b=$(largest_batch --model "$m")
  [ "$b" -gt 0 ] || { echo "| $m | | nothing fits | | | | | | |"; continue; }
  fits --model "$m" --batch "$b"; plan=$(awk '$1 == "0" {print $(NF-1), $NF}' "$tmp/dry")
  "$BUILD/fsdp-train" --model "$m" --data synthetic --batch "$b" --seq "$SEQ" --steps "$STEPS" --warmup 1 \
    --nproc "$NPROC" --threads 1 --sample 0 --log "$tmp/$m.jsonl" > "$tmp/$m.out" 2>&1 ||
    { echo "fsdp-train --model $m --batch $b failed:"; grep -m3 -i "error" "$tmp/$m.out"; tail -3 "$tmp/$m.out"; exit 1; }
  python3 - "$tmp/$m.jsonl" "$tmp/$m.out" "$gemm" "$b" "$plan" "$m" <<'PY' | tee -a "$tmp/rows"
import json, re, statistics, sys
log, out, gemm, b, plan, name = sys.argv[1], open(sys.argv[2]).read(), float(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
steps = [r for r in map(json.loads, open(log)) if "step" in r]
# the trainer's own figures (fsdp_gpt_flops_per_token behind its MFU): model FLOPs a step =
# mfu x the MFU peak it printed x the step's seconds; the parameter count from its model line
peak = float(re.search(r"^MFU peak: ([0-9.]+) GFLOP/s", out, re.M).group(1)) * 1e9
params = re.search(r"^model: .*: ([0-9.]+)M parameters", out, re.M).group(1)
flops = statistics.median(r["mfu"] * peak * r["step_ms"] / 1e3 for r in steps)
T = steps[0]["tokens"] // b
s = statistics.median(r["step_ms"] for r in steps[2:]) / 1e3
rss = max(r["peak_rss_mb"] for r in steps)
print(f"| {name} | {float(params):.0f}M | {b} x {T} | {plan} | {s:.2f} s | {flops / s / 1e9:.1f} | "
      f"{flops / s / 1e9 / gemm:.3f} | {s / flops * 1e15:.1f} | {rss:.0f} MB |")
PY
done
touch "$tmp/rows"; python3 - "$tmp/rows" <<'PY'
import sys
v = [float(l.split("|")[8]) for l in open(sys.argv[1]) if l.startswith("|")]
if len(v) > 1:
    print(f"s per PFLOP: max / min = {max(v) / min(v):.3f} (target <= 1.10)")
PY

[ "${LARGEST:-1}" = 0 ] && exit 0
# ---- the largest GPT of gpt2-large's width that fits, by layers ----
cfgf() { echo "{\"n_layer\":$1,\"n_head\":20,\"n_embd\":1280,\"vocab_size\":50257,\"block_size\":1024}" > "$tmp/L$1.json"; echo "$tmp/L$1.json"; }
lo=36 hi=72
fits --model-config "$(cfgf $lo)" --batch "$NPROC" || { echo "largest GPT: even 36 layers do not fit"; exit 0; }
while fits --model-config "$(cfgf $hi)" --batch "$NPROC"; do lo=$hi; hi=$((hi * 2)); done
while [ $((hi - lo)) -gt 1 ]; do
  mid=$(( (lo + hi) / 2 ))
  if fits --model-config "$(cfgf $mid)" --batch "$NPROC"; then lo=$mid; else hi=$mid; fi
done
fits --model-config "$(cfgf $lo)" --batch "$NPROC"
echo "largest GPT (n_embd 1280, 20 heads, batch $NPROC x $SEQ, FULL_SHARD fp32 AdamW, $NPROC ranks): $lo layers," \
     "plan per rank: $(awk '$1 == "0" {print $(NF-1), $NF}' "$tmp/dry")"
fits --model-config "$(cfgf $((lo + 1)))" --batch "$NPROC" || true
echo "  $((lo + 1)) layers: plan per rank $(awk '$1 == "0" {print $(NF-1), $NF}' "$tmp/dry"), $(grep -- '--mem-limit auto' "$tmp/dry" | sed 's/.*(--mem-limit auto): //')"
t0=$(date +%s)
if "$BUILD/fsdp-train" --model-config "$(cfgf $lo)" --data synthetic --batch "$NPROC" --seq "$SEQ" --steps 1 \
     --nproc "$NPROC" --threads 1 --sample 0 --log "$tmp/largest.jsonl" > "$tmp/largest.out" 2>&1; then
  python3 - "$tmp/largest.jsonl" "$(( $(date +%s) - t0 ))" "$tmp/largest.out" <<'PY'
import json, re, sys
r = [x for x in map(json.loads, open(sys.argv[1])) if "step" in x][0]
print("  " + re.search(r"^model: (.*)$", open(sys.argv[3]).read(), re.M).group(1))
print(f"  one real step: loss {r['loss']:.4f}, grad norm {r['grad_norm']:.3f}, {r['step_ms'] / 1e3:.1f} s "
      f"(the first step: fresh memory), peak RSS {r['peak_rss_mb']:.0f} MB per rank; {sys.argv[2]} s with start-up")
PY
else
  echo "  one real step FAILED:"; tail -5 "$tmp/largest.out"
fi
