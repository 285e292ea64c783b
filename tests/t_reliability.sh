#!/usr/bin/env bash
# t_reliability.sh - end-to-end checks of fsdp-train's reliability flags:
# --dry-run prints the memory plan per rank (shards checked against the
# parameter count computed here from the config), --mem-limit refuses a plan
# over the limit before any step (by default, the host's memory per rank), a
# bad size is a usage error, a run that diverges to nan stops with one
# message naming the step and the unit, at 1 and 2 ranks; and what probing
# as a user and as an adversary found: a FIFO for every path read, config
# values past their bounds, damaged or short data, a data file truncated
# mid-run, output paths checked before step 1 (--save-full with the writer's
# own check, --log replacing only a log, no run saving over another's
# checkpoints), two jobs on one --save-dir, a save that runs out of space
# removing what it made, a resume with nothing left to train, fsdp-ckpt
# verify against the model config, SIGKILL of mpirun, --comm self with 2
# ranks, an input, a --save-dir or a checkpoint that differs between two
# hosts (ranks in two folders), small flag checks.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

# GPT-2 124M: V*C + block*C + L*(12 C^2 + 13 C) + 2 C parameters, 4 bytes each, per rank
mib() { python3 -c "L,C,V,P=12,768,50257,1024; n=V*C+P*C+L*(12*C*C+13*C)+2*C; print('%.1f MiB' % (4*n/$1/2**20))"; }

# the plan's line "gradient shards ...: X MiB in the activations' pages ..., Y MiB in buffers of
# their own" in file $1 sums to $2 MiB (to the rounding of the two)
grads_sum() {
  python3 - "$1" "$2" <<'PY'
import re, sys
m = re.search(r"gradient shards .*?: ([0-9.]+) MiB in the activations' pages.*?, ([0-9.]+) MiB in buffers", open(sys.argv[1]).read())
sys.exit(0 if m and abs(float(m.group(1)) + float(m.group(2)) - float(sys.argv[2])) <= 0.11 else 1)
PY
}

# ---- --dry-run ----
if timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --dry-run > "$tmp/d1" 2>&1; then
  p1=$(mib 1)
  # the gradient shards: in buffers of their own (the grads column) or in the activations'
  # pages backward released, the line below the table giving both
  if grep -qE "^0 +$p1 +[0-9.]+ MiB +$(python3 -c "print('%.1f MiB' % (2*float('${p1% MiB}')))")" "$tmp/d1" &&
     grads_sum "$tmp/d1" "${p1% MiB}" && ! grep -q "^step" "$tmp/d1"; then
    ok "dry-run gpt2, 1 rank: params = gradients (own + in the activations' pages) = $p1, AdamW twice that"
  else bad "dry-run gpt2, 1 rank" "expected params $p1:" "$(cat "$tmp/d1")"; fi
else bad "dry-run gpt2, 1 rank" "$(tail -5 "$tmp/d1")"; fi
if timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --dry-run > "$tmp/d4" 2>&1; then
  p4=$(mib 4)  # padding adds < 0.05 MiB
  rows=$(grep -cE "^[0-3] +$p4 +[0-9.]+ MiB " "$tmp/d4")
  if [ "$rows" -eq 4 ] && grep -q "world 4, 13 units .*batch 1 x 256" "$tmp/d4" && grads_sum "$tmp/d4" "${p4% MiB}"; then
    ok "dry-run gpt2, --nproc 4: 4 ranks of $p4 shards each, without starting ranks"
  else bad "dry-run gpt2, --nproc 4" "expected 4 rows of $p4:" "$(cat "$tmp/d4")"; fi
else bad "dry-run gpt2, --nproc 4" "$(tail -5 "$tmp/d4")"; fi
# mixed precision is planned as it runs: gathering by copy (FSDP_SHM_WINDOW=0) the shards are
# FP32's (with --lp-shard-copy on they carry their 16-bit copy, more than FP32's shards), the full
# buffers hold the Linear and embedding weights in 16 bits only (less than FP32's gathered by
# copy); on shm by default the 16-bit copies lie in the 16-bit window (the shards carry them as
# with --lp-shard-copy on) and the full buffers hold less still; FP32 on shm gathers through the
# shared window, holding full buffers for the gradients only (less than 16 bits by copy; forced:
# GPT-2's 500 MB are over the default bound on 4 KiB shmem pages)
if timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --precision AMP_BF16 --dry-run > "$tmp/d4b" 2>&1 &&
   FSDP_SHM_WINDOW=0 timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --precision AMP_BF16 --dry-run > "$tmp/d4bc" 2>&1 &&
   FSDP_SHM_WINDOW=0 timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --precision AMP_BF16 --lp-shard-copy on --dry-run > "$tmp/d4l" 2>&1 &&
   FSDP_SHM_WINDOW=0 timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --dry-run > "$tmp/d4c" 2>&1 &&
   FSDP_SHM_WINDOW=$((1 << 40)) timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --dry-run > "$tmp/d4w" 2>&1; then
  f32=$(awk '/^0 /{print $8}' "$tmp/d4c"); f16c=$(awk '/^0 /{print $8}' "$tmp/d4bc"); fw=$(awk '/^0 /{print $8}' "$tmp/d4w")
  f16=$(awk '/^0 /{print $8}' "$tmp/d4b"); s16=$(awk '/^0 /{print $2}' "$tmp/d4b")
  s32=$(awk '/^0 /{print $2}' "$tmp/d4"); s16c=$(awk '/^0 /{print $2}' "$tmp/d4bc"); sl=$(awk '/^0 /{print $2}' "$tmp/d4l")
  if grep -q "threads per rank, AMP_BF16 mixed_precision DEFAULT" "$tmp/d4b" && ! grep -q "planned as FP32" "$tmp/d4b" &&
     [ -n "$f32" ] && [ -n "$f16c" ] && [ -n "$f16" ] && [ -n "$s32" ] && [ -n "$s16c" ] && [ -n "$s16" ] && [ -n "$sl" ] &&
     [ -n "$fw" ] && python3 -c "import sys; sys.exit(not ($f16c < $f32 and $s16c == $s32 and $sl > $s32 and $s16 == $sl and $f16 < $f16c and $fw < $f16c))"; then
    ok "dry-run gpt2 AMP_BF16: by copy, parameter shards $s16c MiB as FP32's ($sl MiB with --lp-shard-copy on) and full buffers $f16c MiB < $f32 MiB in FP32 ($fw MiB through the shared window); in the 16-bit window shards $s16 MiB, full buffers $f16 MiB"
  else bad "dry-run gpt2 AMP_BF16" "by copy: params '$s16c' ('$sl' with the copy) vs FP32 '$s32', full buffers '$f16c' vs FP32 '$f32' by copy, '$fw' windowed; 16-bit window: params '$s16', full buffers '$f16'" "$(cat "$tmp/d4b")"; fi
else bad "dry-run gpt2 AMP_BF16" "$(tail -5 "$tmp/d4b")"; fi

# ---- --mem-limit ----
t0=$SECONDS
timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --steps 5 --mem-limit 1.5G > "$tmp/m1" 2> "$tmp/m1e"
rc=$?
if [ $rc -eq 1 ] && grep -q "mem-limit 1.5G: the plan needs [0-9.]* MiB per rank .*activations .* more than the limit of 1536.0 MiB" "$tmp/m1e" &&
   ! grep -q "^step" "$tmp/m1"; then ok "--mem-limit 1.5G refuses gpt2 at 1 rank before any step ($((SECONDS - t0)) s)"
else bad "--mem-limit refusal" "exit $rc" "$(cat "$tmp/m1e" | head -3)"; fi
if timeout 120 "$TRAIN" --model gpt2 --batch 4 --seq 256 --nproc 4 --dry-run --mem-limit 1.5G > "$tmp/m4" 2>&1 &&
   grep -q "fits" "$tmp/m4"; then ok "--mem-limit 1.5G fits gpt2 at 4 ranks"
else bad "--mem-limit at 4 ranks" "$(tail -3 "$tmp/m4")"; fi
if timeout 60 "$TRAIN" --model tiny --steps 3 --seq 32 --batch 4 --sample 0 --mem-limit 64M > "$tmp/m5" 2>&1 &&
   [ "$(grep -c "^step" "$tmp/m5")" -eq 3 ]; then ok "--mem-limit 64M lets tiny train"
else bad "--mem-limit 64M with tiny" "$(tail -3 "$tmp/m5")"; fi
# flag errors exit 2; a limit below 1 MiB (0 included) is no limit a run can keep
for v in 1.5Q 10K 0; do
  timeout 60 "$TRAIN" --model tiny --mem-limit $v > /dev/null 2> "$tmp/m6"
  rc=$?
  if [ $v = 1.5Q ]; then pat="'1.5Q' is not a memory size"; else pat="--mem-limit $v is [0-9]* bytes, below the smallest limit of 1 MiB"; fi
  if [ $rc -eq 2 ] && grep -q -- "$pat" "$tmp/m6"; then ok "--mem-limit $v is a usage error (exit 2)"
  else bad "--mem-limit $v" "exit $rc" "$(head -3 "$tmp/m6")"; fi
done
# --mem-limit auto (the default): a plan over the host's memory per rank is refused before any
# work, naming its biggest parts and the override (this plan is about 520 GB of activations,
# measured in a few seconds: measure mode touches none of it)
t0=$SECONDS
timeout -k 5 60 "$TRAIN" --model gpt2 --batch 256 --seq 1024 --steps 2 --sample 0 > "$tmp/a1" 2> "$tmp/a1e"
rc=$?
if [ $rc -eq 1 ] && grep -q "the plan needs [0-9.]* MiB per rank, most of it activations [0-9.]* MiB, .*this host can give each rank [0-9.]* MiB (MemAvailable .* over 1 local rank, less [0-9.]* MiB each kept for what the plan does not count).*--mem-limit off" "$tmp/a1e" &&
   ! grep -q "^step" "$tmp/a1"; then ok "--mem-limit auto refuses a 520 GB plan before any work ($((SECONDS - t0)) s)"
else bad "--mem-limit auto refusal" "exit $rc" "$(head -3 "$tmp/a1e")"; fi
if timeout 60 "$TRAIN" --model gpt2 --batch 256 --seq 1024 --dry-run > "$tmp/a2" 2>&1 &&
   grep -q "host memory (--mem-limit auto): [0-9.]* MiB per rank (MemAvailable .*): EXCEEDED, a run would be refused" "$tmp/a2"
then ok "--dry-run shows the host's memory per rank and that the run would be refused"
else bad "--dry-run host memory line" "$(tail -3 "$tmp/a2")"; fi
# the check keeps 64 MiB + 1% of each rank's share back for what the plan does not count (page
# tables, oneDNN, MPI): at 2 local ranks, per rank = MemAvailable / 2 - reserve, reserve printed
if timeout 60 "$TRAIN" --model tiny --nproc 2 --seq 32 --batch 4 --dry-run > "$tmp/a4" 2>&1 &&
   python3 - "$tmp/a4" <<'PY'
import re, sys
m = re.search(r"host memory \(--mem-limit auto\): ([0-9.]+) MiB per rank \(MemAvailable ([0-9.]+) MiB(, cgroup limit "
              r"([0-9.]+) MiB)? over 2 local ranks, less ([0-9.]+) MiB each kept for what the plan does not count\): fits",
              open(sys.argv[1]).read())
per, avail, reserve = float(m.group(1)), float(m.group(2)), float(m.group(5))
share = min(avail, float(m.group(4) or avail)) / 2
assert abs(reserve - (64 + share / 100)) < 0.2 and abs(per - (share - reserve)) < 0.2, (per, avail, reserve)
PY
then ok "--mem-limit auto keeps 64 MiB + 1% per rank back ($(grep -o 'less [0-9.]* MiB' "$tmp/a4"))"
else bad "--mem-limit auto reserve" "$(grep 'host memory' "$tmp/a4")"; fi
if timeout 60 "$TRAIN" --model tiny --steps 2 --seq 32 --batch 4 --sample 0 --mem-limit off > "$tmp/a3" 2>&1 &&
   [ "$(grep -c "^step" "$tmp/a3")" -eq 2 ]; then ok "--mem-limit off is accepted"
else bad "--mem-limit off" "$(tail -3 "$tmp/a3")"; fi

# ---- non-regular files are refused at once, naming the path (a FIFO used to hang the reader) ----
tiny=(--model tiny --steps 2 --seq 32 --batch 4 --sample 0 --threads 1)
mkfifo "$tmp/fifo"; mkdir "$tmp/fck"; mkfifo "$tmp/fck/meta.json"
fifo_case() { # NAME WHAT CMD...: WHAT is the text before ": not a regular file (a FIFO)"
  local name=$1 what=$2; shift 2
  timeout -k 2 15 "$@" > "$tmp/ff" 2>&1
  local rc=$?
  if [ $rc -ne 0 ] && [ $rc -lt 124 ] && grep -qF -- "$what: not a regular file (a FIFO)" "$tmp/ff"; then
    ok "$name: a FIFO is refused, naming it (exit $rc)"
  else bad "$name: a FIFO" "exit $rc" "$(head -3 "$tmp/ff")"; fi
}
fifo_case "--data" "$tmp/fifo" "$TRAIN" "${tiny[@]}" --data "$tmp/fifo"
fifo_case "--model-config" "model config '$tmp/fifo'" "$TRAIN" "${tiny[@]}" --model-config "$tmp/fifo"
fifo_case "--init-from" "$tmp/fifo" "$TRAIN" "${tiny[@]}" --init-from "$tmp/fifo"
fifo_case "--resume (meta.json)" "$tmp/fck/meta.json" "$TRAIN" "${tiny[@]}" --resume "$tmp/fck"
fifo_case "fsdp-ckpt verify (meta.json)" "$tmp/fck/meta.json" "$BUILD/fsdp-ckpt" verify "$tmp/fck"
fifo_case "fsdp-ckpt verify (a safetensors path)" "$tmp/fifo" "$BUILD/fsdp-ckpt" verify "$tmp/fifo"

# ---- config values past the supported range are refused (n_embd 2^31-1 overflowed int64 sizes) ----
echo '{"n_layer":2,"n_head":1,"n_embd":2147483647,"vocab_size":256,"block_size":64}' > "$tmp/huge.json"
timeout -k 5 60 "$TRAIN" --model-config "$tmp/huge.json" --dry-run > "$tmp/hg" 2>&1
rc=$?
if [ $rc -eq 1 ] && grep -q "model config '$tmp/huge.json': GPT config: n_embd 2147483647 is above the largest supported, 131072" "$tmp/hg"
then ok "n_embd 2147483647 is refused, naming the field and the bound"
else bad "n_embd 2147483647" "exit $rc" "$(head -3 "$tmp/hg")"; fi

# ---- the shape of the data: a damaged llm.c magic, a file shorter than one sequence ----
python3 -c "
import struct, sys
n = 4000
h = struct.pack('<3i', 12345678, 1, n) + bytes(1024 - 12)
open(sys.argv[1], 'wb').write(h + struct.pack('<%dH' % n, *[i % 256 for i in range(n)]))
" "$tmp/damaged.bin"
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --data "$tmp/damaged.bin" > "$tmp/dm" 2> "$tmp/dme"
rc=$?
if [ $rc -eq 1 ] && grep -q "'$tmp/damaged.bin': laid out as an llm.c token file (version 1, 4000 tokens .*) but its magic is 12345678, not 20240520" "$tmp/dme" &&
   ! grep -q "^step" "$tmp/dm"; then ok "an llm.c file with a damaged magic is refused, not read as raw tokens"
else bad "llm.c file with a damaged magic" "exit $rc" "$(head -3 "$tmp/dme")"; fi
printf '0123456789abcdefghij' > "$tmp/short.txt"
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --data "$tmp/short.txt" > "$tmp/st" 2> "$tmp/ste"
rc=$?
if [ $rc -eq 1 ] && grep -q "'$tmp/short.txt' has 20 tokens, fewer than one sequence needs (--seq 32 + 1 = 33 tokens)" "$tmp/ste" &&
   ! grep -q "^step" "$tmp/st"; then ok "a data file shorter than one sequence is refused, naming both sizes"
else bad "data shorter than a sequence" "exit $rc" "$(head -3 "$tmp/ste")"; fi

# ---- a token file that shrinks while training: an error naming it, not SIGBUS ----
for n in 1 2; do
  head -c 400000 /dev/urandom > "$tmp/shrink$n.txt"
  timeout -k 5 120 "$TRAIN" --model tiny --data "$tmp/shrink$n.txt" --steps 100000 --seq 32 --batch 4 --sample 0 \
    --threads 1 --nproc $n > "$tmp/sh$n" 2> "$tmp/sh${n}e" &
  pid=$!
  for _ in $(seq 200); do grep -q "^step *3/" "$tmp/sh$n" && break; sleep 0.1; done
  truncate -s 1000 "$tmp/shrink$n.txt"
  t0=$SECONDS
  wait $pid
  rc=$?
  # every rank detects the shrink and aborts the job itself; Open MPI then reports 1, or 137
  # when it kills a rank that is already aborting: any non-zero exit well before the timeout
  # (no hang) counts
  if [ $rc -ne 0 ] && [ $((SECONDS - t0)) -lt 100 ] && grep -q "'$tmp/shrink$n.txt' shrank while in use: it has 1000 bytes, 400000 at open" "$tmp/sh${n}e"; then
    ok "a token file truncated mid-run stops $n rank(s) naming it (exit $rc)"
  else bad "token file truncated mid-run at $n rank(s)" "exit $rc" "$(head -3 "$tmp/sh${n}e")"; fi
done

# ---- output locations are checked before step 1, creating nothing ----
out_case() { # FLAG VALUE PATTERN
  timeout -k 5 60 "$TRAIN" "${tiny[@]}" "$1" "$2" > "$tmp/oc" 2> "$tmp/oce"
  local rc=$?
  if [ $rc -eq 1 ] && grep -qF -- "$3" "$tmp/oce" && ! grep -q "^step" "$tmp/oc"; then ok "$1 $2: refused before step 1"
  else bad "$1 $2 before step 1" "exit $rc" "$(head -3 "$tmp/oce")"; fi
}
out_case --save-full "$tmp/no/such/full.safetensors" "--save-full '$tmp/no/such/full.safetensors': the folder '$tmp/no/such' does not exist"
out_case --save-full "$tmp" "--save-full '$tmp' is a folder"
out_case --save-dir "$tmp/no/such" "--save-dir '$tmp/no/such': the folder '$tmp/no' does not exist"
out_case --save-dir "$tmp/huge.json" "--save-dir '$tmp/huge.json' exists and is not a folder"
out_case --log "$tmp/no/such.jsonl" "--log '$tmp/no/such.jsonl': the folder '$tmp/no' does not exist"
[ ! -e "$tmp/no" ] && ok "the refused output paths created nothing" || bad "refused output paths created $tmp/no"
# --save-full onto a file fsdp.c did not write (or a device): the writer's own check, before step 1
echo "notes" > "$tmp/foreign.safetensors"
out_case --save-full "$tmp/foreign.safetensors" "--save-full: $tmp/foreign.safetensors: exists and was not written by fsdp.c"
out_case --save-full /dev/null "--save-full: /dev/null: exists and is not a regular file"
[ "$(cat "$tmp/foreign.safetensors")" = notes ] && ok "the refused --save-full file is left as it was" ||
  bad "the refused --save-full file changed"
if timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-full "$tmp/own.safetensors" > "$tmp/of1" 2>&1 &&
   timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-full "$tmp/own.safetensors" > "$tmp/of2" 2>&1; then
  ok "--save-full over a file fsdp.c wrote passes the same check and is replaced"
else bad "--save-full over our own file" "$(tail -2 "$tmp/of2")"; fi

# ---- the outputs apart: one file for two flags passed each check alone, trained, then the save
# refused the log the run had written and the model was lost ----
outs_case() { # NAME PATTERN FLAGS...
  local name=$1 pat=$2; shift 2
  timeout -k 5 60 "$TRAIN" "${tiny[@]}" "$@" > "$tmp/oc" 2> "$tmp/oce"
  local rc=$?
  if [ $rc -eq 1 ] && grep -qF -- "$pat" "$tmp/oce" && ! grep -q "^step" "$tmp/oc"; then ok "$name: refused before step 1"
  else bad "$name before step 1" "exit $rc" "$(head -3 "$tmp/oce")"; fi
}
outs_case "--log and --save-full one file" "--log '$tmp/same.out' and --save-full '$tmp/same.out' are the same file" \
  --log "$tmp/same.out" --save-full "$tmp/same.out"
outs_case "--log and --save-full one file by two names" \
  "--log '$tmp/same.out' and --save-full '$tmp/./same.out' are the same file" --log "$tmp/same.out" --save-full "$tmp/./same.out"
[ ! -e "$tmp/same.out" ] && ok "the refused pair created no file" || bad "the refused pair created $tmp/same.out"
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --log "$tmp/prev.jsonl" > /dev/null 2>&1 && cp "$tmp/prev.jsonl" "$tmp/prev.copy"
outs_case "--log and --save-full on an existing log" "--log '$tmp/prev.jsonl' and --save-full '$tmp/./prev.jsonl' are the same" \
  --log "$tmp/prev.jsonl" --save-full "$tmp/./prev.jsonl"
cmp -s "$tmp/prev.jsonl" "$tmp/prev.copy" && ok "the existing log is left as it was" || bad "the existing log changed"
mkdir "$tmp/sd" # an existing --save-dir (a fresh one: its folder does not exist for --log)
outs_case "--log under a checkpoint's name in --save-dir" \
  "--log '$tmp/sd/step-00000002' is in --save-dir '$tmp/sd' under a name its checkpoints use" \
  --save-dir "$tmp/sd" --log "$tmp/sd/step-00000002"
outs_case "--log as --save-dir's lock file" "--log '$tmp/sd/.lock' is in --save-dir '$tmp/sd' under a name its checkpoints use" \
  --save-dir "$tmp/sd" --log "$tmp/sd/.lock"
outs_case "--save-full under a checkpoint's name in --save-dir" \
  "--save-full '$tmp/sd/step-00000002.safetensors' is in --save-dir '$tmp/sd' under a name its checkpoints use" \
  --save-dir "$tmp/sd" --state-dict-type full --save-full "$tmp/sd/step-00000002.safetensors"
outs_case "--log and --save-dir one path" "--log '$tmp/sd2' and --save-dir '$tmp/sd2' are the same file" \
  --log "$tmp/sd2" --save-dir "$tmp/sd2"

# ---- --log replaces only a log of fsdp-train ([Note: a log is replaced only by a log]) ----
echo precious > "$tmp/user.txt"
ln -s user.txt "$tmp/link.jsonl"
mkfifo "$tmp/log.fifo"
out_case --log "$tmp/user.txt" "--log '$tmp/user.txt' exists and is not a log of fsdp-train"
printf '{"config": {"x": 1}}\nimportant line\n' > "$tmp/other.jsonl" # another program's JSON lines, opening alike
cp "$tmp/other.jsonl" "$tmp/other.copy"
out_case --log "$tmp/other.jsonl" "--log '$tmp/other.jsonl' exists and is not a log of fsdp-train"
cmp -s "$tmp/other.jsonl" "$tmp/other.copy" && ok "--log left another program's {\"config\": ...} lines alone" ||
  bad "--log replaced another program's JSON lines"
out_case --log "$tmp/link.jsonl" "--log '$tmp/link.jsonl' is a symbolic link"
out_case --log "$tmp/log.fifo" "--log '$tmp/log.fifo' is not a regular file"
out_case --log /dev/full "--log '/dev/full' is not a regular file"
[ "$(cat "$tmp/user.txt")" = precious ] && ok "--log left the user's file alone" || bad "--log wrote the user's file"
for k in 1 2; do timeout -k 5 60 "$TRAIN" "${tiny[@]}" --log "$tmp/again.jsonl" > /dev/null 2>&1 || echo "exit $?" > "$tmp/again.rc"; done
[ ! -e "$tmp/again.rc" ] && [ "$(wc -l < "$tmp/again.jsonl")" -eq 3 ] && ok "a second run replaces its own --log" ||
  bad "--log over a log" "$(cat "$tmp/again.rc" 2> /dev/null)" "$(wc -l < "$tmp/again.jsonl")"
if [ -f /proc/version ] && [ ! -s /proc/version ]; then # a regular file whose writes fail
  timeout -k 5 60 "$TRAIN" "${tiny[@]}" --log /proc/version > /dev/null 2> "$tmp/lw"
  rc=$?
  [ $rc -ne 0 ] && grep -q -- "--log: writing '/proc/version' failed" "$tmp/lw" && ok "a --log write that fails ends the run (exit $rc)" ||
    bad "--log write failure" "exit $rc" "$(head -2 "$tmp/lw")"
fi

# ---- another run's checkpoints in --save-dir are never replaced ([Note: no run replaces another's checkpoints]) ----
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-dir "$tmp/runa" --save-every 1 > /dev/null 2>&1
sum_a=$(cat "$tmp"/runa/step-*/* | md5sum)
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --seed 7 --save-dir "$tmp/runa" --save-every 1 > "$tmp/rb" 2> "$tmp/rbe"
rc=$?
if [ $rc -eq 1 ] && grep -qF -- "--save-dir '$tmp/runa' holds $tmp/runa/step-00000002, a checkpoint after this run's start (step 0)" "$tmp/rbe" &&
   ! grep -q "^step" "$tmp/rb" && [ "$(cat "$tmp"/runa/step-*/* | md5sum)" = "$sum_a" ]; then
  ok "a fresh run is refused a --save-dir holding another run's checkpoints, which stay as they were"
else bad "fresh run over another's checkpoints" "exit $rc" "$(head -2 "$tmp/rbe")"; fi
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --steps 3 --override steps --resume "$tmp/runa" --save-dir "$tmp/runa" > "$tmp/rc3" 2>&1
rc=$?
[ $rc -eq 0 ] && [ -f "$tmp/runa/step-00000003/meta.json" ] && ok "the run resumed from its newest checkpoint saves into its --save-dir" ||
  bad "resume into the same --save-dir" "exit $rc" "$(grep -i error "$tmp/rc3" | head -2)"
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --steps 3 --override steps --resume "$tmp/runa/step-00000001" --save-dir "$tmp/runa" > /dev/null 2> "$tmp/rc4"
rc=$?
[ $rc -eq 1 ] && grep -qF "holds $tmp/runa/step-00000003, a checkpoint after this run's start (step 1)" "$tmp/rc4" &&
  ok "resuming an older checkpoint into a --save-dir with newer ones is refused" ||
  bad "resume of an older checkpoint" "exit $rc" "$(head -2 "$tmp/rc4")"
sum_1=$(cat "$tmp"/runa/step-00000001/* | md5sum)
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --steps 3 --override steps --resume "$tmp/runa/step-00000001" \
  --save-dir "$tmp/runa/step-00000001" > /dev/null 2> "$tmp/rc5"; rc=$?
if [ $rc -eq 1 ] && grep -qF -- "--save-dir '$tmp/runa/step-00000001' is itself a checkpoint (it holds meta.json)" "$tmp/rc5" &&
   [ "$(ls -A "$tmp/runa/step-00000001" | grep -c 'step-\|lock')" = 0 ] && [ "$(cat "$tmp"/runa/step-00000001/* | md5sum)" = "$sum_1" ]
then ok "a --save-dir that is itself a checkpoint is refused, the checkpoint as it was"
else bad "--save-dir a checkpoint" "exit $rc" "$(head -2 "$tmp/rc5")"; fi

# ---- a save that fails (no space left) removes what it made, and only that ----
# a 300 KiB tmpfs cannot hold the tiny model's checkpoint; skipped where mount is not allowed
mkdir "$tmp/small"
if mount -t tmpfs -o size=300k tmpfs "$tmp/small" 2> "$tmp/mnt"; then
  trap 'umount "$tmp/small"; rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/small/c3/step-00000002.tmp" # a crashed save's folder: not this save's to remove
  for c in "1 c1" "2 c2" "1 c3"; do
    read -r n d <<< "$c"
    timeout -k 5 120 "$TRAIN" "${tiny[@]}" --nproc $n --save-dir "$tmp/small/$d" > "$tmp/sp" 2> "$tmp/spe"; rc=$?
    left=$(cd "$tmp/small/$d" && ls -A | tr '\n' ' ')
    want=".lock "; [ $d = c3 ] && want=".lock step-00000002.tmp "
    if [ $rc -ne 0 ] && [ $rc -lt 124 ] && grep -q "saving $tmp/small/$d/step-00000002: .*No space left on device" "$tmp/spe" &&
       [ "$left" = "$want" ] && { [ $d != c3 ] || [ -z "$(ls -A "$tmp/small/c3/step-00000002.tmp")" ]; }; then
      ok "a save that runs out of space at $n rank(s) fails naming it and leaves only '$want'in --save-dir $d"
    else bad "out of space at $n rank(s), $d" "exit $rc, left: $left" "$(grep -m2 error "$tmp/spe")"; fi
  done
  umount "$tmp/small"
  trap 'rm -rf "$tmp"' EXIT
else echo "skip: out-of-space save: cannot mount a tmpfs here ($(head -1 "$tmp/mnt"))"; fi

# ---- two jobs on one --save-dir: the second stops at once, naming the first ----
"$TRAIN" --model tiny --steps 100000 --seq 32 --batch 4 --sample 0 --threads 1 --save-dir "$tmp/shared" \
  --save-every 100000 > "$tmp/j1" 2>&1 & # its pid is the trainer's (killed below)
j1=$!
for _ in $(seq 200); do grep -q "^step *2/" "$tmp/j1" && break; sleep 0.1; done
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-dir "$tmp/shared" > "$tmp/j2" 2> "$tmp/j2e"
rc=$?
kill $j1; wait $j1 2> /dev/null
if [ $rc -eq 1 ] && grep -q -- "--save-dir '$tmp/shared' is in use by another training job (pid $j1 on " "$tmp/j2e" &&
   ! grep -q "^step" "$tmp/j2" && [ "$(ls -A "$tmp/shared")" = ".lock" ]; then
  ok "a second job on the same --save-dir is refused, naming the first one's pid"
else bad "second job on one --save-dir" "exit $rc" "$(head -3 "$tmp/j2e")" "$(ls -A "$tmp/shared")"; fi
if timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-dir "$tmp/shared" > "$tmp/j3" 2>&1 && [ -f "$tmp/shared/step-00000002/meta.json" ]
then ok "the --save-dir is free again once the first job ended"
else bad "--save-dir after the first job" "$(tail -3 "$tmp/j3")"; fi

# ---- --resume with --steps at or below the checkpoint's step: nothing to train ----
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --resume "$tmp/shared" --steps 2 --log "$tmp/nl.jsonl" > "$tmp/nl" 2>&1
rc=$?
if [ $rc -eq 0 ] && grep -q "nothing left to train: $tmp/shared/step-00000002 is at step 2 and --steps is 2" "$tmp/nl" &&
   ! grep -qE "^step|^summary" "$tmp/nl"; then ok "--resume at step 2 with --steps 2: nothing left to train, exit 0"
else bad "--resume with nothing left" "exit $rc" "$(head -3 "$tmp/nl")"; fi

# ---- smaller flag checks ----
flag_case() { # WANT-EXIT PATTERN ARGS...: fsdp-train ARGS exits WANT-EXIT naming PATTERN
  local want=$1 pat=$2; shift 2
  timeout 60 "$TRAIN" "$@" > /dev/null 2> "$tmp/fc"
  local rc=$?
  [ $rc -eq "$want" ] && grep -qF -- "$pat" "$tmp/fc" && ok "fsdp-train $*: exit $rc naming it" ||
    bad "fsdp-train $*" "exit $rc" "$(head -2 "$tmp/fc")"
}
flag_case 2 "unknown flag '--bogus'" "${tiny[@]}" --bogus
flag_case 2 "--steps needs a value" "${tiny[@]}" --steps
flag_case 2 "'--steps=3': give the value as the next argument ('--steps 3')" "${tiny[@]}" --steps=3
flag_case 1 "--resume: '$tmp/no-such-ckpt': No such file or directory" "${tiny[@]}" --resume "$tmp/no-such-ckpt"
timeout 60 "$TRAIN" "${tiny[@]}" --lr 1e-3 --min-lr 1e-2 > /dev/null 2> "$tmp/ml"
rc=$?
[ $rc -eq 2 ] && grep -q -- "--min-lr 0.01 is above --lr 0.001" "$tmp/ml" && ok "--min-lr above --lr is a usage error" ||
  bad "--min-lr above --lr" "exit $rc" "$(head -2 "$tmp/ml")"
cpus=$(getconf _NPROCESSORS_ONLN)
timeout 60 "$TRAIN" --model tiny --steps 1 --seq 32 --batch 4 --sample 0 --threads $((cpus * 8)) > /dev/null 2> "$tmp/th"
rc=$?
[ $rc -eq 0 ] && grep -q -- "warning: --threads $((cpus * 8)) is more than the $cpus CPUs of this host" "$tmp/th" &&
  ok "--threads $((cpus * 8)) on $cpus CPUs warns" || bad "--threads far above the cores" "exit $rc" "$(head -2 "$tmp/th")"

# ---- fsdp-ckpt verify rejects what --resume rejects: a resealed meta.json at odds with its model ----
reseal_edit() { # META PYTHON: edit the parsed meta.json `m`, write it back sealed
  python3 - "$1" "$2" <<'PY'
import json, sys
path, code = sys.argv[1], sys.argv[2]
m = json.load(open(path))
exec(code)
def text(): return json.dumps(m, indent='\t', separators=(',', ':\t'))
m['crc32c'] = '00000000'
crc = 0xffffffff
for b in text().encode():
    crc ^= b
    for _ in range(8): crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
m['crc32c'] = '%08x' % (crc ^ 0xffffffff)
open(path, 'w').write(text())
PY
}
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --save-dir "$tmp/vck" > /dev/null 2>&1
good="$tmp/vck/step-00000002"
if "$BUILD/fsdp-ckpt" verify "$good" > "$tmp/v0" 2>&1 && grep -q "model_config: the parameters are exactly the model's" "$tmp/v0"
then ok "fsdp-ckpt verify checks a checkpoint's parameters against its model_config"
else bad "verify of a good checkpoint" "$(tail -3 "$tmp/v0")"; fi
verify_case() { # NAME EDIT PATTERN
  rm -rf "$tmp/vbad"; cp -r "$good" "$tmp/vbad"; reseal_edit "$tmp/vbad/meta.json" "$2"
  "$BUILD/fsdp-ckpt" verify "$tmp/vbad" > "$tmp/v1" 2>&1
  local rc=$?
  timeout -k 5 60 "$TRAIN" --steps 4 --seq 32 --batch 4 --sample 0 --threads 1 --resume "$tmp/vbad" > "$tmp/v2" 2>&1
  local rc2=$?
  if [ $rc -eq 1 ] && grep -qE -- "$3" "$tmp/v1" && [ $rc2 -ne 0 ]; then ok "verify and --resume both reject $1"
  else bad "verify vs --resume: $1" "verify exit $rc, resume exit $rc2" "$(tail -2 "$tmp/v1")" "$(tail -1 "$tmp/v2")"; fi
}
verify_case "a model_config with another n_layer" "m['model_config']['n_layer'] = 3" \
  "meta.json: parameter 'transformer.h.2.[a-z0-9_.]*' of the model \(n_layer 3 .*\) is not in the file"
verify_case "a model_config with another n_embd" "m['model_config']['n_embd'] = 64" \
  "meta.json: parameter 'transformer.wte.weight' has shape \\[256, 32\\], the model \\(.*n_embd 64.*\\) needs \\[256, 64\\]"
verify_case "a meta.json lacking a parameter" \
  "m['params'] = [p for p in m['params'] if p['fqn'] != 'transformer.h.1.mlp.c_fc.weight']" \
  "meta.json: parameter 'transformer.h.1.mlp.c_fc.weight' of the model .* is not in the file"

# ---- SIGKILL of mpirun: a rank notices its launcher's death itself, even inside a collective ----
# Rank 1 stops itself (SIGSTOP) in step 3's forward, so rank 0 waits in a collective for a live
# peer; then mpirun is killed and rank 1 continued. This script adopts the orphaned ranks
# (PR_SET_CHILD_SUBREAPER) to read how they ended: exit 1 from their own launcher check (Open
# MPI's own detection, a second or two later, ends them with exit 195 after training on).
python3 - "$TRAIN" > "$tmp/pk" 2>&1 <<'PY'
import ctypes, os, signal, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
env = dict(os.environ, FSDP_FAULT='forward:1:3:stop', OMPI_MCA_rmaps_base_oversubscribe='1')
p = subprocess.Popen([sys.argv[1], '--model', 'tiny', '--steps', '100000', '--seq', '32', '--batch', '4', '--sample',
                      '0', '--threads', '1', '--nproc', '2', '--collective-timeout', '120'], env=env,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # exec's mpirun: p.pid is mpirun
ranks = {}
for _ in range(600):
    for r in os.popen('ps -o pid= --ppid %d' % p.pid).read().split():
        try: env_r = open('/proc/%s/environ' % r, 'rb').read().split(b'\0')
        except OSError: continue
        for kv in env_r:
            if kv.startswith(b'OMPI_COMM_WORLD_RANK='): ranks[int(kv.split(b'=')[1])] = int(r)
    try:
        if 1 in ranks and open('/proc/%d/stat' % ranks[1]).read().split()[2] == 'T': break
    except OSError: pass
    time.sleep(0.1)
p.kill(); p.wait()
if 1 in ranks: os.kill(ranks[1], signal.SIGCONT)
res, t0 = {}, time.time()
while len(res) < len(ranks) and time.time() - t0 < 60:
    try: pid, st = os.waitpid(-1, os.WNOHANG)
    except ChildProcessError: break
    if pid == 0: time.sleep(0.05); continue
    for k, v in ranks.items():
        if v == pid: res[k] = 'exit %d' % os.WEXITSTATUS(st) if os.WIFEXITED(st) else 'signal %d' % os.WTERMSIG(st)
for v in ranks.values():
    try: os.kill(v, signal.SIGKILL)
    except OSError: pass
print('rank 0: %s; rank 1: %s' % (res.get(0), res.get(1)))
PY
if grep -q "^rank 0: exit 1; rank 1: exit 1$" "$tmp/pk"; then ok "after mpirun's SIGKILL both ranks end by their own launcher check ($(cat "$tmp/pk"))"
else bad "ranks after mpirun's SIGKILL" "$(tail -3 "$tmp/pk")"; fi

# ---- a world of more than one rank on the self backend is an error, not N separate jobs ----
timeout -k 5 60 "$TRAIN" "${tiny[@]}" --nproc 2 --comm self > "$tmp/s1" 2> "$tmp/s1e"
rc=$?
if [ $rc -eq 2 ] && grep -q -- "--comm self is a world of one rank, but 2 ranks were asked for" "$tmp/s1e" &&
   ! grep -q "^step" "$tmp/s1"; then ok "--nproc 2 --comm self is a usage error"
else bad "--nproc 2 --comm self" "exit $rc" "$(head -3 "$tmp/s1e")"; fi

# ---- an input one host lacks ([Note: setup agreement]): every rank ends at once, the failing rank's message
# printed (it waited 300 s in the next collective, and rank 1's message was never printed) ----
mkdir -p "$tmp/h0" "$tmp/h1" "$tmp/h0/ck" "$tmp/h1/ck"
head -c 20000 /dev/urandom > "$tmp/h0/d.txt"
one=(--model tiny --seq 32 --batch 4 --steps 2 --threads 1 --sample 0 --collective-timeout 60)
mpmd() { # mpmd OUT ARGS...: rank 0 in $tmp/h0, rank 1 in $tmp/h1, the same command line
  local out=$1 exe; shift
  exe=$(readlink -f "$TRAIN")
  timeout -k 5 120 mpirun --oversubscribe -np 1 -wdir "$tmp/h0" "$exe" "$@" : -np 1 -wdir "$tmp/h1" "$exe" "$@" \
    > "$out" 2>&1
}
mpmd "$tmp/m1" "${one[@]}" --data d.txt; rc=$?
if [ $rc = 1 ] && grep -q "error: rank 1 (1 of 2 ranks failed here, the others did not): --data: .*d.txt" "$tmp/m1" &&
   ! grep -q "collective timeout" "$tmp/m1" && ! grep -q "^step" "$tmp/m1"; then
  ok "--data missing on one host: every rank exits 1 before any step, rank 1's message naming the file"
else bad "--data missing on one host" "exit $rc" "$(grep -v '^ *$' "$tmp/m1" | head -4)"; fi
# a --save-dir only rank 0's host has: refused before step 1 (a run trained to its end, then could not save)
# a --data or --val-data whose copies differ between the hosts ([Note: the same data on every rank]): every rank
# ends before step 1 naming the file (another size of --val-data ran different collectives at the first
# evaluation: Open MPI aborted; another --data trained on batches no one asked for, silently)
head -c 20000 /dev/urandom > "$tmp/h1/d.txt"
mpmd "$tmp/m8" "${one[@]}" --data d.txt; rc=$?
if [ $rc = 1 ] && grep -q "error: --data 'd.txt': the ranks do not read the same data (20000 tokens on rank 0 and on rank 1, but other contents)" "$tmp/m8" &&
   ! grep -q "^step" "$tmp/m8"; then ok "--data of one size but other contents on rank 1's host: every rank exits 1 before step 1, naming it"
else bad "--data differing between hosts" "exit $rc" "$(grep -v '^ *$' "$tmp/m8" | head -4)"; fi
cp "$tmp/h0/d.txt" "$tmp/h1/d.txt"
head -c 3000 /dev/urandom > "$tmp/h0/v.txt" && head -c 6000 /dev/urandom > "$tmp/h1/v.txt"
mpmd "$tmp/m9" "${one[@]}" --data d.txt --val-data v.txt --eval-every 1 --comm mpi; rc=$?
if [ $rc = 1 ] && grep -q "error: --val-data 'v.txt': the ranks do not read the same data (3000 tokens on rank 0, 6000 on rank 1)" "$tmp/m9" &&
   ! grep -q "^step\|MPI_ERR" "$tmp/m9"; then ok "--val-data of another size on rank 1's host (Open MPI): every rank exits 1 before step 1, naming both counts"
else bad "--val-data differing between hosts" "exit $rc" "$(grep -v '^ *$' "$tmp/m9" | head -4)"; fi
mkdir -p "$tmp/h0/par"
mpmd "$tmp/m4" "${one[@]}" --data d.txt --save-dir par/sd; rc=$?
if [ $rc = 1 ] && grep -q "error: rank 1 (1 of 2 ranks failed here, the others did not): --save-dir 'par/sd' is not a folder on this rank's host" "$tmp/m4" &&
   ! grep -q "^step" "$tmp/m4"; then ok "--save-dir missing on rank 1's host: every rank exits 1 before step 1, naming it"
else bad "--save-dir missing on one host" "exit $rc" "$(grep -v '^ *$' "$tmp/m4" | head -4)"; fi
# a --save-dir of one name on each host's own disk: refused before step 1 (the first save failed, after
# --save-every steps of training, naming a rank file rank 0 could not open); one folder reached by two
# paths (a link on one host) is one folder and trains
mkdir -p "$tmp/h1/par/sd" && echo "pid 1 on elsewhere" > "$tmp/h1/par/sd/.lock"
mpmd "$tmp/m6" "${one[@]}" --data d.txt --save-dir par/sd --save-every 1; rc=$?
if [ $rc = 1 ] && grep -q "error: rank 1 (1 of 2 ranks failed here, the others did not): --save-dir 'par/sd' on this rank's host is not the folder rank 0 locked (its .lock holds \"pid 1 on elsewhere\", rank 0 wrote \"pid [0-9]* on .*\"): every rank writes its file there, so the ranks must share one folder" "$tmp/m6" &&
   ! grep -q "^step" "$tmp/m6" && [ ! -e "$tmp/h0/par/sd/step-00000001" ] &&
   [ "$(cat "$tmp/h1/par/sd/.lock")" = "pid 1 on elsewhere" ]; then
  ok "--save-dir on each host's own disk: every rank exits 1 before step 1, naming both locks; rank 1's lock untouched"
else bad "--save-dir not shared" "exit $rc" "$(grep -v '^ *$' "$tmp/m6" | head -4)"; fi
rm -rf "$tmp/h1/par/sd" && ln -s "$tmp/h0/par/sd" "$tmp/h1/par/sd"
mpmd "$tmp/m7" "${one[@]}" --data d.txt --save-dir par/sd --save-every 1; rc=$?
if [ $rc = 0 ] && [ -e "$tmp/h0/par/sd/step-00000002/meta.json" ]; then ok "--save-dir shared through a link on one host: trains and saves"
else bad "--save-dir shared through a link" "exit $rc" "$(grep -v '^ *$' "$tmp/m7" | tail -4)"; fi
# a --resume folder whose newest checkpoint differs between the hosts
timeout -k 5 120 "$TRAIN" "${one[@]}" --nproc 2 --save-dir "$tmp/h0/ck" --save-every 1 > "$tmp/m2" 2>&1 ||
  bad "2 steps saved" "$(tail -2 "$tmp/m2")"
cp -r "$tmp/h0/ck/step-00000001" "$tmp/h1/ck/"
mpmd "$tmp/m3" --threads 1 --sample 0 --collective-timeout 60 --resume ck --steps 4 --override steps; rc=$?
if [ $rc = 2 ] && grep -q "error: --resume ck/step-00000002: the ranks found different checkpoints there (step 2 on rank 0, step 1 on rank 1)" "$tmp/m3" &&
   ! grep -q "^step" "$tmp/m3"; then
  ok "--resume of a folder whose newest checkpoint differs between hosts: every rank exits 2 before any step, naming both"
else bad "--resume of different checkpoints" "exit $rc" "$(grep -v '^ *$' "$tmp/m3" | head -4)"; fi
# the same where rank 0's checkpoint has nothing left to train (it returned alone, rank 1 waited)
mpmd "$tmp/m5" --threads 1 --sample 0 --collective-timeout 60 --resume ck; rc=$?
if [ $rc = 2 ] && grep -q "the ranks found different checkpoints there (step 2 on rank 0, step 1 on rank 1)" "$tmp/m5" &&
   ! grep -q "^step\|nothing left" "$tmp/m5"; then
  ok "--resume where one rank's checkpoint has nothing left to train: every rank exits 2, naming both steps"
else bad "--resume with nothing left on one rank" "exit $rc" "$(grep -v '^ *$' "$tmp/m5" | head -4)"; fi

# ---- non-finite values: SGD at lr 10 diverges to nan (at step 10 today) ----
div=(--model tiny --steps 30 --lr 10 --optim sgd --clip 0 --warmup 0 --lr-schedule constant --batch 4 --seq 32
     --sample 0 --threads 1)
for n in 1 2; do
  timeout -k 5 120 "$TRAIN" "${div[@]}" --nproc $n > "$tmp/n$n" 2> "$tmp/n${n}e"
  rc=$?
  pat="step ([0-9]+): non-finite loss \(loss .*nan, grad norm .*nan\); first non-finite gradient in unit 'transformer.h.1' \(backward order\)"
  msgs=$(grep -cE "$pat" "$tmp/n${n}e")
  at=$(sed -nE "s/.*step ([0-9]+): non-finite.*/\1/p" "$tmp/n${n}e" | head -1)
  if [ $rc -ne 0 ] && [ $rc -ne 124 ] && [ "$msgs" -eq 1 ] && [ "$(grep -c "^step" "$tmp/n$n")" -eq $((${at:-0} - 1)) ]; then
    ok "nan at step $at stops the run at $n rank(s) with one message naming step and unit"
  else bad "nan at $n rank(s)" "exit $rc, $msgs messages" "$(head -3 "$tmp/n${n}e")"; fi
done

finish
