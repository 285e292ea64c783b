#!/usr/bin/env bash
# bench/bf16_step.sh - issue 4's benchmark. GPT-2 124M, global batch 4 x 256
# tokens, AdamW, 1 rank x 2 threads: median step time with bf16 mixed precision
# (fsdp_parallelize_model with FSDP_BF16 and mixed_precision DEFAULT: units
# gathered in bf16, Linear and attention products on oneDNN's AMX bf16 matmul
# with fp32 accumulation; LayerNorm, softmax, GELU, loss, gradient reduction,
# fp32 master weights and AdamW unchanged) against fp32 in the same run, model
# FLOP/s, both against the fp32 and bf16 GEMM rates measured in the same run
# (bench/gemm_rate all), the peak memory of each (the library's accounted
# peak and the process's peak RSS, the kernel's high-water mark reset before
# each run), and with 10+ steps the mean loss of the last 10 steps of each
# (issue 4 asks for 200 steps within 2%); then issue 19's targets as ratios
# to the rates of this run.
# Usage: [BATCH=B] bench/bf16_step.sh [STEPS] [FULL|DEFAULT|PURE]
#   (default 6 DEFAULT; the first step is not timed; the full check is
#    `bench/bf16_step.sh 200`, about 20 minutes on a quiet machine; BATCH
#    sequences of 256 tokens, default 4: the issues' batch)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
MP=${2:-DEFAULT}
BATCH=${BATCH:-4}
out=$("$BUILD/bench/gemm_rate" 2 all)
echo "$out"
gemm32=$(echo "$out" | awk '$1 == "gemm_gflops" {print $2}')
gemm16=$(echo "$out" | awk '$1 == "gemm_bf16_gflops" {print $2}')
res=$(OMP_NUM_THREADS=2 "$BUILD/bench/bf16_step" "$STEPS" 2 gpt2 "$BATCH" 256 both "$MP" 2>/dev/null)
echo "$res"
model16=$(echo "$res" | awk '$1 == "bf16_model_gflops" {print $2}')
model32=$(echo "$res" | awk '$1 == "fp32:" {for (i = 1; i <= NF; i++) if ($i == "GFLOP/s") print $(i - 1)}')
awk -v a="$model32" -v b="$gemm32" -v c="$model16" -v d="$gemm16" 'BEGIN {
  printf "fp32 model FLOP/s = %.2f of the fp32 GEMM rate; bf16 model FLOP/s = %.2f of the bf16 GEMM rate\n", a / b, c / d }'
speed=$(echo "$res" | awk '$1 == "bf16_speedup" {print $2}')
mem=$(echo "$res" | awk '$1 == "bf16_mem_ratio" {print $2, $3}')
# issue 19's targets, as ratios to this machine's rates measured above
awk -v c="$model16" -v d="$gemm16" -v b="$gemm32" -v x="$speed" -v m="${mem% *}" -v r="${mem#* }" 'BEGIN {
  want = 0.85 * d / b
  printf "targets: bf16 %.2f of the bf16 GEMM rate (>= 0.78: %s); speedup %.2fx fp32 (>= 0.85 x %.2f = %.2f: %s); ",
         c / d, (c / d >= 0.78) ? "met" : "NOT met", x, d / b, want, (x >= want) ? "met" : "NOT met"
  printf "memory: accounted peak %.3f, peak RSS %.3f of fp32 (<= 0.8: %s)\n", m, r, (r <= 0.8) ? "met" : "NOT met" }'
if echo "$out" | grep -q 'gemm_bf16_gflops.*widened'; then
  echo "note: this CPU has no native bf16 matmul (bf16 products widened to fp32): the speed targets are for AMX"
fi
