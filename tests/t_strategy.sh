#!/usr/bin/env bash
# t_strategy.sh - fsdp-train's --sharding, --shard-group, --grad-accum,
# --accum-mode, --overlap and --max-inflight end to end: every strategy
# reproduces the 1-rank losses and gradient norms (1e-5), hybrid with a
# shard group of 2 on 4 ranks likewise (overlap on and off, the same bits);
# K micro-batches give the losses of the whole batch; overlap on and off
# give the same bits; a checkpoint saved
# under HYBRID_SHARD resumes under NO_SHARD at another world size; the JSON
# log carries the exposed communication time; bad values name their flag.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

run() { # run NAME NPROC FLAGS...: a short tiny-model run logging JSON to $tmp/NAME.json
  local name=$1 n=$2; shift 2
  timeout -k 5 180 "$TRAIN" --model tiny --steps 3 --batch 12 --seq 32 --threads 1 --sample 0 "${PEAK[@]}" --nproc "$n" \
    --log "$tmp/$name.json" "$@" > "$tmp/$name.out" 2>&1
}

# same NAME_A NAME_B TOL [common]: both logs have the same steps (with "common": the steps
# they share, at least one), and loss and grad_norm of each agree to TOL (relative)
same() {
  python3 - "$tmp/$1.json" "$tmp/$2.json" "$3" "${4:-all}" <<'EOF'
import json, sys
def rows(p):
    return {r["step"]: r for r in map(json.loads, open(p)) if "step" in r}
a, b, tol = rows(sys.argv[1]), rows(sys.argv[2]), float(sys.argv[3])
common = sorted(set(a) & set(b))
if not common:
    sys.exit("no common steps")
if sys.argv[4] != "common" and set(a) != set(b):
    sys.exit(f"logged steps differ: {sorted(a)} vs {sorted(b)}")
for s in common:
    for k in ("loss", "grad_norm"):
        x, y = a[s][k], b[s][k]
        if not abs(x - y) <= tol * abs(y):
            sys.exit(f"step {s} {k}: {x} vs {y}")
EOF
}

# bits NAME_A NAME_B: the runs' logs print the same bits (lib.sh)
bits() { same_bits "$tmp/$1.json" "$tmp/$2.json"; }

if run ref 1; then ok "1-rank reference"; else bad "1-rank reference" "$(tail -5 "$tmp/ref.out")"; fi

# ---- every strategy reproduces the 1-rank run ----
# (a strategy's two runs at once, as the pairs below)
for s in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD; do
  for n in 2 3; do spawn "$s.$n" run "$s.$n" $n --sharding $s; done
  for n in 2 3; do
    if reap "$s.$n" && msg=$(same "$s.$n" ref 1e-5 2>&1); then ok "$s at $n ranks"
    else bad "$s at $n ranks" "${msg:-}" "$(tail -3 "$tmp/$s.$n.out")"; fi
  done
done
spawn hyb4 run hyb4 4 --sharding HYBRID_SHARD --shard-group 2
spawn hyb4.off run hyb4.off 4 --sharding HYBRID_SHARD --shard-group 2 --overlap off
if reap hyb4 && msg=$(same hyb4 ref 1e-5 2>&1) \
   && grep -q "sharding: HYBRID_SHARD (groups of 2 ranks, 2 replicas)" "$tmp/hyb4.out"; then
  ok "HYBRID_SHARD --shard-group 2 at 4 ranks"
else bad "HYBRID_SHARD --shard-group 2 at 4 ranks" "${msg:-}" "$(tail -3 "$tmp/hyb4.out")"; fi
# the replica all-reduces pipelined (overlap, the default) or waited at once
if reap hyb4.off && bits hyb4 hyb4.off \
   && msg=$(same hyb4.off ref 1e-5 2>&1); then
  ok "HYBRID_SHARD --shard-group 2 at 4 ranks: --overlap off gives the same bits"
else bad "HYBRID_SHARD --shard-group 2 --overlap off" "${msg:-}" "$(tail -3 "$tmp/hyb4.off.out")"; fi

# ---- gradient accumulation: the losses of the whole batch ----
# rs_times NAME BASE: each step's reduce-scatter bytes in NAME's log over BASE's
rs_times() {
  python3 - "$tmp/$1.json" "$tmp/$2.json" <<'EOF'
import json, sys
def rs(p):
    return [r["comm"]["reduce_scatter"]["bytes"] for r in map(json.loads, open(p)) if "step" in r]
a, b = rs(sys.argv[1]), rs(sys.argv[2])
assert a and b and b[0] > 0 and len(set(a)) == 1, (a, b)
print(a[0] / b[0])
EOF
}
for m in reduce no_sync; do spawn "acc.$m" run "acc.$m" 2 --grad-accum 2 --accum-mode $m; done
for m in reduce no_sync; do
  want=$([ $m = reduce ] && echo 2.0 || echo 1.0) # a reduction per micro-batch, or one per step
  if reap "acc.$m" && msg=$(same "acc.$m" ref 1e-5 2>&1) \
     && grep -q "2 micro-batches of 3 x 32 tokens per rank per step ($m)" "$tmp/acc.$m.out" \
     && times=$(rs_times "acc.$m" FULL_SHARD.2) && [ "$times" = "$want" ]; then
    ok "--grad-accum 2 --accum-mode $m (the reduce-scatters' bytes $want x a step's)"
  else bad "--grad-accum 2 --accum-mode $m" "${msg:-}" "reduce-scatter bytes ${times:-?} x, want $want" \
    "$(tail -3 "$tmp/acc.$m.out")"; fi
done

# ---- overlap: bit-identical, exposed communication logged ----
if run ov.on 2 --overlap on --max-inflight 3 && run ov.off 2 --overlap off && bits ov.on ov.off; then
  ok "--overlap on and off give the same bits"
else bad "--overlap on and off" "$(tail -3 "$tmp/ov.on.out")" "$(tail -3 "$tmp/ov.off.out")"; fi
# every step's exposed wait lies within its communication time, which 2 ranks have
if python3 - "$tmp/ov.on.json" <<'EOF' && grep -q "exposed comm .* ms/step" "$tmp/ov.on.out"; then
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
assert rows and all(0 <= r["exposed_comm_ms"] <= r["comm_ms"] and r["comm_ms"] > 0 for r in rows), rows
EOF
  ok "exposed communication in the JSON log and the summary"
else bad "exposed communication" "$(head -c 400 "$tmp/ov.on.json")"; fi

# ---- the shards' 16-bit copy: the same bits, 2 bytes a parameter more in the plan ----
spawn lp.on run lp.on 2 --precision AMP_BF16 --lp-shard-copy on
spawn lp.off run lp.off 2 --precision AMP_BF16
reap lp.on; r_on=$?
reap lp.off; r_off=$?
if [ $r_on -eq 0 ] && [ $r_off -eq 0 ] && bits lp.on lp.off; then
  ok "AMP_BF16 with --lp-shard-copy on and off gives the same bits"
else bad "--lp-shard-copy on and off" "$(tail -3 "$tmp/lp.on.out")" "$(tail -3 "$tmp/lp.off.out")"; fi
params() { # the plan's params column (MiB) of rank 0 for fsdp-train's dry run with these flags
  "$TRAIN" --model gpt2 --batch 1 --seq 64 --dry-run --precision AMP_BF16 "$@" 2>&1 | awk '$1 == "0" { print $2; exit }'
}
p_on=$(params --lp-shard-copy on); p_off=$(params); p32=$("$TRAIN" --model gpt2 --batch 1 --seq 64 --dry-run 2>&1 | awk '$1 == "0" { print $2; exit }')
if [ -n "$p_off" ] && [ "$p_off" = "$p32" ] && python3 -c "import sys; sys.exit(not abs($p_on - 1.5 * $p_off) < 0.2)"; then
  ok "--dry-run: no 16-bit shard copy by default, 2 bytes of every 4 more with --lp-shard-copy on"
else bad "--lp-shard-copy in the plan" "on '$p_on' off '$p_off' fp32 '$p32'"; fi
"$TRAIN" --model tiny --lp-shard-copy yes > "$tmp/e0" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q "^fsdp-train: --lp-shard-copy: 'yes' is not on or off" "$tmp/e0"; then ok "bad --lp-shard-copy"
else bad "bad --lp-shard-copy (exit $rc)" "$(cat "$tmp/e0")"; fi

# ---- checkpoint: HYBRID_SHARD save, NO_SHARD resume at another world size ----
# (the 4-step run saves at step 2 on its way, the resume's start)
ck="$tmp/ck"
if run ck.full 4 --sharding HYBRID_SHARD --shard-group 2 --steps 4 --save-dir "$ck" --save-every 2 --lr-schedule constant \
   && run ck.resume 2 --sharding NO_SHARD --steps 4 --override steps --resume "$ck/step-00000002" --lr-schedule constant \
   && [ "$(ls "$ck"/step-00000002 | grep -c '\.safetensors$')" = 2 ] \
   && msg=$(same ck.resume ck.full 1e-5 common 2>&1); then
  ok "HYBRID_SHARD checkpoint (2 shard files) resumes under NO_SHARD at 2 ranks"
else bad "hybrid checkpoint resume" "${msg:-}" "$(ls "$ck"/* 2>&1 | head -5)" "$(tail -3 "$tmp/ck.resume.out")"; fi

# ---- errors name the flag ----
# (the three runs of several ranks at once: they spend their time waiting on the launcher)
spawn e2 run e2 4 --sharding HYBRID_SHARD --shard-group 3
spawn e3 run e3 2 --shard-group 2
spawn e4 run e4 2 --grad-accum 4
"$TRAIN" --model tiny --sharding ZERO3 > "$tmp/e1" 2>&1; rc=$?
if [ $rc -eq 2 ] && grep -q "^fsdp-train: --sharding: 'ZERO3' is not FULL_SHARD" "$tmp/e1"; then ok "bad --sharding"
else bad "bad --sharding (exit $rc)" "$(cat "$tmp/e1")"; fi
reap e2; rc=$?
if [ $rc -ne 0 ] && grep -q "error: --shard-group 3 does not divide the world of 4 ranks" "$tmp/e2.out"; then
  ok "--shard-group not dividing the world"
else bad "--shard-group 3 at 4 ranks (exit $rc)" "$(head -3 "$tmp/e2.out")"; fi
reap e3; rc=$?
if [ $rc -ne 0 ] && grep -q "error: --shard-group 2 needs --sharding HYBRID_SHARD" "$tmp/e3.out"; then
  ok "--shard-group without HYBRID_SHARD"
else bad "--shard-group without HYBRID_SHARD (exit $rc)" "$(head -3 "$tmp/e3.out")"; fi
reap e4; rc=$?
if [ $rc -ne 0 ] && grep -q "error: --grad-accum 4 does not divide the per-rank batch of 6" "$tmp/e4.out"; then
  ok "--grad-accum not dividing the batch"
else bad "--grad-accum 4 (exit $rc)" "$(head -3 "$tmp/e4.out")"; fi

# ---- the planner knows the strategy ----
if "$TRAIN" --model tiny --dry-run --nproc 4 --sharding NO_SHARD --grad-accum 2 --accum-mode no_sync \
     --batch 8 > "$tmp/plan" 2>&1 && grep -q "memory plan: NO_SHARD, world 4" "$tmp/plan" \
   && grep -q "in 2 micro-batches of 1 (--accum-mode no_sync)" "$tmp/plan"; then
  ok "--dry-run plans the strategy and the micro-batches"
else bad "--dry-run" "$(head -3 "$tmp/plan")"; fi
# a plan of --nproc ranks checks the flags against that world, not the one process it runs in
if "$TRAIN" --model tiny --dry-run --nproc 4 --sharding HYBRID_SHARD --shard-group 2 --batch 8 > "$tmp/plan.h" 2>&1 \
   && grep -q "memory plan: HYBRID_SHARD, world 4" "$tmp/plan.h"; then
  ok "--dry-run --nproc 4 plans HYBRID_SHARD --shard-group 2"
else bad "--dry-run --nproc 4 HYBRID_SHARD --shard-group 2" "$(head -3 "$tmp/plan.h")"; fi
"$TRAIN" --model tiny --dry-run --nproc 4 --sharding HYBRID_SHARD --shard-group 3 --batch 8 > "$tmp/plan.e" 2>&1; rc=$?
if [ $rc -ne 0 ] && grep -q "error: --shard-group 3 does not divide the world of 4 ranks" "$tmp/plan.e"; then
  ok "--dry-run --nproc 4: --shard-group 3 named against the planned world"
else bad "--dry-run --nproc 4 --shard-group 3 (exit $rc)" "$(head -3 "$tmp/plan.e")"; fi

finish
