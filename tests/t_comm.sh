#!/usr/bin/env bash
# t_comm.sh - end-to-end checks of the communication backends: a rank of the
# shm backend SIGKILLed inside an all-gather or a reduce-scatter ends the job within 30 s with a
# message naming it, leaving no process and no shared segment behind; the
# trainer's --comm flag, its per-step comm figures in the JSON log and the
# "exposed comm" summary; shm training is bit-identical run to run and, at
# 2 ranks, to MPI; a SIGSTOPped rank trips the collective watchdog on shm and
# MPI. Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"
# absolute: the leftover checks below must not match another checkout's jobs
BW="$(cd "$BUILD" && pwd)/bench/comm_bw"
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none

# a segment has a name only during a job's handshake (other jobs may be in
# theirs right now): one whose creator (fsdp-shm-PID-...) is gone was leaked.
# Looked for after each job: the next job's rank 0 sweeps such segments away
leaked=""
scan_leaked() {
  local f pid
  for f in $(ls /dev/shm | grep '^fsdp-shm-'); do
    pid=${f#fsdp-shm-}; pid=${pid%%-*}
    kill -0 "$pid" 2> /dev/null || leaked="$leaked $f"
  done
}

# ---- a dead peer is detected, named, and ends the job ----
# (2.8 MB blocks: shm's single-copy path where permitted, for all-gathers too
# with FSDP_SHM_CMA=2; "staged" forces the slot path with FSDP_SHM_CMA=0)
for run in 1 2 2-staged; do
  victim=${run%-staged} cma=2 path=""
  [ "$run" != "$victim" ] && cma=0 path=" (staged)"
  coll=allgather; [ $victim = 2 ] && coll=reduce-scatter
  t0=$(date +%s%N)
  timeout -k 5 60 mpirun -np 3 --oversubscribe --bind-to none -x FSDP_SHM_CMA=$cma "$BW" --kill-rank $victim \
    --max 8388608 --fault-coll $([ $coll = allgather ] && echo ag || echo rs) > "$tmp/kill.out" 2>&1
  rc=$?
  scan_leaked
  ms=$((($(date +%s%N) - t0) / 1000000))
  check="allgather #5 \([0-9]+ elements of I32, [0-9]+ bytes, tag schedule check of $coll #6" # see below
  if [ $rc -eq 0 ]; then bad "kill rank $victim in $coll$path: job ends" "exit 0"
  elif [ $rc -eq 124 ]; then bad "kill rank $victim in $coll$path: job ends" "still running after 60 s"
  elif [ $ms -gt 30000 ]; then bad "kill rank $victim in $coll$path: job ends within 30 s" "took $ms ms"
  # the survivors may have finished #5 with the victim's data before it died: then they find it
  # dead in the next one, or in that one's schedule check (an all-gather of the fingerprints)
  elif ! grep -qE "shm: rank $victim \(pid [0-9]+\) died during ($coll #[56] \(|$check)" "$tmp/kill.out"; then
    bad "kill rank $victim in $coll$path: a survivor names the dead rank" "$(grep -v '^---' "$tmp/kill.out" | head -8)"
  else ok "kill rank $victim in $coll$path: named and ended in $ms ms (exit $rc)"; fi
done
sleep 1
if pgrep -f "$BW --kill-rank" > /dev/null; then bad "no comm_bw left behind" "$(pgrep -fa "$BW --kill-rank")"
else ok "no comm_bw left behind"; fi
scan_leaked
if [ -n "$leaked" ]; then bad "no shm segment left behind" "$leaked"
else ok "no shm segment left behind"; fi

# ---- a stalled rank (SIGSTOP) trips the watchdog ----
for comm in shm mpi; do
  t0=$(date +%s%N)
  timeout -k 5 60 mpirun -np 3 --oversubscribe --bind-to none "$BW" --stop-rank 1 --timeout 2 --comm $comm \
    --max 8388608 > "$tmp/stop.out" 2>&1
  rc=$?
  ms=$((($(date +%s%N) - t0) / 1000000))
  on=""; [ $comm = shm ] && on=" on rank 1"
  # the peers wait in allgather #5, or, where the stopped rank's start had already handed over its
  # data (shm copies it in the start), in the schedule check of #6 (FSDP_CHECK_COLLECTIVES=1, as in
  # the suite: the check's own exchange is its allgather #5)
  pat="collective timeout: rank [02] waited [0-9.]+ s \(limit 2 s\)$on in allgather #5 \((699050 elements of F32, 2796200 bytes|17 elements of I32, 68 bytes, tag schedule check of allgather #6)\)"
  if [ $rc -eq 0 ] || [ $rc -eq 124 ]; then bad "$comm: SIGSTOP trips the watchdog" "exit $rc"
  elif [ $ms -gt 30000 ]; then bad "$comm: SIGSTOP trips the watchdog within 30 s" "took $ms ms"
  elif ! grep -qE "$pat" "$tmp/stop.out"; then
    bad "$comm: SIGSTOP trips the watchdog" "no /$pat/ in:" "$(grep -v '^---' "$tmp/stop.out" | head -6)"
  else ok "$comm: a SIGSTOPped rank trips the 2 s watchdog, job ended in $ms ms"; fi
done
sleep 1
if pgrep -f "$BW --stop-rank" > /dev/null; then bad "no stopped comm_bw left behind" "$(pgrep -fa "$BW --stop-rank")"
else ok "no stopped comm_bw left behind"; fi

# ---- the trainer ----
common=(--model tiny --data synthetic --batch 12 --seq 32 --steps 4 --lr 3e-3 --warmup 2 --threads 1 --sample 0)
losses() { sed -nE 's/.*"loss": ([^,]*),.*/\1/p' "$1"; }

if timeout -k 5 60 "$TRAIN" --comm bogus > "$tmp/o" 2> "$tmp/e"; then bad "--comm bogus is refused" "exit 0"
elif ! grep -q "is not auto, mpi, shm or self" "$tmp/e"; then bad "--comm bogus is refused" "$(head -3 "$tmp/e")"
else ok "--comm bogus is refused"; fi

for comm in shm mpi; do
  if ! timeout -k 5 120 "$TRAIN" "${common[@]}" --nproc 2 --comm $comm --log "$tmp/$comm.jsonl" > "$tmp/$comm.out" 2>&1; then
    bad "--comm $comm trains" "$(tail -5 "$tmp/$comm.out")"; continue
  fi
  if ! grep -q "world 2 ($comm)" "$tmp/$comm.out"; then bad "--comm $comm is used" "$(grep world "$tmp/$comm.out")"
  elif ! grep -qE "^comm \($comm, rank 0, 3 timed steps\): exposed comm [0-9.]+ ms/step = [0-9.]+% of step time \| allgather [0-9.]+ MB/step" "$tmp/$comm.out"; then
    bad "--comm $comm: summary shows exposed comm" "$(grep '^comm' "$tmp/$comm.out")"
  elif ! python3 - "$tmp/$comm.jsonl" <<'EOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
assert len(rows) == 4, len(rows)
for r in rows:
    c = r["comm"]
    assert set(c) == {"allgather", "reduce_scatter", "allreduce", "broadcast", "barrier"}, c
    assert c["allgather"]["bytes"] > 0 and c["reduce_scatter"]["bytes"] > 0, c
    assert r["comm_bytes"] == sum(v["bytes"] for v in c.values()), r
    assert abs(r["comm_ms"] - sum(v["ms"] for v in c.values())) < 0.01, r
    assert 0 <= r["comm_ms"] <= r["step_ms"] + 0.01, r
EOF
  then bad "--comm $comm: JSON log has comm_ms, comm_bytes and per-type figures" "$(tail -1 "$tmp/$comm.jsonl")"
  else ok "--comm $comm: summary and JSON log show comm time and bytes"; fi
done
if [ -s "$tmp/shm.jsonl" ] && [ -s "$tmp/mpi.jsonl" ]; then
  if [ "$(losses "$tmp/shm.jsonl")" = "$(losses "$tmp/mpi.jsonl")" ]; then ok "2 ranks: shm losses equal mpi's bit for bit"
  else bad "2 ranks: shm losses equal mpi's bit for bit" "$(paste <(losses "$tmp/shm.jsonl") <(losses "$tmp/mpi.jsonl"))"; fi
fi

# the schedule check and the watchdog change nothing in a healthy run
if timeout -k 5 120 "$TRAIN" "${common[@]}" --nproc 2 --comm shm --check-collectives --collective-timeout 60 \
    --log "$tmp/chk.jsonl" > "$tmp/chk.out" 2>&1 && [ "$(losses "$tmp/chk.jsonl")" = "$(losses "$tmp/shm.jsonl")" ]; then
  ok "--check-collectives: same losses"
else bad "--check-collectives: same losses" "$(tail -3 "$tmp/chk.out")"; fi

# 3 ranks: shm twice gives the same bits (sums in rank order)
for k in 1 2; do
  timeout -k 5 120 "$TRAIN" "${common[@]}" --batch 12 --nproc 3 --comm shm --log "$tmp/s3_$k.jsonl" > "$tmp/s3_$k.out" 2>&1 ||
    bad "3-rank shm run $k" "$(tail -5 "$tmp/s3_$k.out")"
done
if [ -s "$tmp/s3_1.jsonl" ] && [ "$(losses "$tmp/s3_1.jsonl")" = "$(losses "$tmp/s3_2.jsonl")" ]; then
  ok "3 ranks: shm is bit-identical run to run"
else bad "3 ranks: shm is bit-identical run to run" "$(paste <(losses "$tmp/s3_1.jsonl") <(losses "$tmp/s3_2.jsonl"))"; fi

finish
