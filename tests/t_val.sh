#!/usr/bin/env bash
# t_val.sh - fsdp-train --val-data: a GPT's held-out loss and perplexity
# (eval mode, sharded). The loss of given parameters is the 1-rank value at 1
# to 4 ranks (the same global batches, sums added in sequence order); training
# with evaluation is bit-identical to training without; a token file and the
# same text read as bytes evaluate alike; --eval-batches reads at most the
# whole file once; a bad --val-data (one shorter than an evaluation batch:
# at startup) is one line naming the file. Prints "N passed, N failed".
. "$(dirname "$0")/lib.sh"
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none

python3 - "$tmp" <<'EOF'
import random, struct, sys
d = sys.argv[1]
random.seed(7)
words = "the cat sat on a mat and the dog ran far away from home while it rained".split()
text = " ".join(random.choice(words) for _ in range(1500)).encode()[:3000]
open(f"{d}/val.txt", "wb").write(text)
hdr = [0] * 256; hdr[0] = 20240520; hdr[1] = 1; hdr[2] = len(text)
open(f"{d}/val.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack(f"<{len(text)}H", *text))
hdr[2] = 100
open(f"{d}/bigtok.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack("<100H", *([65] * 70 + [300] + [65] * 29)))
open(f"{d}/short.txt", "wb").write(b"too short")
open(f"{d}/other.txt", "wb").write(bytes(random.randrange(97, 123) for _ in range(3000))) # other text
EOF
common=(--model tiny --data synthetic --batch 12 --seq 32 --lr 3e-3 --warmup 2 --threads 1 --sample 0)
field() { python3 -c 'import json,sys; print([r for r in map(json.loads, open(sys.argv[1])) if sys.argv[2] in r][-1][sys.argv[2]])' "$1" "$2"; }

# ---- the same parameters give the 1-rank held-out loss at 1..4 ranks ----
# trained 3 steps on 1 rank; each world resumes and takes one step with lr 0 (AdamW moves nothing),
# then evaluates 3 global batches of 10 sequences (uneven shares at 3 and 4 ranks)
"$TRAIN" "${common[@]}" --steps 3 --save-dir "$tmp/ck" > "$tmp/o" 2>&1 || bad "train 3 steps" "$(tail -3 "$tmp/o")"
ref="" allsame=1 detail=()
for n in 1 2 3 4; do
  if ! timeout -k 5 120 "$TRAIN" --resume "$tmp/ck" --steps 4 --lr 0 --min-lr 0 --override steps,lr,min-lr --nproc $n \
       --val-data "$tmp/val.txt" --eval-batch 10 --eval-batches 3 --log "$tmp/e$n.jsonl" > "$tmp/e$n" 2>&1; then
    bad "evaluation at $n ranks" "$(tail -3 "$tmp/e$n")"; allsame=0; continue
  fi
  v=$(field "$tmp/e$n.jsonl" eval_loss); detail+=("$n ranks: $v")
  [ -z "$ref" ] && ref=$v
  [ "$v" = "$ref" ] || allsame=0
done
if [ $allsame = 1 ] && [ "$(field "$tmp/e1.jsonl" eval_tokens)" = 960 ] &&
   python3 -c 'import math,sys; l,p=map(float,sys.argv[1:]); sys.exit(not (abs(math.exp(l)-p) <= 1e-6*p and 0 < l < 10))' \
     "$ref" "$(field "$tmp/e1.jsonl" eval_ppl)"; then
  ok "held-out loss of the same parameters at 1, 2, 3 and 4 ranks: the 1-rank value to the last bit ($ref, 960 tokens); eval_ppl = exp(eval_loss)"
else bad "held-out loss at 1..4 ranks" "${detail[@]}"; fi

# ---- terminal and summary ----
if grep -qE "^eval +4/4  eval_loss [0-9.]+  eval_ppl [0-9.]+$" "$tmp/e2" &&
   grep -qE "^eval: loss [0-9.]+ \| perplexity [0-9.]+ \(960 held-out tokens\)" "$tmp/e2" &&
   grep -qE "^held-out data: .*val.txt, 3000 tokens; each evaluation: 3 batches of 10 x 32 tokens" "$tmp/e2"; then
  ok "eval_loss and eval_ppl on the terminal, in the summary, and the held-out data described"
else bad "eval lines" "$(grep -E '^eval|^held' "$tmp/e2")"; fi

# ---- the token file of the same text evaluates alike (and all of it once by default) ----
for f in val.txt val.bin other.txt; do
  "$TRAIN" --resume "$tmp/ck" --steps 4 --lr 0 --min-lr 0 --override steps,lr,min-lr --val-data "$tmp/$f" \
    --log "$tmp/f$f.jsonl" > "$tmp/f$f" 2>&1 || bad "--val-data $f" "$(tail -3 "$tmp/f$f")"
done
if [ -s "$tmp/fval.txt.jsonl" ] && [ "$(field "$tmp/fval.txt.jsonl" eval_loss)" = "$(field "$tmp/fval.bin.jsonl" eval_loss)" ] &&
   [ "$(field "$tmp/fval.bin.jsonl" eval_tokens)" = 2688 ] && # 7 batches of 12 x 32: the 3000 tokens once
   [ "$(field "$tmp/fval.txt.jsonl" eval_loss)" != "$(field "$tmp/fother.txt.jsonl" eval_loss)" ]; then
  ok "--val-data as an llm.c token file and as text (bytes) give the same held-out loss, another text another; default: the whole file once"
else bad "token file vs text" "$(grep -h eval: "$tmp/fval.txt" "$tmp/fval.bin" "$tmp/fother.txt")"; fi

# ---- evaluation leaves training bit-identical ----
"$TRAIN" "${common[@]}" --steps 6 --nproc 2 --log "$tmp/n.jsonl" > "$tmp/on" 2>&1 || bad "run without eval" "$(tail -3 "$tmp/on")"
"$TRAIN" "${common[@]}" --steps 6 --nproc 2 --val-data "$tmp/val.txt" --eval-every 1 --eval-batches 2 \
  --log "$tmp/v.jsonl" > "$tmp/ov" 2>&1 || bad "run with eval" "$(tail -3 "$tmp/ov")"
if same_bits "$tmp/n.jsonl" "$tmp/v.jsonl" && [ "$(grep -c '"eval_loss"' "$tmp/v.jsonl")" = 6 ] &&
   [ "$(grep -c '"eval_loss"' "$tmp/n.jsonl")" = 0 ]; then
  ok "evaluating after every step leaves the training bit-identical (2 ranks, losses, grad and param norms)"
else bad "eval changes training" "$(paste <(grep -o '"loss": [^,]*' "$tmp/n.jsonl") <(grep -o '"loss": [^,]*' "$tmp/v.jsonl"))"; fi

# ---- --eval-batches past the end of the file: what the file holds, each token once (as an image
# model's test split) ----
if "$TRAIN" "${common[@]}" --steps 1 --val-data "$tmp/val.txt" --eval-batch 10 --eval-batches 50 --log "$tmp/over.jsonl" \
     > "$tmp/over" 2>&1 && [ "$(field "$tmp/over.jsonl" eval_tokens)" = 2880 ] && # 9 batches of 10 x 32 in 3000 tokens
   grep -q "^held-out data: .*val.txt, 3000 tokens; each evaluation: all 9 (--eval-batches 50: the file holds 9) batches of 10 x 32 tokens" "$tmp/over"
then ok "--eval-batches 50 over a file of 9 batches evaluates the 9 once (2880 tokens) and says so"
else bad "--eval-batches past the end" "$(grep -E '^held|^eval' "$tmp/over")"; fi

# ---- --eval-batches is the image model's too: the first N test batches ----
if "$TRAIN" --model cnn --steps 1 --batch 8 --threads 1 --eval-batch 100 --eval-batches 2 --log "$tmp/img.jsonl" \
     > "$tmp/img" 2>&1 && [ "$(field "$tmp/img.jsonl" eval_images)" = 200 ]; then
  ok "an image model evaluates the first --eval-batches 2 test batches of --eval-batch 100 (200 images)"
else bad "image model --eval-batches" "$(tail -2 "$tmp/img")"; fi

# ---- bad input: one line naming the file ----
val_error() { # NAME PATTERN ARGS...
  local name=$1 pat=$2; shift 2
  timeout -k 5 60 "$TRAIN" "${common[@]}" --steps 2 "$@" > "$tmp/out" 2> "$tmp/err"; local rc=$?
  local lines; lines=$(grep -c "^fsdp-train:" "$tmp/err") # one error line (a usage error adds the --help hint)
  if [ $rc -ne 0 ] && [ $rc -lt 124 ] && [ "$lines" = 1 ] && grep -qE -- "$pat" "$tmp/err"; then ok "$name (exit $rc)"
  else bad "$name" "exit $rc" "$(head -3 "$tmp/err")"; fi
}
val_error "--val-data with a token id over the vocabulary, 2 ranks" \
  "--val-data: '.*bigtok.bin': token 300 at position 70 is >= vocab_size 256" --nproc 2 --val-data "$tmp/bigtok.bin"
val_error "--val-data shorter than a sequence" "--val-data: '.*short.txt' has 9 tokens" --val-data "$tmp/short.txt"
val_error "--val-data missing" "--val-data: .*no/such" --val-data "$tmp/no/such"
# fewer tokens than one evaluation batch: refused at startup (a flag error: exit 2), not evaluated as 0 batches
timeout -k 5 60 "$TRAIN" "${common[@]}" --steps 2 --val-data "$tmp/val.txt" --eval-batch 100 > "$tmp/out" 2> "$tmp/err"; rc=$?
if [ $rc = 2 ] && [ "$(grep -c fsdp-train "$tmp/err")" = 1 ] && ! grep -q "^step" "$tmp/out" &&
   grep -q -- "--val-data .*val.txt: 3000 tokens, fewer than one evaluation batch needs: 100 sequences (--eval-batch) x 32 tokens (--seq) + 1 = 3201 tokens" "$tmp/err"
then ok "--val-data of 3000 tokens with --eval-batch 100 x --seq 32: refused before step 1 (exit 2)"
else bad "--val-data shorter than an evaluation batch" "exit $rc" "$(head -3 "$tmp/err")"; fi
val_error "--eval-every without --val-data" "--eval-every, --eval-batch and --eval-batches need --val-data" --eval-every 2
# an image model evaluates on its data's test split and reads no --val-data: refused, not ignored
common=(--threads 1) # (not the GPT's: --seq would be refused first, for the same reason)
val_error "--val-data for an image model" "--val-data .*val.txt: this run's task, images, does not read it; it applies to --task tokens" \
  --model cnn --data fashion-mnist --val-data "$tmp/val.txt"

finish
