#!/usr/bin/env bash
# t_config.sh - fsdp-train's run configuration: --config FILE with the command
# line taking precedence; the resolved configuration printed, first in --log
# and in meta.json, and given back as --config it reruns the same run; bad
# config files are one line naming the file and the key (or the byte: one
# JSON value per file, --config and --model-config alike); --resume restores
# the schedule, optimizer and fp16 loss scale (AMP_FP16 resumes bit-exactly),
# refuses a flag that disagrees (naming both values) unless --override names
# it; a flag the run would not read (another task's, or one only another setting reads) is
# refused, on the command line and in --config away from its default. Prints "N passed, N failed".
. "$(dirname "$0")/lib.sh"
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none

cfgof() { python3 -c 'import json,sys; print(json.dumps(json.loads(open(sys.argv[1]).readline())["config"][sys.argv[2]]))' "$@"; }
# step, loss, grad and param norms and loss scale of the steps after $2, as the log printed them
steps_after() { python3 -c '
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "step" in r and r["step"] > int(sys.argv[2]):
        print(r["step"], r["loss"], r["grad_norm"], r["param_norm"], r["loss_scale"])' "$1" "$2"; }

# ---- precedence: the command line over the file over the defaults ----
cat > "$tmp/run.json" <<'EOF'
{"model": "tiny", "lr": 2e-3, "steps": 3, "warmup": 1, "seq": 32, "batch": 4, "sample": 0, "threads": 1,
 "lr_schedule": "constant", "decay-all": true, "beta2": 0.99}
EOF
if "$TRAIN" --config "$tmp/run.json" --steps 2 --beta2 0.9 --log "$tmp/p.jsonl" > "$tmp/p" 2>&1 &&
   [ "$(cfgof "$tmp/p.jsonl" lr)" = 0.002 ] && [ "$(cfgof "$tmp/p.jsonl" steps)" = 2 ] &&
   [ "$(cfgof "$tmp/p.jsonl" beta2)" = 0.9 ] && [ "$(cfgof "$tmp/p.jsonl" lr-schedule)" = '"constant"' ] &&
   [ "$(cfgof "$tmp/p.jsonl" decay-all)" = true ] && [ "$(cfgof "$tmp/p.jsonl" eps)" = 1e-08 ] &&
   [ "$(grep -c '"step"' "$tmp/p.jsonl")" = 2 ] && grep -q '"step": 2, "loss": [0-9.]*, "lr": 0.00200000009' "$tmp/p.jsonl"; then
  ok "--config: its values over the defaults, the command line's over its (lr 0.002 from the file, steps 2 and beta2 0.9 from the flags)"
else bad "--config precedence" "$(head -c 300 "$tmp/p.jsonl")" "$(tail -2 "$tmp/p")"; fi

# ---- the resolved configuration: printed, first in --log, in meta.json; given back, the same run ----
"$TRAIN" --config "$tmp/run.json" --nproc 2 --save-dir "$tmp/ck0" --log "$tmp/r0.jsonl" > "$tmp/r0" 2>&1 ||
  bad "run with --config" "$(tail -3 "$tmp/r0")"
config_again "$tmp/r0.jsonl" log="\"$tmp/r1.jsonl\"" save-dir=null nproc=2 > "$tmp/again.json"
if msg=$(python3 - "$tmp" <<'EOF' 2>&1
import json, sys
d = sys.argv[1]
first = json.loads(open(d + "/r0.jsonl").readline())["config"]
printed = json.loads([l for l in open(d + "/r0") if l.startswith("config: ")][0][8:])
meta = json.load(open(d + "/ck0/step-00000003/meta.json"))["train_config"]
assert first == printed == meta, "the log, the terminal and meta.json differ"
assert first["lr"] == 0.002 and abs(first["min-lr"] - 2e-4) < 1e-9 and first["model"] == "tiny" and first["steps"] == 3, first
EOF
) && "$TRAIN" --config "$tmp/again.json" > "$tmp/r1" 2>&1 && same_bits "$tmp/r0.jsonl" "$tmp/r1.jsonl"; then
  ok "the resolved configuration is the terminal's config line, --log's first line and meta.json's train_config; as --config it reruns the run bit for bit"
else bad "resolved configuration" "${msg:-}" "$(tail -2 "$tmp/r1")"; fi

# ---- every flag is a configuration key (a flag left out of the table is an unknown key to --config,
# missing from the logged configuration and lost by --resume) ----
"$TRAIN" --help > "$tmp/help" 2>&1
"$TRAIN" --model tiny --steps 1 --dry-run > "$tmp/dry" 2>&1
if msg=$(python3 - "$tmp/help" "$tmp/dry" <<'EOF' 2>&1
import json, re, sys
flags = set(re.findall(r"(?m)^  --([a-z0-9-]+)", open(sys.argv[1]).read())) - {"config", "help", "override"}
cfg = json.loads([l for l in open(sys.argv[2]) if l.startswith("config: ")][0][8:])
assert len(flags) > 60, f"only {len(flags)} flags read from --help"
missing = sorted(flags - set(cfg))
assert not missing, f"flags missing from the configuration: {missing}"
EOF
); then ok "every flag --help lists (but --config, --override, --help) is a key of the resolved configuration"
else bad "flags missing from the configuration" "$msg"; fi

# ---- bad config files: one line naming the file and the key ----
cfg_error() { # NAME JSON PATTERN
  printf '%s\n' "$2" > "$tmp/bad.json"
  timeout -k 5 60 "$TRAIN" --config "$tmp/bad.json" --steps 1 > "$tmp/out" 2> "$tmp/err"; local rc=$?
  if [ $rc = 2 ] && [ "$(grep -c "^fsdp-train" "$tmp/err")" = 1 ] && grep -qE -- "$3" "$tmp/err"; then ok "$1"
  else bad "$1" "exit $rc" "$(head -3 "$tmp/err")"; fi
}
cfg_error "an unknown key" '{"lr": 1e-3, "lrr": 2e-3}' "--config .*bad.json: unknown key \"lrr\""
cfg_error "a string for a number" '{"lr": "2e-3"}' "--config .*bad.json: key \"lr\": expected a number"
cfg_error "a fraction for a whole number" '{"steps": 2.5}' "--config .*bad.json: key \"steps\": expected a whole number"
cfg_error "a number for a switch" '{"decay-all": 1}' "--config .*bad.json: key \"decay-all\": expected true or false"
cfg_error "a value out of range" '{"lr": 50}' "--config .*bad.json: --lr: '50' is not a number in"
cfg_error "not a JSON object" '[1, 2]' "--config .*bad.json: not a JSON object"
cfg_error "a nested --config" '{"config": "x.json"}' "--config .*bad.json: key \"config\": not allowed"
# "task": "images" with no model key: a usage error naming the flags that give one (it crashed)
cfg_error "task images without a model" '{"task": "images", "threads": 1}' \
  "--task images needs --model cnn\|resnet18.*, --model-config FILE or --resume"
cfg_error "bytes after the object" '{"steps": 1} junk' "--config .*bad.json: bytes after the JSON value at byte 13"
cfg_error "a second object" '{"steps": 1}
{"lr": 1e-3}' "--config .*bad.json: bytes after the JSON value at byte 13 \(line 2"
cfg_error "a NUL escaped in a string (\"a\\u0000b\" was read as \"a\")" '{"data": "a\u0000b"}' \
  "--config .*bad.json: a NUL \(.u0000\) at byte 11"
# a NUL byte ends the text for cJSON: what follows it would go unread
printf '{"steps": 1}\n\0\1' > "$tmp/nul.json"
timeout -k 5 60 "$TRAIN" --config "$tmp/nul.json" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--config .*nul.json: a NUL byte at byte 13" "$tmp/err" && ok "--config: bytes after a NUL byte" ||
  bad "--config: bytes after a NUL byte" "exit $rc" "$(head -2 "$tmp/err")"
# --model-config, a GPT's or an image model's, reads the same way: refused before any data is read
printf '{"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "block_size": 64} {}' > "$tmp/g2.json"
printf '{"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "block_size": 64}\0' > "$tmp/gnul.json"
printf '{"arch": "cnn", "in_chans": 1, "num_classes": 10} junk' > "$tmp/ijunk.json"
for c in "g2.json:bytes after the JSON value at byte 79" "gnul.json:a NUL byte at byte 78" \
         "ijunk.json:bytes after the JSON value at byte 50"; do
  f=${c%%:*} want=${c#*:}
  timeout -k 5 60 "$TRAIN" --model-config "$tmp/$f" --batch 2 --seq 32 --steps 2 --sample 0 > "$tmp/out" 2> "$tmp/err"; rc=$?
  if [ $rc != 0 ] && [ $rc -lt 124 ] && grep -q "model config '.*$f': $want" "$tmp/err" && ! grep -q "^step" "$tmp/out"
  then ok "--model-config $f: refused, naming the file and the byte ($want)"
  else bad "--model-config $f" "exit $rc" "$(head -2 "$tmp/err")"; fi
done
timeout -k 5 60 "$TRAIN" --config "$tmp/no/such.json" > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--config .*no/such.json: cannot read it" "$tmp/err" && ok "a missing config file" ||
  bad "a missing config file" "exit $rc" "$(head -2 "$tmp/err")"

# ---- --resume restores the schedule, the optimizer and the fp16 loss scale ----
# AMP_FP16 with a loss scale that grows every 2 clean steps and an overflow injected at step 2
fp16=(--model tiny --data synthetic --batch 8 --seq 32 --lr 3e-3 --warmup 2 --beta2 0.98 --clip 0.5
      --weight-decay 0.05 --threads 1 --sample 0 --precision AMP_FP16 --loss-scale-growth-interval 2)
amp=("${fp16[@]}" --min-lr 1e-4)
FSDP_INJECT_OVERFLOW_STEP=1 "$TRAIN" "${amp[@]}" --steps 6 --save-every 3 --save-dir "$tmp/a" --log "$tmp/a.jsonl" \
  > "$tmp/oa" 2>&1 || bad "6 AMP_FP16 steps" "$(tail -3 "$tmp/oa")"
if "$TRAIN" --resume "$tmp/a/step-00000003" --save-dir "$tmp/b" --log "$tmp/b.jsonl" > "$tmp/ob" 2>&1 &&
   [ -s "$tmp/b.jsonl" ] && [ "$(steps_after "$tmp/a.jsonl" 3)" = "$(steps_after "$tmp/b.jsonl" 3)" ] &&
   [ "$(steps_after "$tmp/b.jsonl" 3 | wc -l)" = 3 ] && grep -q "^resume: loss scale 32768, 1 clean steps" "$tmp/ob" &&
   cmp -s "$tmp/a/step-00000006/rank-00000-of-00001.safetensors" "$tmp/b/step-00000006/rank-00000-of-00001.safetensors"
then ok "AMP_FP16: --resume with no schedule flags continues the 6-step run bit for bit (losses, norms, loss scale 32768 and its growth tracker, the step-6 checkpoint)"
else bad "AMP_FP16 resume without flags" "$(paste <(steps_after "$tmp/a.jsonl" 3) <(steps_after "$tmp/b.jsonl" 3))" "$(grep -E '^resume|error' "$tmp/ob")"; fi

# 3 steps, then 3 more: --steps disagrees with the checkpoint until --override names it
const=("${fp16[@]}" --lr-schedule constant)
FSDP_INJECT_OVERFLOW_STEP=1 "$TRAIN" "${const[@]}" --steps 6 --log "$tmp/c6.jsonl" > "$tmp/oc6" 2>&1 ||
  bad "6 steps, constant" "$(tail -3 "$tmp/oc6")"
FSDP_INJECT_OVERFLOW_STEP=1 "$TRAIN" "${const[@]}" --steps 3 --save-dir "$tmp/c3" > "$tmp/oc3" 2>&1 ||
  bad "3 steps, constant" "$(tail -3 "$tmp/oc3")"
"$TRAIN" --resume "$tmp/c3" --steps 6 > "$tmp/out" 2> "$tmp/err"; rc=$?
if [ $rc = 2 ] && grep -q -- "--steps 6 disagrees with the checkpoint .*c3/step-00000003, saved with --steps 3: .*--override steps" "$tmp/err"
then ok "--resume with a --steps the checkpoint disagrees with: an error naming both values (exit 2)"
else bad "disagreeing --steps" "exit $rc" "$(head -2 "$tmp/err")"; fi
"$TRAIN" "${const[@]}" --resume "$tmp/c3" --lr 1e-3 > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--lr 0.001 disagrees with the checkpoint .*, saved with --lr 0.003" "$tmp/err" &&
  ok "--lr disagreeing with the checkpoint names both values" || bad "disagreeing --lr" "exit $rc" "$(head -2 "$tmp/err")"
if "$TRAIN" "${const[@]}" --resume "$tmp/c3" --steps 6 --override steps --log "$tmp/c33.jsonl" > "$tmp/oc33" 2>&1 &&
   [ -s "$tmp/c33.jsonl" ] && [ "$(steps_after "$tmp/c6.jsonl" 3)" = "$(steps_after "$tmp/c33.jsonl" 3)" ]; then
  ok "AMP_FP16: 3 steps + --resume --steps 6 --override steps + 3 steps = 6 steps, bit for bit (loss scale included)"
else bad "3 + 3 steps" "$(paste <(steps_after "$tmp/c6.jsonl" 3) <(steps_after "$tmp/c33.jsonl" 3))" "$(tail -2 "$tmp/oc33")"; fi
if "$TRAIN" --resume "$tmp/c3" --steps 4 --lr 1e-3 --override steps,lr --log "$tmp/o4.jsonl" > "$tmp/oo4" 2>&1 &&
   grep -q '"step": 4, "loss": [0-9.]*, "lr": 0.00100000005' "$tmp/o4.jsonl" && [ "$(cfgof "$tmp/o4.jsonl" beta2)" = 0.98 ]; then
  ok "--override steps,lr: those from the command line, the rest (beta2 0.98) from the checkpoint"
else bad "--override lr" "$(tail -2 "$tmp/oo4")"; fi
"$TRAIN" --resume "$tmp/c3" --data synthetic --override data > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--override: 'data' needs no override: a --data given with --resume is used as given" "$tmp/err" &&
  ok "--override of a data flag says a given one is used anyway" || bad "--override data" "exit $rc" "$(head -2 "$tmp/err")"
"$TRAIN" --resume "$tmp/c3" --override bogus > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--override: 'bogus' is not a flag --resume restores" "$tmp/err" &&
  ok "--override of a flag --resume does not restore" || bad "--override bogus" "exit $rc" "$(head -2 "$tmp/err")"

"$TRAIN" --resume "$tmp/c3" --override steps,,lr > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--override 'steps,,lr': an empty name in the list" "$tmp/err" &&
  ok "--override with an empty name in its list" || bad "--override steps,,lr" "exit $rc" "$(head -2 "$tmp/err")"
"$TRAIN" --resume "$tmp/c3" --steps 4 --override steps --seq 16 --override seq > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--override is given twice ('steps' and 'seq'): give one list (--override steps,seq)" "$tmp/err" &&
  ok "--override given twice is a usage error naming both (the second replaced the first)" ||
  bad "--override twice" "exit $rc" "$(head -2 "$tmp/err")"
"$TRAIN" "${const[@]}" --steps 2 --override steps > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--override steps: it names flags --resume restores from a checkpoint; without --resume" "$tmp/err" &&
  ok "--override without --resume is a usage error" || bad "--override without --resume" "exit $rc" "$(head -2 "$tmp/err")"
"$TRAIN" --task swav --model cnn --knn-train 0 --steps 1 > "$tmp/out" 2> "$tmp/err"; rc=$?
[ $rc = 2 ] && grep -q -- "--knn-train 0 needs --probe-epochs 0" "$tmp/err" &&
  ok "--knn-train 0 with the linear probe on is a usage error" || bad "--knn-train 0" "exit $rc" "$(head -2 "$tmp/err")"

# ---- a flag the run would not read is refused, not ignored ([Note: flags a run does not read]) ----
# not_read NAME PATTERN -- ARGS...: exit 2 with PATTERN on stderr, before any step
not_read() {
  local name=$1 pat=$2; shift 3
  "$TRAIN" "$@" > "$tmp/out" 2> "$tmp/err"; local rc=$?
  if [ $rc = 2 ] && grep -q -- "$pat" "$tmp/err" && ! grep -q '^step' "$tmp/out"; then ok "refused: $name"
  else bad "refused: $name" "exit $rc" "$(head -2 "$tmp/err")"; fi
}
not_read "an image flag on a GPT" "^fsdp-train: --augment crop-flip: this run's task, tokens (a GPT on token data), does not read it; it applies to --task images" \
  -- --model tiny --steps 1 --augment crop-flip
not_read "a SwAV flag on a classifier" "^fsdp-train: --knn-train 50: this run's task, images, does not read it; it applies to --task swav" \
  -- --model cnn --steps 1 --knn-train 50
not_read "a GPT flag on SwAV" "^fsdp-train: --seq 32: this run's task, swav, does not read it; it applies to --task tokens" \
  -- --task swav --model cnn --steps 1 --seq 32
not_read "an image and SwAV flag on a GPT" "^fsdp-train: --sync-bn on: .* it applies to --task images or swav" \
  -- --model tiny --steps 1 --sync-bn on
not_read "--momentum with AdamW" "^fsdp-train: --momentum 0.9: this run does not read it; it applies with --optim sgd or lars" \
  -- --model tiny --steps 1 --momentum 0.9
not_read "--loss-scale-init without AMP_FP16" "^fsdp-train: --loss-scale-init 1024: .* applies with --precision AMP_FP16" \
  -- --model tiny --steps 1 --precision AMP_BF16 --loss-scale-init 1024
not_read "--lp-shard-copy in FP32" "^fsdp-train: --lp-shard-copy on: .* applies with --precision AMP_BF16 or AMP_FP16" \
  -- --model tiny --steps 1 --lp-shard-copy on
not_read "--shm-gbps without the scale-out plan" "^fsdp-train: --shm-gbps 10: .* applies with --dry-run --net-gbps X" \
  -- --model tiny --dry-run --shm-gbps 10
not_read "--accum-mode without accumulation" "^fsdp-train: --accum-mode no_sync: .* applies with --grad-accum above 1" \
  -- --model tiny --steps 1 --accum-mode no_sync
not_read "--min-lr without the cosine schedule" "^fsdp-train: --min-lr 0: .* applies with --lr-schedule cosine" \
  -- --model tiny --steps 1 --lr-schedule constant --min-lr 0
not_read "--max-inflight with overlap off" "^fsdp-train: --max-inflight 3: .* applies with --overlap on" \
  -- --model tiny --steps 1 --overlap off --max-inflight 3
not_read "--state-dict-type without --save-dir" "^fsdp-train: --state-dict-type full: .* applies with --save-dir DIR" \
  -- --model tiny --steps 1 --state-dict-type full
not_read "--mpi-reduce with --comm shm" "^fsdp-train: --mpi-reduce native: .* applies with --comm auto or mpi" \
  -- --model tiny --steps 1 --comm shm --mpi-reduce native
# under --nproc the check comes before the launch: the one line, not the launcher's banner after it
not_read "--augment on a GPT under --nproc 2" "^fsdp-train: --augment crop-flip: this run's task, tokens" \
  -- --model tiny --steps 1 --nproc 2 --augment crop-flip
[ "$(wc -l < "$tmp/err")" = 2 ] && ! grep -qi 'mpirun\|prterun\|non-zero' "$tmp/err" &&
  ok "--nproc 2: the refusal is the one usage line, before any rank starts" || bad "refusal under --nproc 2" "$(cat "$tmp/err")"
printf '{"model": "tiny", "steps": 1, "eval-baseline": true}' > "$tmp/nr.json"
not_read "a --config key set away from its default" "^fsdp-train: --config $tmp/nr.json: --eval-baseline: this run's task, tokens" \
  -- --config "$tmp/nr.json"
# the same flags where the run reads them, and a GPT's config file holding an image flag at its default
printf '{"model": "tiny", "steps": 1, "augment": "crop-flip", "sample": 0}' > "$tmp/nr2.json"
if "$TRAIN" --config "$tmp/nr2.json" --optim sgd --momentum 0.9 --precision AMP_FP16 --loss-scale-init 1024 \
     --grad-accum 2 --accum-mode no_sync > "$tmp/out" 2> "$tmp/err" &&
   "$TRAIN" --model cnn --steps 1 --augment none --sync-bn on > "$tmp/out2" 2> "$tmp/err2"; then
  ok "the same flags where the run reads them, and a config file's image flag at its default on a GPT, are taken"
else bad "flags the run reads" "$(head -2 "$tmp/err")" "$(head -2 "$tmp/err2")"; fi
# a default that follows another flag (--min-lr: --lr / 10) is written out resolved; a log's config given back is taken
"$TRAIN" --model tiny --steps 1 --lr 1e-3 --lr-schedule constant --overlap off --log "$tmp/nr3.jsonl" > "$tmp/out" 2>&1 ||
  bad "a constant-schedule run" "$(tail -2 "$tmp/out")"
config_again "$tmp/nr3.jsonl" log=null > "$tmp/nr3.json"
if python3 -c 'import sys; assert abs(float(sys.argv[1]) - 1e-4) < 1e-9' "$(cfgof "$tmp/nr3.jsonl" min-lr)" && "$TRAIN" --config "$tmp/nr3.json" > "$tmp/out" 2> "$tmp/err"; then
  ok "a constant-schedule run's logged configuration (min-lr at --lr / 10, max-inflight at its default) runs again as --config"
else bad "a constant-schedule run's configuration as --config" "$(cfgof "$tmp/nr3.jsonl" min-lr)" "$(head -2 "$tmp/err")"; fi

# ---- the data and evaluation flags: --resume without --data keeps the checkpoint's file (it once fell back to the
# synthetic corpus), and without --val-data/--eval-every it goes on evaluating ----
python3 - "$tmp/tok.bin" <<'PY'
import random, struct, sys
random.seed(7); n = 4000
hdr = [0] * 256; hdr[0] = 20240520; hdr[1] = 1; hdr[2] = n
open(sys.argv[1], "wb").write(struct.pack("<256i", *hdr) + struct.pack(f"<{n}H", *(random.randrange(256) for _ in range(n))))
PY
# step, loss and norms of the steps after $2 (an fp32 log has no loss scale); fails on a log without them
losses_after() { python3 -c '
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "step" in r and r["step"] > int(sys.argv[2]):
        print(r["step"], r["loss"], r["grad_norm"], r["param_norm"])' "$1" "$2"; }
# step and eval_loss of the evaluations after $2
evals_after() { python3 -c '
import json, sys
for r in map(json.loads, open(sys.argv[1])):
    if "step" in r and r["step"] > int(sys.argv[2]) and "eval_loss" in r:
        print(r["step"], r["eval_loss"])' "$1" "$2"; }
dat=(--model tiny --data "$tmp/tok.bin" --val-data "$tmp/tok.bin" --eval-every 2 --eval-batches 1 --batch 4 --seq 32
     --lr 3e-3 --warmup 1 --threads 1 --sample 0)
"$TRAIN" "${dat[@]}" --steps 4 --log "$tmp/d4.jsonl" > "$tmp/od4" 2>&1 || bad "4 steps on a token file" "$(tail -3 "$tmp/od4")"
"$TRAIN" "${dat[@]}" --steps 4 --save-every 2 --save-dir "$tmp/d" --log "$tmp/d2.jsonl" > "$tmp/od2" 2>&1 ||
  bad "4 steps on a token file, saved at 2" "$(tail -3 "$tmp/od2")"
cp "$tmp/tok.bin" "$tmp/moved.bin"
if "$TRAIN" --resume "$tmp/d/step-00000002" --log "$tmp/dr.jsonl" > "$tmp/odr" 2>&1 &&
   [ "$(cfgof "$tmp/dr.jsonl" data)" = "\"$tmp/tok.bin\"" ] && [ "$(losses_after "$tmp/dr.jsonl" 2 | wc -l)" = 2 ] &&
   [ "$(losses_after "$tmp/d4.jsonl" 2)" = "$(losses_after "$tmp/dr.jsonl" 2)" ] &&
   [ -n "$(evals_after "$tmp/dr.jsonl" 2)" ] && [ "$(evals_after "$tmp/d4.jsonl" 2)" = "$(evals_after "$tmp/dr.jsonl" 2)" ] &&
   "$TRAIN" --resume "$tmp/d/step-00000002" --data "$tmp/moved.bin" --log "$tmp/dm.jsonl" > "$tmp/odm" 2>&1 &&
   [ "$(cfgof "$tmp/dm.jsonl" data)" = "\"$tmp/moved.bin\"" ] && [ "$(losses_after "$tmp/d4.jsonl" 2)" = "$(losses_after "$tmp/dm.jsonl" 2)" ]
then ok "--resume without --data trains on the checkpoint's token file and evaluates as configured (steps 3-4 and the step-4 eval_loss as the uninterrupted run); a given --data (the file moved) is used as given"
else bad "--resume and --data" "$(paste <(losses_after "$tmp/d4.jsonl" 2) <(losses_after "$tmp/dr.jsonl" 2))" "$(grep -E 'error|data' "$tmp/odr" | head -3)"; fi

finish
