#!/usr/bin/env bash
# t_trainer.sh - end-to-end checks of fsdp-train: the 1-rank run is the oracle
# for 2, 3 and 4 ranks; bad input gives a clear message and a non-zero exit on
# every rank without hanging; a rank killed mid-step ends the whole job.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

# expect_error NAME PATTERN -- ARGS...: exits non-zero within 60 s, stderr matches PATTERN
expect_error() {
  local name=$1 pat=$2; shift 3
  local t0=$SECONDS
  timeout -k 5 60 "$TRAIN" "$@" > "$tmp/out" 2> "$tmp/err"
  local rc=$?
  if [ $rc -eq 0 ]; then bad "$name" "exit 0, expected an error"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then bad "$name" "hung (killed by timeout)"
  elif ! grep -qE -- "$pat" "$tmp/err"; then bad "$name" "stderr lacks /$pat/:" "$(head -5 "$tmp/err")"
  else ok "$name (exit $rc, $((SECONDS - t0)) s)"; fi
}

common=(--model tiny --data synthetic --batch 12 --seq 32 --steps 10 --lr 3e-3 --warmup 2 --threads 1 --sample 0)

# ---- the 1-rank oracle ----
# (with a sample: at N ranks on the summoned model, [Note: sampling on the summoned model], the same text)
"$TRAIN" "${common[@]}" --sample 40 --log "$tmp/r1.jsonl" > "$tmp/o1" 2>&1 || bad "1-rank run" "$(tail -5 "$tmp/o1")"
sample() { sed -n '/^--- sample ---$/,/^--------------$/p' "$1"; }
for n in 2 3 4; do
  if ! timeout -k 5 300 "$TRAIN" "${common[@]}" --sample 40 --nproc $n --log "$tmp/r$n.jsonl" > "$tmp/o$n" 2>&1; then
    bad "$n-rank run" "$(tail -5 "$tmp/o$n")"; continue
  fi
  if msg=$(python3 - "$tmp/r1.jsonl" "$tmp/r$n.jsonl" <<'EOF'
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert len(a) == len(b) == 10, f"step counts {len(a)} {len(b)}"
for x, y in zip(a, b):
    for k in ("loss", "param_norm", "grad_norm"):
        r = abs(x[k] - y[k]) / abs(x[k])
        assert r <= 1e-5, f"step {x['step']}: {k} {x[k]} vs {y[k]} (rel {r:.2e})"
    for k in ("step", "lr", "step_ms", "tokens_per_s", "peak_rss_mb"):
        assert k in y, f"log lacks {k}"
assert a[-1]["loss"] < a[0]["loss"], "loss did not fall"
EOF
  2>&1); then ok "$n ranks reproduce the 1-rank run (loss, grad and param norms within 1e-5)"
  else bad "$n ranks reproduce the 1-rank run" "$msg"; fi
  if [ -n "$(sample "$tmp/o1")" ] && [ "$(sample "$tmp/o$n")" = "$(sample "$tmp/o1")" ] &&
     grep -q "^sampling on the whole model, summoned on every rank" "$tmp/o$n"; then
    ok "$n ranks sample the 1-rank text, on the summoned model"
  else bad "$n-rank sample" "$(sample "$tmp/o1" | head -3)" "$(grep -A3 '^sampling' "$tmp/o$n")"; fi
done

# ---- help and flags ----
"$TRAIN" --help > "$tmp/help" 2>&1
if grep -q -- "--beta2 X .*default 0.95" "$tmp/help" && grep -q -- "--eps X .*default 1e-08" "$tmp/help" \
   && grep -q -- "--nproc" "$tmp/help" && grep -q -- "--log FILE" "$tmp/help"; then ok "--help lists flags with defaults"
else bad "--help lists flags with defaults" "$(head -3 "$tmp/help")"; fi

# ---- --profile: rank 0's time by module over the timed steps ----
if timeout -k 5 120 "$TRAIN" --model tiny --data synthetic --batch 4 --seq 16 --steps 3 --threads 1 --sample 0 \
     --nproc 2 --profile > "$tmp/prof" 2>&1 \
   && [ "$(grep -c '^time by module (rank 0, 2 timed steps' "$tmp/prof")" = 1 ] \
   && grep -qE '^transformer\.h\.\*\.attn\.c_attn +Linear +2\.0 +2\.0 ' "$tmp/prof" && grep -qE '^lm_head +Linear +1\.0 +1\.0 ' "$tmp/prof" \
   && grep -qE '^transformer\.h\.\* +Block +2\.0 +2\.0 ' "$tmp/prof" && grep -q '^total ' "$tmp/prof"; then
  ok "--profile prints one table, layers folded and calls per step"
else bad "--profile prints one table, layers folded and calls per step" "$(tail -20 "$tmp/prof")"; fi

# ---- bad input, on two ranks ----
printf 'hello world, a small text file\n' > "$tmp/text.txt"
python3 - "$tmp" <<'EOF'
import struct, sys
d = sys.argv[1]
hdr = [0] * 256; hdr[0] = 12345; hdr[1] = 1; hdr[2] = 100
open(f"{d}/badmagic.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack("<100H", *range(100)))
hdr[0] = 20240520
open(f"{d}/bigtok.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack("<100H", *([1] * 50 + [300] + [1] * 49)))
open(f"{d}/short.bin", "wb").write(struct.pack("<256i", *hdr) + struct.pack("<10H", *range(10)))
EOF
expect_error "unknown flag" "unknown flag '--bogus'" -- --bogus 3
expect_error "bad flag value" "--steps: 'ten'" -- --steps ten
expect_error "missing data file" "no/such/file" -- --nproc 2 --model tiny --data "$tmp/no/such/file" --steps 2
expect_error "wrong token-file header" "badmagic.bin" -- --nproc 2 --model tiny --data "$tmp/badmagic.bin" --steps 2
expect_error "truncated token file" "short.bin" -- --nproc 2 --model tiny --data "$tmp/short.bin" --steps 2
expect_error "token >= vocab" "300" -- --nproc 2 --model tiny --data "$tmp/bigtok.bin" --steps 2
expect_error "batch not divisible by world" "not divisible by the world size 2" -- --nproc 2 --model tiny --batch 3 --steps 2
expect_error "sequence longer than block_size" "block_size 64" -- --nproc 2 --model tiny --seq 65 --steps 2
expect_error "unknown model preset" "gpt5" -- --model gpt5 --steps 1
echo '{"n_layer": 2, "n_head": 3, "n_embd": 32, "vocab_size": 256, "block_size": 64}' > "$tmp/cfg.json"
expect_error "bad model config" "n_head" -- --model-config "$tmp/cfg.json" --steps 1
# a library variable set to a value it does not take stops the run, naming it (README.md)
FSDP_SHM_SLOT=4M expect_error "bad FSDP_SHM_SLOT, 2 shm ranks" "FSDP_SHM_SLOT='4M': expected a whole number in \[4096," \
  -- --nproc 2 --comm shm --model tiny --steps 2
FSDP_COLLECTIVE_TIMEOUT=soon expect_error "bad FSDP_COLLECTIVE_TIMEOUT, 2 mpi ranks" \
  "FSDP_COLLECTIVE_TIMEOUT='soon': expected a number" -- --nproc 2 --comm mpi --model tiny --steps 2
FSDP_GEMM_BF16=fast expect_error "bad FSDP_GEMM_BF16" "FSDP_GEMM_BF16='fast': expected one of: auto, widen, matmul, gemm" \
  -- --model tiny --precision AMP_BF16 --steps 1

# ---- a rank killed mid-step ends the job ----
# the log's path marks this job's processes (launcher, mpirun, ranks) and no one else's
mark="$tmp/kill.jsonl"
"$TRAIN" --nproc 2 --model small --steps 100000 --threads 1 --sample 0 --log "$mark" > "$tmp/kill.out" 2>&1 &
job=$!
for _ in $(seq 1 100); do grep -q "^step" "$tmp/kill.out" && break; sleep 0.2; done
victim=$(pgrep -f -- "$mark" | tail -n 1) # the newest: a rank
[ -z "$victim" ] && victim=$(pgrep -P "$(pgrep -n mpirun)" | tail -n 1)
if [ -z "$victim" ]; then bad "killed rank ends the job" "no rank process found"; kill -9 $job 2>/dev/null
else
  kill -9 "$victim"
  t0=$SECONDS
  while kill -0 $job 2>/dev/null && [ $((SECONDS - t0)) -lt 30 ]; do sleep 0.5; done
  if kill -0 $job 2>/dev/null; then bad "killed rank ends the job" "still running after 30 s"; pkill -9 -f -- "$mark"; kill -9 $job
  else wait $job; rc=$?
    if [ $rc -ne 0 ]; then ok "killed rank ends the job within $((SECONDS - t0)) s (exit $rc)"
    else bad "killed rank ends the job" "exit 0"; fi
  fi
fi
sleep 0.5
if pgrep -f -- "$mark" >/dev/null; then bad "no process left behind"; pkill -9 -f -- "$mark"
else ok "no process left behind"; fi

finish
