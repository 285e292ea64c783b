#!/usr/bin/env bash
# t_ckpt_foreign.sh - no checkpoint writer deletes or replaces a file it did not
# make ([Note: only our own files], src/fsdp/ckpt/ckpt.c and src/io/st_write.c):
# every writer (fsdp-ckpt to-sharded and to-full, fsdp-train --save-dir,
# --save-full, --keep-last and the save SIGUSR1 asks for; --autoresume's
# search) is pointed at a target that already holds foreign
# files, a regular file, an existing --save-dir, or a foreign ".tmp" sibling,
# or files that only bear a checkpoint's names, or a checkpoint's rank file
# for a full file; and a rank file of another save, which verify and --resume
# name ([Note: files of one save]).
# Each must exit non-zero (the trainer on every rank) naming the file, and
# leave every foreign byte where it was; replacing our own output still works.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"
CKPT="$BUILD/fsdp-ckpt"
common=(--model tiny --data synthetic --batch 4 --seq 16 --lr 1e-3 --threads 1 --sample 0)
train() { timeout -k 5 120 "$TRAIN" "${common[@]}" "$@"; }
cd "$tmp"
BIN=$OLDPWD/$BUILD
CKPT="$BIN/fsdp-ckpt" TRAIN="$BIN/fsdp-train"

# a checkpoint of ours to convert, and the foreign things to protect
train --steps 2 --save-full full.safetensors > train.out 2>&1 || bad "setup: --save-full" "$(tail -3 train.out)"
intact() { # FILE CONTENT: the file still holds exactly CONTENT
  [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]
}
refused() { # NAME EXPECTED-WORD OUTFILE RC
  if [ "$4" -ne 0 ] && grep -q -- "$2" "$3"; then return 0; fi
  bad "$1: exit $4, expected an error naming '$2'" "$(tail -3 "$3")"; return 1
}

# 1. to-sharded into a folder of notes
mkdir u && echo "my notes" > u/notes.txt
"$CKPT" to-sharded full.safetensors u 1 > o 2>&1; rc=$?
refused to_sharded_foreign_folder notes.txt o $rc &&
  { intact u/notes.txt "my notes" && [ "$(ls u)" = notes.txt ] && [ ! -e u.tmp ] && ok to_sharded_foreign_folder ||
    bad to_sharded_foreign_folder "u holds: $(ls u)" "u.tmp: $(ls -d u.tmp 2>&1)"; }

# 2. to-sharded onto a regular file
echo "a file" > f
"$CKPT" to-sharded full.safetensors f 1 > o 2>&1; rc=$?
refused to_sharded_regular_file "f: exists and is not a folder" o $rc &&
  { intact f "a file" && [ ! -e f.tmp ] && ok to_sharded_regular_file || bad to_sharded_regular_file "$(ls)"; }

# 3. to-sharded onto an existing --save-dir (step folders inside)
train --steps 2 --save-dir run --save-every 1 > o 2>&1 || bad "setup: --save-dir" "$(tail -3 o)"
before=$(cd run && find . | sort | md5sum)
"$CKPT" to-sharded full.safetensors run 1 > o 2>&1; rc=$?
refused to_sharded_save_dir "step-0000000" o $rc &&
  { [ "$(cd run && find . | sort | md5sum)" = "$before" ] && ok to_sharded_save_dir || bad to_sharded_save_dir "$(ls -R run)"; }

# 4. to-sharded with a foreign folder at DIR.tmp
mkdir w.tmp && echo "keep me" > w.tmp/data.csv
"$CKPT" to-sharded full.safetensors w 1 > o 2>&1; rc=$?
refused to_sharded_foreign_tmp data.csv o $rc &&
  { intact w.tmp/data.csv "keep me" && [ ! -e w ] && ok to_sharded_foreign_tmp || bad to_sharded_foreign_tmp "$(ls -R)"; }

# 5. to-sharded over our own checkpoint at another file count: replaced, stale files gone
"$CKPT" to-sharded full.safetensors v 3 > o 2>&1 && "$CKPT" to-sharded full.safetensors v 2 > o2 2>&1 &&
  [ "$(ls v | tr '\n' ' ')" = "meta.json rank-00000-of-00002.safetensors rank-00001-of-00002.safetensors " ] &&
  "$CKPT" verify v > o3 2>&1 && ok to_sharded_replaces_own || bad to_sharded_replaces_own "$(cat o o2 o3 | tail -5)" "$(ls v)"

# 6. to-full onto a foreign file, and with a foreign FILE.tmp
echo "results" > g
"$CKPT" to-full v g > o 2>&1; rc=$?
refused to_full_foreign_file "g: exists and was not written by fsdp.c" o $rc &&
  { intact g results && [ ! -e g.tmp ] && ok to_full_foreign_file || bad to_full_foreign_file "$(ls)"; }
echo "draft" > h.tmp
"$CKPT" to-full v h > o 2>&1; rc=$?
refused to_full_foreign_tmp "h.tmp" o $rc && { intact h.tmp draft && [ ! -e h ] && ok to_full_foreign_tmp || bad to_full_foreign_tmp "$(ls)"; }
mkfifo p.safetensors
timeout 20 "$CKPT" to-full v p.safetensors > o 2>&1; rc=$?
refused to_full_fifo "not a regular file" o $rc && { [ -p p.safetensors ] && ok to_full_fifo || bad to_full_fifo "$(ls -l)"; }

# 7. to-full over our own file, and over a crashed save's .tmp: both replaced
cut_after_header='import struct,sys; b=open(sys.argv[1],"rb").read(); n=struct.unpack("<Q",b[:8])[0]; open(sys.argv[2],"wb").write(b[:8+n+16])'
"$CKPT" to-full v k > o 2>&1 && python3 -c "$cut_after_header" k k.tmp && "$CKPT" to-full v k > o2 2>&1 && [ ! -e k.tmp ] &&
  "$CKPT" verify k > o3 2>&1 && ok to_full_replaces_own || bad to_full_replaces_own "$(cat o o2 o3 | tail -5)"

# 8. fsdp-train --save-full onto a foreign file, at 2 ranks: every rank fails, the file stays
echo "thesis" > t.safetensors
train --nproc 2 --steps 1 --save-full t.safetensors > o 2>&1; rc=$?
refused save_full_foreign "t.safetensors: exists and was not written by fsdp.c" o $rc &&
  { intact t.safetensors thesis && ok save_full_foreign || bad save_full_foreign "$(ls)"; }

# 8b. a full file saved over a checkpoint's rank file (ours, but another kind: the checkpoint would
# lose its shard), by fsdp-ckpt to-full and by fsdp-train --save-full before step 1: refused
train --steps 1 --save-dir rk > o 2>&1 || bad "setup: a checkpoint" "$(tail -3 o)"
rf=rk/step-00000001/rank-00000-of-00001.safetensors
sum=$(md5sum < $rf)
"$CKPT" to-full rk/step-00000001 $rf > o 2>&1; rc=$?
train --steps 1 --save-full $rf > o2 2>&1; rc2=$?
refused to_full_over_rank_file "$rf: exists and is another kind of fsdp.c file" o $rc &&
  refused save_full_over_rank_file "$rf: exists and is another kind of fsdp.c file" o2 $rc2 &&
  { [ "$(md5sum < $rf)" = "$sum" ] && ! grep -q "^step" o2 && "$CKPT" verify rk/step-00000001 > o3 2>&1 &&
    ok full_over_rank_file || bad full_over_rank_file "$(tail -2 o3)"; }

# 9. fsdp-train --save-dir whose step folder holds a foreign file, at 2 ranks: refused
#    before step 1 (the writer's own check, [Note: output preflight]), not at that save
no_step() { ! grep -q "^step " "$1"; }
mkdir -p s/step-00000001 && echo "plot" > s/step-00000001/loss.png
train --nproc 2 --steps 1 --save-dir s > o 2>&1; rc=$?
refused save_dir_foreign_step loss.png o $rc &&
  { intact s/step-00000001/loss.png plot && [ ! -e s/step-00000001/meta.json ] && no_step o && ok save_dir_foreign_step ||
    bad save_dir_foreign_step "$(ls -R s)" "$(grep -c '^step ' o) step lines"; }
mkdir -p s2/step-00000001.tmp && echo "log" > s2/step-00000001.tmp/run.log
train --steps 1 --save-dir s2 > o 2>&1; rc=$?
refused save_dir_foreign_tmp run.log o $rc &&
  { intact s2/step-00000001.tmp/run.log log && no_step o && ok save_dir_foreign_tmp || bad save_dir_foreign_tmp "$(ls -R s2)"; }
# 9b. the same at a later save (--save-every), sharded and full: named before step 1; a foreign
#     step-N at a step the run does not save is left alone and the run saves its own
mkdir -p s3/step-00000004 && echo "plot" > s3/step-00000004/loss.png
train --nproc 2 --steps 4 --save-every 2 --save-dir s3 > o 2>&1; rc=$?
refused save_dir_foreign_later "this run saves step 4 as s3/step-00000004, and s3/step-00000004: holds 'loss.png'" o $rc &&
  { intact s3/step-00000004/loss.png plot && no_step o && [ ! -e s3/step-00000002 ] && ok save_dir_foreign_later ||
    bad save_dir_foreign_later "$(ls -R s3)"; }
mkdir -p s4 && echo "table" > s4/step-00000002.safetensors
train --steps 3 --save-every 2 --save-dir s4 --state-dict-type full > o 2>&1; rc=$?
refused save_dir_foreign_full "s4/step-00000002.safetensors: exists and was not written by fsdp.c" o $rc &&
  { intact s4/step-00000002.safetensors table && no_step o && ok save_dir_foreign_full || bad save_dir_foreign_full "$(ls s4)"; }
mkdir -p s5 && echo "table" > s5/step-00000001.safetensors
if train --steps 2 --save-every 2 --save-dir s5 --state-dict-type full > o 2>&1 &&
   intact s5/step-00000001.safetensors table && [ -f s5/step-00000002.safetensors ]; then ok save_dir_foreign_unsaved_step
else bad save_dir_foreign_unsaved_step "$(ls s5)" "$(tail -3 o)"; fi

# 10. --keep-last keeps an old checkpoint folder that holds a foreign file (and says so)
train --steps 3 --save-dir q --save-every 1 --keep-last 1 > o 2>&1 || bad "setup: --keep-last" "$(tail -3 o)"
rm -rf q && train --steps 1 --save-dir q > o 2>&1 && echo "mine" > q/step-00000001/extra.txt &&
  train --steps 3 --override steps --save-dir q --resume q --save-every 1 --keep-last 1 > o 2>&1; rc=$?
if [ $rc -eq 0 ] && intact q/step-00000001/extra.txt mine && [ -f q/step-00000003/meta.json ] &&
   [ ! -e q/step-00000002 ] && grep -q "extra.txt" o; then ok keep_last_keeps_foreign
else bad keep_last_keeps_foreign "exit $rc" "$(ls -R q)" "$(tail -3 o)"; fi

# 10b. files named as a checkpoint's but not ours (a meta.json without its seal, a rank file
#      without our checksums) are the user's: --keep-last keeps them, a save does not write over them
mkdir -p kl/step-00000000 && echo '{"my":"settings"}' > kl/step-00000000/meta.json &&
  echo userbin > kl/step-00000000/rank-00000-of-00001.safetensors
train --steps 2 --save-dir kl --save-every 1 --keep-last 1 > o 2>&1; rc=$?
if [ $rc -eq 0 ] && intact kl/step-00000000/meta.json '{"my":"settings"}' &&
   intact kl/step-00000000/rank-00000-of-00001.safetensors userbin && [ -f kl/step-00000002/meta.json ]; then
  ok keep_last_keeps_lookalikes
else bad keep_last_keeps_lookalikes "exit $rc" "$(ls -R kl)"; fi
mkdir -p kl2/step-00000001 && echo userrank > kl2/step-00000001/rank-00000-of-00002.safetensors
train --nproc 2 --steps 1 --save-dir kl2 > o 2>&1; rc=$?
refused save_over_lookalike "holds 'rank-00000-of-00002.safetensors', which no checkpoint writer made" o $rc &&
  { intact kl2/step-00000001/rank-00000-of-00002.safetensors userrank && ok save_over_lookalike ||
    bad save_over_lookalike "$(ls -R kl2)"; }
mkdir -p kl3 && echo "my lock notes" > kl3/.lock
train --steps 1 --save-dir kl3 > o 2>&1; rc=$?
refused save_dir_foreign_lock "holds '.lock', which fsdp-train did not write" o $rc &&
  { intact kl3/.lock "my lock notes" && ok save_dir_foreign_lock || bad save_dir_foreign_lock "$(cat kl3/.lock)"; }

# 10d. the trainer's own choices of where to save or resume: a save that SIGUSR1 asks for (at a
#      step no --save-every named, so the preflight did not look there) refuses a step folder of
#      the user's and names it; --autoresume does not take a lookalike folder for a checkpoint
for k in $(seq 1 200); do d=su/$(printf step-%08d "$k"); mkdir -p "$d" && echo "notes $k" > "$d/notes.txt"; done
"$TRAIN" "${common[@]}" --steps 100000 --save-dir su --save-every 100000 --log su.jsonl > o 2>&1 &
pid=$! # signalled once the log's first line is out (flushed just before step 1; stdout is buffered)
for _ in $(seq 1200); do [ -s su.jsonl ] && break; sleep 0.05; done
(sleep 120 && kill -9 $pid) > /dev/null 2>&1 & guard=$!
kill -USR1 $pid 2> /dev/null; wait $pid; rc=$?
pkill -P $guard 2> /dev/null; kill $guard 2> /dev/null
n=$(sed -n 's/^stopping after step \([0-9]*\) .*/\1/p' o)
if refused sigusr1_save_foreign "notes.txt', which no checkpoint writer made" o $rc; then
  bad_left=0
  for k in $(seq 1 200); do intact "su/$(printf step-%08d "$k")/notes.txt" "notes $k" || bad_left=1; done
  [ $bad_left -eq 0 ] && [ -z "$n" ] && ok sigusr1_save_foreign ||
    bad sigusr1_save_foreign "notes changed: $bad_left; stopped at '$n'" "$(ls -R su | head -8)"
fi
mkdir -p ar/step-00000009 && echo '{"my":"settings"}' > ar/step-00000009/meta.json
train --steps 2 --save-dir ar --autoresume > o 2>&1; rc=$?
if [ $rc -eq 0 ] && grep -q "autoresume: no checkpoint in ar yet: starting afresh" o &&
   intact ar/step-00000009/meta.json '{"my":"settings"}' && [ -f ar/step-00000002/meta.json ]; then
  ok autoresume_skips_lookalike
else bad autoresume_skips_lookalike "exit $rc" "$(grep autoresume o)" "$(ls -R ar)"; fi

# 10c. a rank file of another save is named before any of it is read ([Note: files of one save])
train --nproc 2 --steps 4 --save-dir mx --save-every 2 > o 2>&1 || bad "setup: two saves" "$(tail -3 o)"
cp -r mx/step-00000004 mixed && cp mx/step-00000002/rank-00001-of-00002.safetensors mixed/
"$CKPT" verify mixed > o 2>&1; rc=$?
refused verify_mixed_saves "mixed/rank-00001-of-00002.safetensors: not the file this checkpoint's meta.json was saved with" o $rc &&
  ok verify_mixed_saves
train --nproc 2 --steps 5 --override steps --resume mixed > o 2>&1; rc=$?
refused resume_mixed_saves "rank-00001-of-00002.safetensors: not the file this checkpoint's meta.json was saved with" o $rc &&
  { ! grep -q "^step" o && ok resume_mixed_saves || bad resume_mixed_saves "a step ran" "$(grep "^step" o | head -2)"; }
"$CKPT" verify mx/step-00000004 > o 2>&1 && ok verify_one_save || bad verify_one_save "$(tail -2 o)"

# 11. fsdp-tokenize: an existing OUT (or OUT.tmp) that is not a token file, and a --decode
#     OUT, are refused; its own earlier output is replaced
mkdir tok && python3 - tok <<'PY'
import json, sys
bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256)); cs = bs[:]; n = 0
for b in range(256):
    if b not in bs: bs.append(b); cs.append(256 + n); n += 1
json.dump({chr(c): i for i, c in enumerate(cs)}, open(sys.argv[1] + '/encoder.json', 'w'))
open(sys.argv[1] + '/vocab.bpe', 'w').write('#version: 0.2\n')
PY
TOK="$BIN/fsdp-tokenize"
echo "some text to encode" > in.txt
echo "my essay" > essay.bin
"$TOK" --tokenizer tok in.txt essay.bin > o 2>&1; rc=$?
refused tokenize_foreign_out "essay.bin' exists and is not an llm.c token file" o $rc &&
  { intact essay.bin "my essay" && [ ! -e essay.bin.tmp ] && ok tokenize_foreign_out || bad tokenize_foreign_out "$(ls)"; }
echo "draft" > t2.bin.tmp
"$TOK" --tokenizer tok in.txt t2.bin > o 2>&1; rc=$?
refused tokenize_foreign_tmp "t2.bin.tmp" o $rc && { intact t2.bin.tmp draft && ok tokenize_foreign_tmp || bad tokenize_foreign_tmp; }
"$TOK" --tokenizer tok in.txt t3.bin > o 2>&1 && "$TOK" --tokenizer tok in.txt t3.bin > o2 2>&1 &&
  ok tokenize_replaces_own || bad tokenize_replaces_own "$(cat o o2 | tail -3)"
echo "notes" > back.txt
"$TOK" --tokenizer tok --decode t3.bin back.txt > o 2>&1; rc=$?
refused tokenize_decode_foreign "back.txt' exists" o $rc && { intact back.txt notes && ok tokenize_decode_foreign || bad tokenize_decode_foreign; }
finish
