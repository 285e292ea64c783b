#!/usr/bin/env bash
# t_precision.sh - fsdp-train's mixed precision flags end to end: AMP_BF16
# at 2 ranks against its own 1-rank run (1e-3 relative loss), the verbose
# plan's per-unit precision, AMP_FP16 with an overflow injected on one rank
# (FSDP_INJECT_OVERFLOW_STEP/RANK): that step skipped on every rank, the
# scale halved, the skip in the log and the summary; usage errors naming the
# flag; the summary's shared part of the peak RSS under the 16-bit window.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

common=(--model tiny --data synthetic --batch 12 --seq 32 --steps 6 --lr 3e-3 --warmup 2 --threads 1 --sample 0)

# ---- AMP_BF16: 2 ranks reproduce the 1-rank bf16 run ----
"$TRAIN" "${common[@]}" --precision AMP_BF16 --log "$tmp/b1.jsonl" > "$tmp/b1" 2>&1 || bad "AMP_BF16 1 rank" "$(tail -5 "$tmp/b1")"
if timeout -k 5 300 "$TRAIN" "${common[@]}" --precision AMP_BF16 --nproc 2 --log "$tmp/b2.jsonl" > "$tmp/b2" 2>&1; then
  if msg=$(python3 - "$tmp/b1.jsonl" "$tmp/b2.jsonl" <<'EOF'
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert len(a) == len(b) == 6, f"{len(a)} vs {len(b)} steps"
for x, y in zip(a, b):
    assert x["precision"] == y["precision"] == "AMP_BF16", x["precision"]
    if abs(x["loss"] - y["loss"]) > 1e-3 * abs(x["loss"]):
        sys.exit(f"step {x['step']}: loss {x['loss']} vs {y['loss']}")
EOF
  ); then ok "AMP_BF16 at 2 ranks reproduces the 1-rank bf16 run"; else bad "AMP_BF16 2 ranks" "$msg"; fi
else bad "AMP_BF16 2 ranks" "$(tail -5 "$tmp/b2")"; fi
if grep -q "precision: AMP_BF16, mixed_precision DEFAULT: 3 of 3 units gather in 16 bits" "$tmp/b1" \
   && grep -q "^precision: AMP_BF16 | 0 skipped steps" "$tmp/b1"; then ok "AMP_BF16 reported in the header and summary"
else bad "AMP_BF16 report" "$(grep precision "$tmp/b1")"; fi
# the 16-bit window's pages count in every rank's RSS ([Note: 16-bit window], src/fsdp/unit.c): the
# summary says how much of the peak is shared memory; without the window less of it is
sh=(--model small --data synthetic --batch 4 --seq 32 --steps 1 --threads 1 --sample 0 --precision AMP_BF16 --nproc 2)
if timeout -k 5 300 "$TRAIN" "${sh[@]}" > "$tmp/sw" 2>&1 && FSDP_SHM_WINDOW=0 timeout -k 5 300 "$TRAIN" "${sh[@]}" > "$tmp/sc" 2>&1 \
   && msg=$(python3 - "$tmp/sw" "$tmp/sc" <<'EOF'
import re, sys
def shared(path):
    t = open(path).read()
    m = re.search(r"peak RSS (\d+) MB per rank(?:, of which (\d+) MB shared among the host's ranks)? \(", t)
    assert m, f"{path}: no peak RSS in the summary"
    return int(m.group(1)), int(m.group(2) or 0)
(pw, sw), (pc, sc) = shared(sys.argv[1]), shared(sys.argv[2])
params = float(re.search(r"([0-9.]+)M parameters", open(sys.argv[1]).read()).group(1)) * 1e6
assert sw >= int(2 * params / 2**20) and sw < pw, f"window: {sw} MB shared of {pw} MB, params {params:.0f}"
assert sc < sw, f"by copy: {sc} MB shared, window {sw} MB"
print(f"{sw} MB of {pw} MB shared with the window, {sc} MB by copy")
EOF
); then ok "summary: the shared part of the peak RSS ($msg)"
else bad "summary's shared RSS" "$msg $(grep -h summary "$tmp/sw" "$tmp/sc")"; fi
# the header says where the products ran; FSDP_GEMM_BF16=widen forces the fp32 path
if grep -qE "; BF16 products (on the CPU's native kernels|widened to fp32 \(no native kernels here\))$" "$tmp/b1" \
   && FSDP_GEMM_BF16=widen "$TRAIN" "${common[@]}" --steps 1 --precision AMP_BF16 > "$tmp/w" 2>&1 \
   && grep -q "; BF16 products widened to fp32 (no native kernels here)$" "$tmp/w"; then
  ok "AMP_BF16 header names the products' path"
else bad "AMP_BF16 products' path" "$(grep -h '^precision' "$tmp/b1" "$tmp/w")"; fi
# [Note: vector paths at run time] (src/core/cpu.c): an AVX2 machine's configuration here, oneDNN
# and the library's own vector code both capped at AVX2, trains AMP_BF16 as oneDNN alone capped
# does (the library's code at the CPU's best level): the same conversions' bits, the softmax rows'
# sums in another lane order (4e-7 relative at most), so losses and norms to 1e-5 relative; the
# capped run's verbose log names the level its own paths ran at
isa=(--steps 3 --precision AMP_BF16 --nproc 2)
if ONEDNN_MAX_CPU_ISA=AVX2 FSDP_MAX_CPU_ISA=avx2 timeout -k 5 300 "$TRAIN" "${common[@]}" "${isa[@]}" \
     --log "$tmp/i2.jsonl" --verbose > "$tmp/i2" 2>&1 \
   && grep -qE "fsdp: the library's vector paths: avx2( |$)" "$tmp/i2" \
   && ONEDNN_MAX_CPU_ISA=AVX2 timeout -k 5 300 "$TRAIN" "${common[@]}" "${isa[@]}" --log "$tmp/ia.jsonl" > "$tmp/ia" 2>&1 \
   && msg=$(python3 - "$tmp/i2.jsonl" "$tmp/ia.jsonl" <<'EOF'
import json, sys
a, b = ([(r["loss"], r["grad_norm"]) for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:])
assert len(a) == len(b) == 3, f"{len(a)} vs {len(b)} steps"
for (la, na), (lb, nb) in zip(a, b):
    assert abs(la - lb) <= 1e-5 * abs(lb) and abs(na - nb) <= 1e-5 * abs(nb), f"avx2 {a} vs the CPU's level {b}"
EOF
); then ok "AMP_BF16 at FSDP_MAX_CPU_ISA=avx2: the losses and norms of the CPU's level"
else bad "FSDP_MAX_CPU_ISA=avx2" "$msg" "$(tail -3 "$tmp/i2")"; fi
# [Note: bf16 kernels] (src/nn/gemm_lp.c): where oneDNN only emulates bf16 (an AVX-512 CPU without
# BF16, here by capping oneDNN's ISA) the products are widened, unless FSDP_GEMM_BF16=matmul asks
# for oneDNN's bf16 matmul anyway (AVX2 has none: widened either way)
emul=widened; grep -qw avx512f /proc/cpuinfo && emul=native
if ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI "$TRAIN" "${common[@]}" --steps 1 --precision AMP_BF16 > "$tmp/e1" 2>&1 \
   && grep -q "; BF16 products widened to fp32 (no native kernels here)$" "$tmp/e1" \
   && ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI FSDP_GEMM_BF16=matmul "$TRAIN" "${common[@]}" --steps 1 \
        --precision AMP_BF16 > "$tmp/e2" 2>&1 \
   && if [ $emul = native ]; then grep -q "; BF16 products on the CPU's native kernels$" "$tmp/e2"
      else grep -q "; BF16 products widened to fp32 (no native kernels here)$" "$tmp/e2"; fi; then
  ok "emulated bf16 widened, FSDP_GEMM_BF16=matmul $emul"
else bad "emulated bf16" "$(grep -h '^precision' "$tmp/e1" "$tmp/e2")" "$(tail -2 "$tmp/e2")"; fi
# where bf16 is native, FSDP_GEMM_BF16=gemm runs every 2-D bf16 product on oneDNN's gemm-based matmul
# and =matmul on its first one (oneDNN's verbose lines name the implementation of each product)
impl2d() { DNNL_VERBOSE=1 FSDP_GEMM_BF16=$1 "$TRAIN" "${common[@]}" --steps 1 --precision AMP_BF16 2>&1 \
  | grep "exec,cpu,matmul" | grep src_bf16 | awk -F, '{split($(NF-1), d, ":"); if (split(d[1], e, "x") == 2) print $5}' \
  | sort | uniq -c; }
if grep -q "; BF16 products on the CPU's native kernels$" "$tmp/b1"; then
  g=$(impl2d gemm); m=$(impl2d matmul)
  if [ -n "$g" ] && [ "$(echo "$g" | grep -vc 'gemm:jit$')" = 0 ] && [ -n "$m" ] && ! echo "$m" | grep -q 'gemm:jit$'; then
    ok "FSDP_GEMM_BF16=gemm and =matmul pick oneDNN's implementations"
  else bad "FSDP_GEMM_BF16 implementations" "gemm: $g" "matmul: $m"; fi
else echo "skip: FSDP_GEMM_BF16's implementations (no native bf16 kernels here)"; fi

# ---- the verbose plan names each unit's precision ----
if "$TRAIN" "${common[@]}" --steps 1 --verbose --precision AMP_BF16 --mixed-precision PURE > "$tmp/v" 2>&1 \
   && grep -q "unit 1 'transformer.h.0' (Block): .* precision PURE (param BF16, reduce BF16, compute BF16)" "$tmp/v"; then
  ok "verbose plan prints each unit's precision"
else bad "verbose plan precision" "$(grep "unit 1" "$tmp/v")"; fi

# ---- AMP_FP16: an injected overflow on rank 1 skips step 3 on both ranks ----
if FSDP_INJECT_OVERFLOW_STEP=2 FSDP_INJECT_OVERFLOW_RANK=1 timeout -k 5 300 "$TRAIN" "${common[@]}" --precision AMP_FP16 \
     --loss-scale-init 1024 --nproc 2 --log "$tmp/h.jsonl" > "$tmp/h" 2>&1; then
  if msg=$(python3 - "$tmp/h.jsonl" <<'EOF'
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
skipped = [x["step"] for x in a if x["skipped"]]
assert skipped == [3], f"skipped steps {skipped}"
scales = [x["loss_scale"] for x in a]
assert scales == [1024, 1024, 1024, 512, 512, 512], f"scales {scales}"
assert a[2]["grad_norm"] is None and a[2]["param_norm"] == a[1]["param_norm"], a[2]
assert a[-1]["skipped_total"] == 1
EOF
  ) && grep -q "SKIPPED (overflow" "$tmp/h" && grep -q "^precision: AMP_FP16 | 1 skipped steps | loss scale 512" "$tmp/h"; then
    ok "AMP_FP16 injected overflow: step 3 skipped, scale 1024 -> 512, logged and summarised"
  else bad "AMP_FP16 overflow" "$msg" "$(grep -E "SKIPPED|^precision" "$tmp/h")"; fi
else bad "AMP_FP16 overflow run" "$(tail -5 "$tmp/h")"; fi

# ---- usage errors name the flag ----
check_usage() { # NAME EXPECTED FLAGS...
  local name=$1 want=$2; shift 2
  "$TRAIN" "$@" > "$tmp/u" 2>&1
  local rc=$?
  if [ $rc -eq 2 ] && grep -qF -- "$want" "$tmp/u"; then ok "$name"; else bad "$name" "exit $rc" "$(head -3 "$tmp/u")"; fi
}
check_usage "--precision bf16 is a usage error" "--precision: 'bf16' is not FP32, AMP_BF16 or AMP_FP16" --precision bf16
check_usage "--mixed-precision HALF is a usage error" "--mixed-precision: 'HALF' is not FULL, DEFAULT or PURE" --mixed-precision HALF
check_usage "--loss-scale-growth-interval 0 is a usage error" "--loss-scale-growth-interval: '0' is not an integer" --loss-scale-growth-interval 0
finish
