#!/usr/bin/env bash
# bench/bf16_step.sh - GPT-2 124M, global batch 4 x 256 tokens, AdamW, 1 rank x
# 2 threads: median step time with bf16 compute (fsdp_module_set_compute_dtype:
# Linear and attention products on oneDNN's AMX bf16 matmul, fp32 accumulation;
# LayerNorm, softmax, GELU, loss and the fp32 master weights unchanged) against
# fp32 in the same run, model FLOP/s, and both against the fp32 and bf16 GEMM
# rates measured in the same run (bench/gemm_rate all).
# Usage: bench/bf16_step.sh [STEPS]   (default 6; the first step is not timed)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-6}
out=$("$BUILD/bench/gemm_rate" 2 all)
echo "$out"
gemm32=$(echo "$out" | awk '$1 == "gemm_gflops" {print $2}')
gemm16=$(echo "$out" | awk '$1 == "gemm_bf16_gflops" {print $2}')
res=$(OMP_NUM_THREADS=2 "$BUILD/bench/bf16_step" "$STEPS" 2 gpt2 4 256 2>/dev/null)
echo "$res"
model16=$(echo "$res" | awk '$1 == "bf16_model_gflops" {print $2}')
model32=$(echo "$res" | awk '$1 == "fp32:" {for (i = 1; i <= NF; i++) if ($i == "GFLOP/s") print $(i - 1)}')
awk -v a="$model32" -v b="$gemm32" -v c="$model16" -v d="$gemm16" 'BEGIN {
  printf "fp32 model FLOP/s = %.2f of the fp32 GEMM rate; bf16 model FLOP/s = %.2f of the bf16 GEMM rate\n", a / b, c / d }'
