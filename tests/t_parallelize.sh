#!/usr/bin/env bash
# t_parallelize.sh - end-to-end checks of the preparation API: the two
# examples (a user-defined module type with a custom wrap policy; VISSL's
# SwAV prototypes under summon_full_params) at 1, 2 and 3 ranks, whose losses
# must agree with the 1-rank run; the activation-checkpointing benchmark on
# a small 12-layer model (memory at least halved, gradients bit-identical);
# fsdp-train's --wrap / --ac / --reshard-after-forward / --init flags against
# the 1-rank oracle, and their usage errors.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

# same_losses A B [TOL]: the "step N loss X" lines of two outputs agree to TOL (relative, default 1e-5)
same_losses() {
  python3 - "$1" "$2" "${3:-1e-5}" <<'EOF'
import re, sys
def losses(p):
    return [float(m.group(1)) for m in re.finditer(r"^step \d+ loss ([0-9.]+)", open(p).read(), re.M)]
a, b = losses(sys.argv[1]), losses(sys.argv[2])
if not a or len(a) != len(b):
    sys.exit(f"{len(a)} vs {len(b)} loss lines")
for i, (x, y) in enumerate(zip(a, b)):
    if abs(x - y) > float(sys.argv[3]) * abs(x):
        sys.exit(f"step {i}: {x} vs {y}")
EOF
}

# ---- examples ----
for ex in custom_module vissl_swav; do
  # vissl_swav's trunk multiplies in bf16 (fsdp_gemm in its module's compute dtype): at 3 ranks
  # the loss gradient divided by 3 rounds to other bf16 values (measured 1.1e-5 at step 2)
  tol=1e-5; [ $ex = vissl_swav ] && tol=1e-4
  for n in 1 2 3; do
    if timeout -k 5 120 mpirun -np $n --oversubscribe "$BUILD/examples/$ex" > "$tmp/$ex.$n" 2>&1 \
       && grep -q "^$ex: OK (world $n)" "$tmp/$ex.$n"; then
      if [ $n -eq 1 ]; then ok "$ex at 1 rank"
      elif msg=$(same_losses "$tmp/$ex.1" "$tmp/$ex.$n" $tol 2>&1); then ok "$ex at $n ranks reproduces the 1-rank losses"
      else bad "$ex at $n ranks" "$msg"; fi
    else
      bad "$ex at $n ranks" "$(tail -5 "$tmp/$ex.$n")"
    fi
  done
done
if grep -q "summon inside forward: operation not valid" "$tmp/custom_module.2"; then
  ok "summon_full_params inside a forward is refused"
else bad "summon_full_params inside a forward" "$(grep summon "$tmp/custom_module.2")"; fi
if grep -q "'heads.prototypes0' (ToyLinear)" "$tmp/vissl_swav.2" && grep -q "    unit 3 'heads.prototypes0'" "$tmp/vissl_swav.2"; then
  ok "verbose prints prototypes as units nested in the head's unit"
else bad "vissl plan" "$(grep unit "$tmp/vissl_swav.2" | head -8)"; fi

# ---- activation checkpointing: memory at least halved, same gradients ----
if timeout -k 5 120 "$BUILD/bench/ac_memory" 12 64 2 32 > "$tmp/ac" 2>&1; then
  ok "ac_memory (12 layers): $(grep 'ac blocks' "$tmp/ac" | awk '{print $5, "of the activation memory"}')"
else bad "ac_memory" "$(cat "$tmp/ac")"; fi

# ---- fsdp-train flags: the 1-rank run is the oracle ----
common=(--model tiny --data synthetic --batch 12 --seq 32 --steps 6 --lr 3e-3 --warmup 2 --threads 1 --sample 0)
"$TRAIN" "${common[@]}" --log "$tmp/t1.jsonl" > "$tmp/t1" 2>&1 || bad "trainer 1-rank run" "$(tail -5 "$tmp/t1")"
run_flags() { # NAME NPROC FLAGS...
  local name=$1 n=$2; shift 2
  if ! timeout -k 5 300 "$TRAIN" "${common[@]}" --nproc "$n" "$@" --log "$tmp/f.jsonl" > "$tmp/f" 2>&1; then
    bad "$name" "$(tail -5 "$tmp/f")"; return
  fi
  if msg=$(python3 - "$tmp/t1.jsonl" "$tmp/f.jsonl" <<'EOF'
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert len(a) == len(b), f"{len(a)} vs {len(b)} steps"
for x, y in zip(a, b):
    for k in ("loss", "grad_norm"):
        if abs(x[k] - y[k]) > 1e-5 * abs(x[k]):
            sys.exit(f"step {x['step']}: {k} {x[k]} vs {y[k]}")
EOF
  ); then ok "$name reproduces the 1-rank run"; else bad "$name" "$msg"; fi
}
run_flags "--wrap size:4000 --ac blocks --nproc 2" 2 --wrap size:4000 --ac blocks
run_flags "--wrap none --ac every:2 --reshard-after-forward off --nproc 3" 3 --wrap none --ac every:2 --reshard-after-forward off
run_flags "--ac attn --nproc 2" 2 --ac attn
# --ac attn recomputes the attention in backward: the same bits as without, in bf16 too (its
# saved input is then ln_1's 16-bit output), and fewer activations planned for GPT-2 at 4 x 1024
if "$TRAIN" "${common[@]}" --precision AMP_BF16 --log "$tmp/b0.jsonl" > "$tmp/b0" 2>&1 \
   && "$TRAIN" "${common[@]}" --precision AMP_BF16 --ac attn --log "$tmp/b1.jsonl" > "$tmp/b1" 2>&1 \
   && [ "$(grep -c '"step"' "$tmp/b1.jsonl")" -eq 6 ] && same_bits "$tmp/b0.jsonl" "$tmp/b1.jsonl"; then
  ok "--ac attn in AMP_BF16: the same bits as without"
else bad "--ac attn in AMP_BF16" "$(tail -3 "$tmp/b1")"; fi
act() { "$TRAIN" --model gpt2 --batch 4 --seq 1024 --dry-run "$@" 2>&1 | awk '$1 == "0" {print $10}'; }
a0=$(act --ac none); a1=$(act --ac attn)
if [ -n "$a0" ] && [ -n "$a1" ] && awk -v a="$a0" -v b="$a1" 'BEGIN {exit !(b < 0.6 * a)}'; then
  ok "--ac attn plans $a1 MiB of GPT-2 activations at 4 x 1024 tokens, $a0 without"
else bad "--ac attn plan" "none: '$a0' attn: '$a1'"; fi
if "$TRAIN" "${common[@]}" --steps 1 --verbose --wrap size:4000 --ac every:2 > "$tmp/v" 2>&1 \
   && grep -q "unit 2 'transformer.h.0.attn' (CausalSelfAttention)" "$tmp/v" \
   && grep -q "activation checkpointing: transformer.h.0$" "$tmp/v"; then
  ok "--verbose prints the unit plan"
else bad "--verbose plan" "$(grep -E 'unit|activation' "$tmp/v" | head -10)"; fi

# ---- --init rank0: rank 0 reads --init-from and sends it unit by unit ----
if "$TRAIN" "${common[@]}" --steps 2 --save-dir "$tmp/ck" > "$tmp/s" 2>&1 \
   && "$BUILD/fsdp-ckpt" to-full "$tmp/ck/step-00000002" "$tmp/w.safetensors" > "$tmp/s" 2>&1; then
  "$TRAIN" "${common[@]}" --init-from "$tmp/w.safetensors" --log "$tmp/t1.jsonl" > "$tmp/t1" 2>&1 \
    || bad "--init-from at 1 rank" "$(tail -3 "$tmp/t1")"
  run_flags "--init rank0 --init-from FILE --nproc 3" 3 --init rank0 --init-from "$tmp/w.safetensors"
  if timeout -k 5 60 "$TRAIN" "${common[@]}" --nproc 2 --init rank0 --init-from "$tmp/none.safetensors" > "$tmp/e" 2>&1; then
    bad "--init rank0 with a missing file" "exit 0"
  elif grep -q "none.safetensors" "$tmp/e"; then ok "--init rank0 with a missing file names it"
  else bad "--init rank0 with a missing file" "$(head -3 "$tmp/e")"; fi
else
  bad "making a safetensors file for --init-from" "$(tail -3 "$tmp/s")"
fi

# ---- usage errors (exit 2, one clear line) ----
usage_err() { # NAME PATTERN ARGS...
  local name=$1 pat=$2; shift 2
  timeout -k 5 30 "$TRAIN" "$@" > "$tmp/u" 2>&1
  local rc=$?
  if [ $rc -eq 2 ] && grep -qE -- "$pat" "$tmp/u"; then ok "$name"
  else bad "$name" "exit $rc" "$(head -3 "$tmp/u")"; fi
}
usage_err "--wrap bogus" "--wrap: 'bogus' is not block, size:N or none" --wrap bogus
usage_err "--wrap size:0" "--wrap: '0' is not an integer" --wrap size:0
usage_err "--ac every:x" "--ac: 'x' is not an integer" --ac every:x
usage_err "--reshard-after-forward maybe" "is not on or off" --reshard-after-forward maybe
usage_err "--init rank0 without --init-from" "--init rank0 needs --init-from" --init rank0
usage_err "--init bogus" "--init: 'bogus' is not deferred or rank0" --init bogus

finish
