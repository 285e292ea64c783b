#!/usr/bin/env bash
# t_multihost.sh - runs across simulated hosts (scripts/simhosts.sh: network +
# UTS namespaces on veths, Open MPI launched through its rsh agent, TCP
# between hosts):
#  - test_mpi_hosts at 2 hosts x 2 ranks and 3 x 1: AUTO picks MPI
#    across hosts and shm within one, --comm shm is refused naming the hosts,
#    ordered reductions give the rank-order sum's bits over the world, a host
#    and across hosts;
#  - ranks that Open MPI places on one node but that run under two hostnames
#    (two UTS namespaces sharing /dev/shm and /tmp) count as two hosts;
#  - fsdp-train FULL_SHARD, SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD (a group
#    per host by default) at 2 hosts x 2 ranks reproduce the 1-rank run
#    (1e-5) and give the bits of the same world on one host over shm (HYBRID's
#    default group, the ranks of a host, against --shard-group 2 there: the
#    group size comes from fsdp_comm_local_size, which test_mpi_hosts checks);
#    --mpi-reduce native still trains; --comm shm across hosts is refused;
#    a FULL_SHARD checkpoint saved across hosts resumes on one host, and one
#    saved on one host resumes across hosts;
#  - the scale-out plan (fsdp-train --dry-run --net-gbps): what host 0 sends on its link
#    per step is the model's bytes (-5% .. +15%); its flags' usage errors;
#  - faults ([Note: peer watch]): every rank of host 1 killed ends the job within 15 s, each
#    rank of host 0 naming host 1 and the collective; a link dropping every packet (tc netem,
#    or blackhole) ends every rank within 25 s, the watchdog naming the collective and the
#    silent host; after each, nothing is left (namespaces, veths, the rig's folder, its
#    processes, /dev/shm files: scripts/simhosts.sh left); skipped without tc;
#  - nothing is left behind (namespaces, the rig's files).
# Skips (with the reason) where namespaces cannot be made. Prints
# "N passed, N failed, N skipped" at the end.
. "$(dirname "$0")/lib.sh"
SIM=scripts/simhosts.sh
export SIMHOSTS_OWNER=$$ # a rig outlives this script only if it is killed by SIGKILL; the next up sweeps it
skipped=0
# every rig made, one a line (up runs in a subshell): removed however the script ends
cleanup() {
  [ -f "$tmp/rigs" ] && while read -r r; do [ -d "$r" ] && "$SIM" down "$r"; done < "$tmp/rigs"
  rm -rf "$tmp"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

if ! why=$("$SIM" check 2>&1); then
  echo "skip multi-host tests: cannot make simulated hosts here ($why)"
  echo "0 passed, 0 failed, 1 skipped"
  exit 0
fi
if [ ! -x "$TRAIN" ] || [ ! -x "$BUILD/tests/test_mpi_hosts" ]; then
  bad "build" "build $TRAIN and $BUILD/tests/test_mpi_hosts first (make)"; finish
fi

up() { # up HOSTS SLOTS: prints the rig's directory, remembered for cleanup
  local r; r=$("$SIM" up "$1" "$2") || return 1
  echo "$r" >> "$tmp/rigs"; echo "$r"
}
# on RIG CMD: a shell command on host 0, with $M the mpirun options that span the hosts
on() { local r=$1; shift; timeout -k 5 120 "$SIM" run "$r" bash -c "M=\"\$SIMHOSTS_MPIRUN --oversubscribe\"; $*"; }

# ---- the communicators' view of hosts (tests/test_mpi_hosts.c) ----
hosts_test() { # hosts_test HOSTS RANKS_PER_HOST
  local h=$1 l=$2 r out="$tmp/hosts.$1x$2.out"
  if ! r=$(up "$h" "$l" 2> "$out"); then bad "rig of $h hosts" "$(tail -2 "$out")"; return; fi
  on "$r" "mpirun \$M -x FSDP_TEST_HOSTS=$h -np $((h * l)) $BUILD/tests/test_mpi_hosts" > "$out" 2>&1
  if grep -qE '^[0-9]+ passed, 0 failed' "$out"; then ok "test_mpi_hosts at $h hosts x $l ranks"
  else bad "test_mpi_hosts at $h hosts x $l ranks" "$(grep -E 'FAIL|rank [0-9]+:' "$out" | head -5)" "$(tail -3 "$out")"; fi
  "$SIM" down "$r"
}
rig=$(up 2 2) || { bad "rig of 2 hosts" "cannot make it"; finish; }
out="$tmp/hosts.2x2.out"
on "$rig" "mpirun \$M -x FSDP_TEST_HOSTS=2 -np 4 $BUILD/tests/test_mpi_hosts" > "$out" 2>&1
if grep -qE '^[0-9]+ passed, 0 failed, 0 skipped' "$out" \
   && grep -q "not all on one host (h0-[^:]*: ranks 0-1; h1-[^:]*: ranks 2-3)" "$out"; then
  ok "test_mpi_hosts at 2 hosts x 2 ranks (shm refused naming the hosts)"
else bad "test_mpi_hosts at 2 hosts x 2 ranks" "$(grep -E 'FAIL|rank [0-9]+:' "$out" | head -5)" "$(tail -3 "$out")"; fi
hosts_test 3 1

# one Open MPI node (mpirun starts every rank itself), two hostnames: two hosts
out="$tmp/uts.out"
timeout -k 5 120 mpirun --oversubscribe -x FSDP_TEST_HOSTS=2 -np 4 bash -c \
  'exec nsenter --target "$(cat '"$rig"'/h$((OMPI_COMM_WORLD_RANK / 2)).pid)" --uts '"$BUILD"'/tests/test_mpi_hosts' \
  > "$out" 2>&1
if grep -qE '^[0-9]+ passed, 0 failed, 0 skipped' "$out"; then
  ok "one Open MPI node under two hostnames: two hosts, shm never spans them"
else bad "one Open MPI node under two hostnames" "$(grep -E 'FAIL|rank [0-9]+:' "$out" | head -5)" "$(tail -3 "$out")"; fi

# ---- fsdp-train across hosts ----
# host 0's bytes sent on its link so far (/proc/net/dev in its namespace)
tx0() { nsenter --net="/run/netns/$(cat "$rig"/h0-*.ns)" awk -F'[: ]+' '$2 == "eth0" {print $11}' /proc/net/dev; }
train() { # train NAME WHERE FLAGS...: WHERE = rig (2 hosts x 2 ranks) | local (4 ranks here) | one
  local name=$1 where=$2; shift 2
  local args="--model tiny --steps 2 --batch 8 --seq 32 --threads 1 --sample 0 ${PEAK[*]} --log $tmp/$name.json $*"
  case "$where" in
    rig) on "$rig" "mpirun \$M -np 4 $TRAIN $args" ;;
    local) timeout -k 5 120 mpirun --oversubscribe -np 4 $TRAIN $args ;;
    one) timeout -k 5 120 $TRAIN $args ;;
  esac > "$tmp/$name.out" 2>&1
}
close() { # close A B: every step's loss and grad_norm agree to 1e-5 (relative)
  python3 - "$tmp/$1.json" "$tmp/$2.json" <<'EOF'
import json, sys
a, b = ([r for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:3])
if len(a) != len(b) or not a: sys.exit(f"{len(a)} vs {len(b)} steps")
for x, y in zip(a, b):
    for k in ("loss", "grad_norm"):
        if not abs(x[k] - y[k]) <= 1e-5 * abs(y[k]): sys.exit(f"step {x['step']} {k}: {x[k]} vs {y[k]}")
EOF
}
if train ref one; then ok "1-rank reference"; else bad "1-rank reference" "$(tail -3 "$tmp/ref.out")"; fi
for s in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD; do
  extra=""; [ $s = HYBRID_SHARD ] && extra="--shard-group 2" # one host: the groups of the rig
  ck=""; ckl=""; [ $s = FULL_SHARD ] && ck="--save-dir $tmp/ck.rig" ckl="--save-dir $tmp/ck.local" # checkpoints, below
  [ $s = FULL_SHARD ] && tx_a=$(tx0)
  # the run on one host beside the rig's (at once: it sends nothing on the rig's links)
  spawn local train "$s.local" local --sharding $s --comm shm $extra $ckl
  if train "$s.rig" rig --sharding $s $ck && msg=$(close "$s.rig" ref 2>&1); then
    ok "$s at 2 hosts x 2 ranks reproduces the 1-rank run"
  else bad "$s at 2 hosts x 2 ranks" "${msg:-}" "$(tail -3 "$tmp/$s.rig.out")"; fi
  [ $s = FULL_SHARD ] && tx_b=$(tx0)
  if reap local && same_bits "$tmp/$s.rig.json" "$tmp/$s.local.json"; then
    ok "$s: 2 hosts (MPI, ordered) give the bits of 4 ranks on one host (shm)"
  else bad "$s across hosts vs shm on one host: bits differ" "$(tail -2 "$tmp/$s.local.out")"; fi
done
# --comm shm across hosts, refused (checked below): its seconds of teardown beside the runs up to
# the wire's
spawn shm train shm rig --comm shm
# checkpoints saved across hosts load on one host (the bits of one saved there), and vice versa
if train ck.one.rig one --steps 3 --override steps --resume "$tmp/ck.rig" && train ck.one.local one --steps 3 --override steps --resume "$tmp/ck.local" \
   && same_bits "$tmp/ck.one.rig.json" "$tmp/ck.one.local.json"; then
  ok "a checkpoint saved across 2 hosts resumes on one host at 1 rank (the bits of one saved on one host)"
else bad "checkpoint across hosts -> one host" "$(tail -2 "$tmp/ck.one.rig.out")" "$(tail -2 "$tmp/ck.one.local.out")"; fi
if train ck.rig.local rig --steps 3 --override steps --resume "$tmp/ck.local" && msg=$(close ck.rig.local ck.one.local 2>&1); then
  ok "a checkpoint saved on one host resumes across 2 hosts (1e-5 of the 1-rank resume)"
else bad "checkpoint one host -> across hosts" "${msg:-}" "$(tail -2 "$tmp/ck.rig.local.out")"; fi
if train native rig --sharding FULL_SHARD --comm mpi --mpi-reduce native && msg=$(close native ref 2>&1); then
  ok "--mpi-reduce native across hosts reproduces the 1-rank run (1e-5)"
else bad "--mpi-reduce native across hosts" "${msg:-}" "$(tail -3 "$tmp/native.out")"; fi
if ! reap shm && grep -q "comm shm: the 4 ranks are not all on one host (h0-" "$tmp/shm.out"; then
  ok "fsdp-train --comm shm across hosts is refused naming the hosts"
else bad "--comm shm across hosts" "$(tail -3 "$tmp/shm.out")"; fi

# ---- the scale-out model's bytes against the wire ----
# what host 0 sent over its link in 3 steps (a 5-step FULL_SHARD run less the 2-step one
# above, which also saved a checkpoint: files, no traffic but a few small collectives)
# against R x the bytes per rank and step fsdp-train --dry-run --net-gbps predicts, x 3:
# within -5% .. +15% (TCP/IP headers and acknowledgements, the small all-reduces: +2%
# on the simulated hosts)
c0=$(tx0); train wire rig --sharding FULL_SHARD --steps 5; c1=$(tx0)
pred=$($TRAIN --model tiny --batch 8 --seq 32 --threads 1 --dry-run --hosts 2 --ranks-per-host 2 --net-gbps 1 2>&1 \
       | awk '$1 == "all-gather" || $1 == "reduce-scatter" || $1 == "all-reduce" {s += $2} END {print s}')
if msg=$(python3 -c "
sent = (($c1 - $c0) - ($tx_b - $tx_a)) / 3 / 1e6; pred = 2 * ${pred:-0}
print(f'host 0 sent {sent:.3f} MB per step, the model {pred:.3f} MB (2 ranks x {pred / 2:.3f})')
raise SystemExit(not 0.95 <= sent / pred <= 1.15)" 2>&1); then ok "scale-out model: $msg"
else bad "scale-out model's bytes against the wire" "${msg:-no figures}" "$(tail -2 "$tmp/wire.out")"; fi

# the scale-out plan's flags: a world needs both --hosts and --ranks-per-host, a plan --dry-run
o1=$($TRAIN --model tiny --dry-run --hosts 2 --net-gbps 1 2>&1); r1=$?
o2=$($TRAIN --model tiny --hosts 2 --ranks-per-host 2 --net-gbps 1 2>&1); r2=$?
if [ $r1 = 2 ] && echo "$o1" | grep -q -- "--hosts and --ranks-per-host go together" \
   && [ $r2 = 2 ] && echo "$o2" | grep -q -- "plan a world with --dry-run"; then
  ok "--hosts without --ranks-per-host, and --net-gbps without --dry-run, are usage errors"
else bad "scale-out flags" "$r1: $o1" "$r2: $o2"; fi
# --step-forward-ms: the forward's part of --step-compute-ms (a third unless given): a third
# given predicts what the default does, another share another figure; alone or above the
# step's compute it is a usage error
plan() { $TRAIN --model small --batch 64 --seq 64 --threads 1 --dry-run --hosts 2 --ranks-per-host 1 --net-gbps 0.5 \
  --step-compute-ms 150 "$@" 2>&1 | sed -n 's/.*predicted exposed communication \([0-9.]*\) ms.*/\1/p'; }
p0=$(plan); p50=$(plan --step-forward-ms 50); p100=$(plan --step-forward-ms 100)
o3=$($TRAIN --model tiny --dry-run --hosts 2 --ranks-per-host 1 --net-gbps 1 --step-forward-ms 5 2>&1); r3=$?
o4=$($TRAIN --model tiny --dry-run --hosts 2 --ranks-per-host 1 --net-gbps 1 --step-compute-ms 5 --step-forward-ms 6 2>&1); r4=$?
if [ -n "$p0" ] && [ "$p0" = "$p50" ] && [ -n "$p100" ] && [ "$p100" != "$p0" ] \
   && [ $r3 = 2 ] && echo "$o3" | grep -q -- "--step-forward-ms is the forward's part of --step-compute-ms" \
   && [ $r4 = 2 ] && echo "$o4" | grep -q -- "--step-forward-ms 6 is more than --step-compute-ms 5"; then
  ok "--step-forward-ms: a third is the default ($p0 ms exposed), two thirds predicts $p100 ms; alone or too large refused"
else bad "--step-forward-ms" "default $p0, 50: $p50, 100: $p100" "$r3: $o3" "$r4: $o4"; fi

# the scale-out plan lays out the units the run would: ResNet-18's BasicBlocks (9 units, as the
# memory plan), not the GPT's default wrap (the root alone)
o5=$($TRAIN --model resnet18 --data fashion-mnist --batch 32 --dry-run --hosts 2 --ranks-per-host 2 --net-gbps 1 \
  --step-compute-ms 100 2>&1)
if echo "$o5" | grep -q "^scale-out plan: FULL_SHARD, 2 hosts x 2 ranks (world 4), 9 units" \
   && echo "$o5" | grep -q "^memory plan: FULL_SHARD, world 4, 9 units"; then
  ok "the scale-out plan of resnet18 has the run's 9 units (the task's wrap policy)"
else bad "scale-out plan of resnet18" "$(echo "$o5" | grep "plan:")"; fi

# ---- faults across hosts ([Note: peer watch], src/comm/peers.c) ----
# A run of 2 hosts x 2 ranks whose rank 2 stops itself (FSDP_FAULT, SIGSTOP) in its first
# forward: the test then acts on a run known to be mid-training. Every rank's stderr goes to
# $tmp/NAME.RANK.err, followed by "rc=N" if the rank's wrapper outlives it.
fault_run() { # fault_run NAME RIG TIMEOUT: starts the run in the background (pid in $fpid)
  local name=$1 r=$2 to=$3
  on "$r" "mpirun \$M -x FSDP_FAULT=forward:2:1:stop -np 4 bash -c '$TRAIN --model tiny --steps 1000 \
    --batch 8 --seq 32 --threads 1 --sample 0 --collective-timeout $to 2> $tmp/$name.\$OMPI_COMM_WORLD_RANK.err; \
    echo rc=\$? >> $tmp/$name.\$OMPI_COMM_WORLD_RANK.err'" > "$tmp/$name.out" 2>&1 &
  fpid=$!
}
host_pids() { # host_pids RIG I [STATE]: the fsdp-train processes of host I (in state STATE)
  local p; for p in $(ip netns pids "$(cat "$1"/h"$2"-*.ns)" 2> /dev/null); do
    [ "$(cat /proc/$p/comm 2> /dev/null)" = fsdp-train ] || continue
    [ -z "${3:-}" ] || [ "$(awk '{print $3}' /proc/$p/stat 2> /dev/null)" = "$3" ] && echo $p
  done
}
until_stopped() { # until_stopped RIG: waits (60 s at most) for rank 2's SIGSTOP on host 1
  local i; for i in $(seq 600); do [ -n "$(host_pids "$1" 1 T)" ] && return 0; sleep 0.1; done; return 1
}
rig_gone() { # rig_gone RIG NAME: takes the rig down; reports whatever it left behind
  local id; id=$(cat "$1/id"); "$SIM" down "$1"
  local l; l=$("$SIM" left "$id")
  if [ -z "$l" ]; then ok "$2: nothing left behind (namespaces, veths, folder, processes, /dev/shm)"
  else bad "$2: left behind" "$(echo "$l" | head -5)"; fi
}
ranks_said() { # ranks_said NAME REGEX RANKS...: each rank's stderr matches REGEX
  local n=$1 re=$2 k; shift 2
  for k in "$@"; do grep -qE "$re" "$tmp/$n.$k.err" 2> /dev/null || { echo "rank $k: $(tail -2 "$tmp/$n.$k.err" 2> /dev/null)"; return 1; }; done
}

# (a) every rank of host 1 killed: the ranks of host 0 end within HOSTKILL_S naming host 1
# (the peer watch sees the connections close) and the collective, and the job ends non-zero
HOSTKILL_S=15
if fr=$(up 2 2); then
  fid=$(cat "$fr/id")
  fault_run hk "$fr" 60
  if until_stopped "$fr"; then
    t0=$(date +%s.%N); kill -9 $(host_pids "$fr" 1); wait $fpid; rc=$?; t1=$(date +%s.%N)
    el=$(python3 -c "print(f'{$t1 - $t0:.1f}')")
    if [ $rc != 0 ] && python3 -c "import sys; sys.exit(not $el < $HOSTKILL_S)" \
       && msg=$(ranks_said hk "peer watch: rank [23] on host h1-$fid .*(latest collective|cannot complete)" 0 1); then
      ok "host 1's ranks killed: ranks 0-1 name host h1-$fid and the collective; the job ends (exit $rc) in $el s (< $HOSTKILL_S s)"
    else bad "host kill: exit $rc after $el s" "${msg:-}" "$(tail -3 "$tmp/hk.out")"; fi
  else kill $fpid 2> /dev/null; wait $fpid; bad "host kill: rank 2 never reached its first forward" "$(tail -3 "$tmp/hk.out")"; fi
  rig_gone "$fr" "host kill"
else bad "rig for the host kill" "cannot make it"; fi

# (b) a link that drops every packet (netem loss 100%, or the blackhole qdisc where the
# kernel has no netem) both ways between host 1 and the bridge: the watchdog (limit
# STALL_TO_S) ends every rank within STALL_S, naming the collective and the silent host
STALL_TO_S=8 STALL_S=25
if ! command -v tc > /dev/null; then
  echo "skip stalled link: no tc (iproute2)"; skipped=$((skipped + 1))
elif fr=$(up 2 2); then
  fid=$(cat "$fr/id")
  drop() { # drop NS DEV: netem loss 100%, else blackhole; prints which
    tc -n "$1" qdisc add dev "$2" root netem loss 100% 2> /dev/null && { echo netem; return; }
    tc -n "$1" qdisc add dev "$2" root blackhole 2> /dev/null && echo blackhole
  }
  fault_run st "$fr" $STALL_TO_S
  if until_stopped "$fr"; then
    t0=$(date +%s.%N)
    how=$(drop "fsdp-$fid-rig" v1) && drop "fsdp-$fid-h1" eth0 > /dev/null
    if [ -z "$how" ]; then
      echo "skip stalled link: tc can add neither netem (sch_netem) nor blackhole here"; skipped=$((skipped + 1))
      kill -9 $(host_pids "$fr" 0) $(host_pids "$fr" 1); wait $fpid
    else
      p=$(host_pids "$fr" 1 T); [ -n "$p" ] && kill -CONT $p
      for i in $(seq $((STALL_S * 10))); do
        [ -z "$(host_pids "$fr" 0)$(host_pids "$fr" 1)" ] && break; sleep 0.1
      done
      el=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.1f}')")
      left_ranks="$(host_pids "$fr" 0)$(host_pids "$fr" 1)"
      re="collective timeout: rank [0-3] waited [0-9.]+ s \(limit $STALL_TO_S s\) in [a-z_]+ #[0-9]+.*peer watch: no word from host"
      rcs=$(cat "$tmp"/st.*.err | grep -E '^rc=' | grep -v '^rc=0$' | wc -l) # those whose wrapper saw the end
      if [ -z "$left_ranks" ] && ! grep -q '^rc=0$' "$tmp"/st.*.err \
         && msg=$(ranks_said st "$re h1-$fid" 0 1) && msg=$(ranks_said st "$re h0-$fid" 2 3); then
        ok "a link dropping every packet ($how): every rank ends in $el s (< $STALL_S s; watchdog $STALL_TO_S s) naming the collective and the silent host ($rcs exit codes seen, none 0)"
      else bad "stalled link ($how): after $el s, ranks left: ${left_ranks:-none}" "${msg:-}" "$(tail -2 "$tmp/st.0.err")"; fi
    fi
  else kill $fpid 2> /dev/null; wait $fpid; bad "stalled link: rank 2 never reached its first forward" "$(tail -3 "$tmp/st.out")"; fi
  rig_gone "$fr" "stalled link" # mpirun waits on the daemon of the cut-off host: down ends it
  wait $fpid
else bad "rig for the stalled link" "cannot make it"; fi

# ---- nothing left behind ----
left=""
while read -r r; do
  pids=$(cat "$r"/h*.pid 2> /dev/null) # the hosts' UTS holders, of a rig still up
  [ -d "$r" ] && "$SIM" down "$r"
  id=${r##*.}
  left="$left$(ip netns list | grep "fsdp-$id-")$(ls -d "$r" 2> /dev/null)"
  for p in $pids; do # gone, or a zombie awaiting its reaper
    [ -e "/proc/$p" ] && [ "$(awk '{print $3}' "/proc/$p/stat" 2> /dev/null)" != Z ] && left="$left process $p"
  done
done < "$tmp/rigs"
if [ -z "$left" ]; then ok "the rigs left nothing behind (namespaces, files, processes)"; else bad "left behind" "$left"; fi

echo "$pass passed, $fail failed, $skipped skipped"
[ "$fail" -eq 0 ]
