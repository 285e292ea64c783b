#!/usr/bin/env bash
# t_trainer_mfu_ckpt.sh - fsdp-train's MFU and its checkpoint kinds: "mfu" in
# the log is the model's FLOP/s over the peak (--peak-gflops per rank x world,
# or the GEMM probe's), and the summary says which; --state-dict-type full
# saves one safetensors file per checkpoint (pruned by --keep-last, a foreign
# file kept) that loads as the sharded one's weights do; --init rank0
# (load_monolith_rank0_only) has rank 0 alone open --init-from: under
# mpirun's MPMD form the other rank names a file that does not exist.
# Prints "N passed, N failed".
. "$(dirname "$0")/lib.sh"
CKPT="$BUILD/fsdp-ckpt"
common=(--model tiny --data synthetic --batch 8 --seq 32 --lr 3e-3 --warmup 2 --threads 1 --sample 0)

# ---- bench/step_limit: every product of the step counted once ----
# (its tiny mode: rates are not checked, only that the product classes add
# up to the model's FLOPs, with one more q k^T per layer under AMP_BF16 and
# the same total when 4 ranks split the batch)
if timeout -k 5 120 "$BUILD/bench/step_limit" tiny 4 32 2 4 0.002 > "$tmp/limit" 2>&1 && msg=$(python3 - "$tmp/limit" <<'PY'
import math, sys
L, C, V, T, B, nh = 2, 32, 256, 32, 4, 2  # the tiny preset at --batch 4 --seq 32
model = (6 * (L * 12 * C * C + C * V) + 12 * L * T * C) * B * T
recompute = 2 * T * T * (C // nh) * B * nh * L  # the 16-bit path's second q k^T
want = {"fp32_1x2": model, "fp32_4x1": model, "bf16_1x2": model + recompute, "bf16_4x1": model + recompute}
got, lim = {}, {}
for line in open(sys.argv[1]):
    f = line.split()
    if f[:1] == ["product_flops"]: got[f[1]] = float(f[2])
    if f[:1] == ["limit"] and len(f) > 3 and "_" in f[1]: lim[f[1]] = float(f[2])
assert got == want, f"product FLOPs {got}, want {want}"
assert set(lim) == set(want) and all(math.isfinite(x) and x > 0 for x in lim.values()), f"limits {lim}"
print(len(got))
PY
); then
  ok "bench/step_limit (tiny): the product classes add up to the model FLOPs in all $msg configurations"
else bad "bench/step_limit (tiny)" "$msg" "$(tail -3 "$tmp/limit")"; fi

# ---- MFU ----
for n in 1 2; do
  if timeout -k 5 300 "$TRAIN" "${common[@]}" --steps 4 --nproc $n --peak-gflops 10 --log "$tmp/m$n.jsonl" > "$tmp/o" 2>&1 \
     && msg=$(python3 - "$tmp/m$n.jsonl" $n <<'PY'
import json, sys
rows, world = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r], int(sys.argv[2])
L, C, V, T = 2, 32, 256, 32  # the tiny preset, --seq 32
flops = 3 * (2 * (L * 12 * C * C + C * V) + 4 * L * T * C)  # 6 N_matmul + 12 L T C per token
for r in rows:
    want = r["tokens_per_s"] * flops / (10e9 * world)
    assert abs(r["mfu"] - want) <= 1e-3 * want, f"step {r['step']}: mfu {r['mfu']} but {want}"
    assert r["tokens"] == r["step"] * 8 * 32, f"step {r['step']}: tokens {r['tokens']}"
print(len(rows))
PY
     ) && grep -qE "GFLOP/s model = [0-9.]+% MFU of $((10 * n)).0 GFLOP/s \(--peak-gflops 10 per rank, $n rank" "$tmp/o"; then
    ok "$n rank(s): mfu = tokens/s x (6 N + 12 L T C) / (--peak-gflops x world) at each of $msg steps, in the summary too"
  else bad "$n rank(s): mfu from --peak-gflops" "$msg" "$(grep summary "$tmp/o")" "$(tail -2 "$tmp/o")"; fi
done
for p in FP32 AMP_BF16; do
  if "$TRAIN" "${common[@]}" --steps 3 --precision $p --log "$tmp/p.jsonl" > "$tmp/o" 2>&1 \
     && grep -qE "MFU of [0-9.]+ GFLOP/s \(GEMM probe $( [ $p = FP32 ] && echo fp32 || echo bf16)" "$tmp/o" \
     && python3 -c 'import json,sys; assert all(r["mfu"] > 0 for r in map(json.loads, open(sys.argv[1])) if "step" in r)' "$tmp/p.jsonl"; then
    ok "$p: the GEMM probe in the run's precision gives the peak ($(grep -o 'MFU peak: .*' "$tmp/o"))"
  else bad "$p: the GEMM probe gives the peak" "$(grep -E 'MFU|summary' "$tmp/o")"; fi
done
if "$TRAIN" --model cnn --data fashion-mnist --batch 16 --steps 2 --threads 1 --peak-gflops 5 --log "$tmp/c.jsonl" > "$tmp/o" 2>&1 \
   && grep -q "MFU of 5.0 GFLOP/s" "$tmp/o" && grep -q '"mfu"' "$tmp/c.jsonl"; then
  ok "the small CNN counts its FLOPs: mfu in its log and summary"
elif [ ! -e /usr/share/datasets/fashion-mnist ]; then echo "skip: the CNN's mfu: no Fashion-MNIST"
else bad "the small CNN's mfu" "$(grep -E 'summary|error' "$tmp/o")"; fi
"$TRAIN" --peak-gflops -1 > /dev/null 2> "$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q -- "--peak-gflops" "$tmp/err" && ok "--peak-gflops -1 is a usage error" || bad "--peak-gflops -1" "exit $rc"

# ---- --state-dict-type full ----
if "$TRAIN" "${common[@]}" --steps 4 --save-dir "$tmp/full" --save-every 2 --state-dict-type full > "$tmp/o" 2>&1 \
   && [ -f "$tmp/full/step-00000002.safetensors" ] && [ -f "$tmp/full/step-00000004.safetensors" ] \
   && [ -z "$(find "$tmp/full" -mindepth 1 -type d)" ] && "$CKPT" verify "$tmp/full/step-00000004.safetensors" > "$tmp/v" 2>&1; then
  ok "--state-dict-type full: --save-dir holds step-N.safetensors files (verified), no folders"
else bad "--state-dict-type full saves files" "$(ls -R "$tmp/full" 2>&1 | head -5)" "$(tail -3 "$tmp/o")"; fi
"$TRAIN" "${common[@]}" --steps 4 --save-dir "$tmp/sharded" > "$tmp/o" 2>&1 || bad "a sharded run" "$(tail -3 "$tmp/o")"
[ -f "$tmp/sharded/step-00000004/meta.json" ] && ok "--state-dict-type sharded (the default): the folder" || bad "the default is the sharded folder"
"$CKPT" to-full "$tmp/sharded/step-00000004" "$tmp/conv.safetensors" > /dev/null 2>&1
l1=$("$TRAIN" "${common[@]}" --steps 1 --init-from "$tmp/full/step-00000004.safetensors" --log "$tmp/i1.jsonl" > /dev/null 2>&1 && grep -m1 '"step"' "$tmp/i1.jsonl")
l2=$("$TRAIN" "${common[@]}" --steps 1 --init-from "$tmp/conv.safetensors" --log "$tmp/i2.jsonl" > /dev/null 2>&1 && grep -m1 '"step"' "$tmp/i2.jsonl")
if [ -n "$l1" ] && python3 -c 'import json,sys; a,b=(json.loads(x) for x in sys.argv[1:]); assert a["loss"]==b["loss"] and a["grad_norm"]==b["grad_norm"]' "$l1" "$l2"; then
  ok "the full checkpoint holds the weights the sharded one does (the same first step from either)"
else bad "full and sharded checkpoints hold the same weights" "$l1" "$l2"; fi
mkdir "$tmp/full2" && printf 'not a checkpoint\n' > "$tmp/full2/step-00000001.safetensors"
if "$TRAIN" "${common[@]}" --steps 6 --save-dir "$tmp/full2" --save-every 2 --keep-last 1 --state-dict-type full > "$tmp/o" 2>&1 \
   && [ "$(ls "$tmp/full2" | grep -c 'step-.*safetensors$')" -eq 2 ] && [ -f "$tmp/full2/step-00000006.safetensors" ] \
   && [ "$(cat "$tmp/full2/step-00000001.safetensors")" = "not a checkpoint" ]; then
  ok "--keep-last 1 prunes full files it wrote and leaves a foreign one of such a name alone"
else bad "--keep-last with full files" "$(ls "$tmp/full2")" "$(grep -i keep "$tmp/o")"; fi
# a fresh run into the folder of another's full files: refused before step 1, the files as they were
sum=$(cat "$tmp"/full/step-*.safetensors | md5sum)
"$TRAIN" "${common[@]}" --steps 6 --save-dir "$tmp/full" --save-every 2 --state-dict-type full > "$tmp/o" 2>&1
rc=$?
[ $rc -eq 1 ] && grep -q "holds $tmp/full/step-00000004.safetensors, a checkpoint after this run's start" "$tmp/o" &&
  ! grep -q "^step" "$tmp/o" && [ "$(cat "$tmp"/full/step-*.safetensors | md5sum)" = "$sum" ] &&
  ok "a fresh run does not save over another run's full files" || bad "fresh run over full files" "exit $rc" "$(grep error "$tmp/o")"
# --init-from a sharded folder takes its weights only: another optimizer starts from zero state
l3=$("$TRAIN" "${common[@]}" --steps 1 --optim sgd --init-from "$tmp/sharded/step-00000004" --log "$tmp/i3.jsonl" > "$tmp/o" 2>&1 && grep -m1 '"step"' "$tmp/i3.jsonl")
l4=$("$TRAIN" "${common[@]}" --steps 1 --optim sgd --init-from "$tmp/conv.safetensors" --log "$tmp/i4.jsonl" > /dev/null 2>&1 && grep -m1 '"step"' "$tmp/i4.jsonl")
if [ -n "$l3" ] && python3 -c 'import json,sys; a,b=(json.loads(x) for x in sys.argv[1:]); assert a["loss"]==b["loss"] and a["grad_norm"]==b["grad_norm"] and a["param_norm"]==b["param_norm"]' "$l3" "$l4"; then
  ok "--init-from an AdamW run's sharded folder with --optim sgd: its weights only, the same step as from the full file"
else bad "--init-from a sharded folder loads weights only" "$l3" "$l4" "$(tail -2 "$tmp/o")"; fi
"$TRAIN" --state-dict-type local > /dev/null 2> "$tmp/err"; rc=$?
[ $rc -eq 2 ] && grep -q "not sharded or full" "$tmp/err" && ok "--state-dict-type local is a usage error" || bad "--state-dict-type local" "exit $rc"

# ---- --init rank0: only rank 0 opens --init-from ----
mpmd() { # INIT FILE_OF_RANK_1: rank 0 reads the real file, rank 1 is given FILE_OF_RANK_1
  timeout -k 5 120 mpirun --oversubscribe --bind-to none \
    -np 1 "$TRAIN" "${common[@]}" --steps 2 --init "$1" --init-from "$tmp/conv.safetensors" --log "$tmp/mp.jsonl" : \
    -np 1 "$TRAIN" "${common[@]}" --steps 2 --init "$1" --init-from "$2" > "$tmp/o" 2>&1
}
# the reference: the same 2 ranks, each opening the file itself (a 1-rank run's loss is the
# mean of 256 rows, not of two ranks' means, and may differ from it in the last bit)
timeout -k 5 120 mpirun --oversubscribe --bind-to none -np 2 "$TRAIN" "${common[@]}" --steps 2 \
  --init-from "$tmp/conv.safetensors" --log "$tmp/ref2.jsonl" > /dev/null 2>&1 || bad "a 2-rank --init-from run"
if mpmd rank0 "$tmp/only-rank-0-has-it.safetensors" && grep -q "rank 0, sent unit by unit" "$tmp/o" \
   && python3 -c 'import json,sys; a,b=([r for r in map(json.loads, open(f)) if "step" in r][0] for f in sys.argv[1:]); assert a["loss"]==b["loss"] and a["grad_norm"]==b["grad_norm"]' "$tmp/mp.jsonl" "$tmp/ref2.jsonl"; then
  ok "--init rank0: rank 1 never opens --init-from (it names a missing file) and starts from rank 0's weights"
else bad "--init rank0: only rank 0 opens --init-from" "$(tail -3 "$tmp/o")"; fi
if ! mpmd deferred "$tmp/only-rank-0-has-it.safetensors" && grep -q "only-rank-0-has-it" "$tmp/o"; then
  ok "--init deferred: every rank opens --init-from (rank 1's missing file is an error naming it)"
else bad "--init deferred: every rank opens the file" "$(tail -3 "$tmp/o")"; fi
finish
