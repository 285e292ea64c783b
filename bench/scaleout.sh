#!/usr/bin/env bash
# bench/scaleout.sh - the scale-out model (fsdp-train --dry-run --net-gbps,
# src/fsdp/commplan.c) against runs on simulated hosts (scripts/simhosts.sh:
# 2 hosts x 2 ranks, Open MPI over TCP between them) whose links are rate
# limited with tc's token bucket (tbf, both ways on each host's veth), with
# the MPI progress thread on (FSDP_MPI_PROGRESS=1: collectives move during
# compute, as the model's overlap assumes).
# Model: the "small" GPT (4 layers, n_embd 128, vocab 256: 0.83M parameters,
# 3.3 MB fp32 per gather), FULL_SHARD, fp32, batch 8 x 32 (BATCH=, SEQ=
# change it: a larger batch gives compute for the prefetch to hide behind).
# The limits are in Mbit/s: choose them below what the machine's TCP path
# moves without a limit, else the limit is not the bottleneck (a busy 2-core
# machine moved about 10 MB/s between the simulated hosts).
# For each limit the median over the timed steps (all but the first) of the
# trainer's exposed communication (exposed_comm_ms: time the compute thread
# waited on collectives) is measured; the measured cost of the limit is that
# minus the same median without a limit. The prediction is fsdp_plan_comm's
# exposed communication at the limit minus its prediction at an unlimited
# link, with the compute time of a step measured in the unlimited run
# (step_ms - update_ms - exposed_comm_ms, median) and its forward's part as
# that run's forward_ms / (forward_ms + backward_ms).
# RPH=1 runs 2 hosts x 1 rank (a core per rank on a 2-core machine) instead of 2 x 2.
# PIN=1 sets CPU 1 aside for communication: every rank's compute on CPU 0 (taskset), its MPI
# progress thread on CPU 1 (FSDP_MPI_PROGRESS_CPU), and with it the kernel's TCP and veth work,
# which runs on the CPU of the thread that sends or receives: the transfers then move beside the
# compute as a NIC's would, instead of taking the compute's cores. The probe runs on CPU 1 too.
# EXTRA="FLAGS" adds fsdp-train flags to the runs and the model alike (e.g. --max-inflight 3).
# CALIBRATE=1 gives the model the path as probed under each limit (see below). The figures in
# bench/README.md: CALIBRATE=1 RPH=1 PIN=1 [BATCH=64 SEQ=64] bench/scaleout.sh 8 100 250 1000 ...
# Usage: bench/scaleout.sh [STEPS] [MBPS...]   (defaults 4, "10 5"); needs root
# (namespaces) and tc. Prints one line per limit and the prediction's error.
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-4}
shift || true
LIMITS=${*:-10 5}
LAT_US=${LAT_US:-50} # veths: tens of microseconds per message, Open MPI's TCP path included
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d)
rig=""
trap '[ -n "$rig" ] && scripts/simhosts.sh down "$rig"; rm -rf "$tmp"' EXIT
trap 'exit 130' INT TERM
command -v tc > /dev/null || { echo "scaleout: no tc (iproute2)"; exit 1; }
RPH=${RPH:-2}
rig=$(scripts/simhosts.sh up 2 "$RPH") || exit 1
id=$(cat "$rig/id")
FLAGS="--model small --batch ${BATCH:-8} --seq ${SEQ:-32} --threads 1 --sample 0 --sharding FULL_SHARD ${EXTRA:-}"

limit() { # limit MBPS|none: tbf both ways on each host's link; its bucket holds BURST_MS
  # (default 2) ms at the rate, at least 64 KB: a bucket smaller than the bytes one timer tick
  # lets through caps the rate below the limit (64 KB at 1 Gbit/s: about half of it)
  local i b=0
  [ "$1" = none ] || b=$(python3 -c "print(max(65536, int($1 * 1e6 / 8 * ${BURST_MS:-2} / 1e3)))")
  for i in 0 1; do
    tc -n "fsdp-$id-h$i" qdisc del dev eth0 root 2> /dev/null
    tc -n "fsdp-$id-rig" qdisc del dev "v$i" root 2> /dev/null
    [ "$1" = none ] && continue
    tc -n "fsdp-$id-h$i" qdisc add dev eth0 root tbf rate "${1}mbit" burst "$b" latency 2s || return 1
    tc -n "fsdp-$id-rig" qdisc add dev "v$i" root tbf rate "${1}mbit" burst "$b" latency 2s || return 1
  done
}
# EAGER=BYTES (default 1 MiB; 0: Open MPI's defaults) sends messages up to that size eagerly
# over TCP: with its default 64 KiB limit a larger message waits for the receiver's
# acknowledgement (rendezvous), and on a shaped link that reply queues behind the other
# direction's data: every other all-gather of 0.8 MB took 90 ms instead of 34 at 100 Mbit/s
# (raw TCP exchanges of the same bytes: 35 ms each), the link idle a third of the time.
EAGER=${EAGER:-1048576}
mca=""
[ "$EAGER" != 0 ] && mca="--mca btl_tcp_eager_limit $EAGER --mca btl_tcp_rndv_eager_limit $EAGER --mca btl_tcp_max_send_size $EAGER"
PIN=${PIN:-0}
pin_run="" pin_probe=""
[ "$PIN" = 1 ] && pin_run="-x FSDP_MPI_PROGRESS_CPU=1 taskset -c 0" pin_probe="taskset -c 1"
run() { # run NAME: a run across the hosts, its per-step log in $tmp/NAME.jsonl
  scripts/simhosts.sh run "$rig" bash -c "mpirun \$SIMHOSTS_MPIRUN --oversubscribe $mca -x FSDP_MPI_PROGRESS=1 -np $((2 * RPH)) $pin_run $BUILD/fsdp-train \
    $FLAGS --steps $STEPS --log $tmp/$1.jsonl" > "$tmp/$1.out" 2>&1 || { tail -5 "$tmp/$1.out"; exit 1; }
}
med() { # med NAME EXPR: the median over the timed steps of EXPR (a Python expression over r)
  python3 - "$tmp/$1.jsonl" "$2" <<'PY'
import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r][1:]  # the step lines, without the first step
print(f"{statistics.median(eval(sys.argv[2], {}, {'r': r}) for r in rows):.1f}")
PY
}
predict_at() { # predict_at GBPS LAT_US COMPUTE_MS: fsdp_plan_comm's exposed communication (ms)
  "$BUILD/fsdp-train" $FLAGS --dry-run --hosts 2 --ranks-per-host "$RPH" --net-gbps "$1" --net-latency-us "$2" \
    --step-compute-ms "$3" --step-forward-ms "$forward" | sed -n 's/.*predicted exposed communication \([0-9.]*\) ms.*/\1/p'
}
predict() { predict_at "$(python3 -c "print($1 / 1000)")" "$LAT_US" "$2"; } # predict MBPS COMPUTE_MS, at LAT_US

probe() { # probe: "GBPS LAT_US" of the path between hosts 0 and 1 as it is now: the rate of
  # 64 MB TCP streams sent both ways at once (as a collective's exchange does; each way's
  # acknowledgements queue behind the other way's data), and half the round trip of 1-byte
  # messages (2000 of them)
  python3 - "fsdp-$id-h0" "fsdp-$id-h1" "$pin_probe" <<'PY'
import socket, subprocess, sys, time
pin = sys.argv[3].split()
srv = subprocess.Popen(pin + ["ip", "netns", "exec", sys.argv[1], "python3", "-c", """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("198.18.0.1", 5599)); s.listen(1)
print("up", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
import threading
t = threading.Thread(target=lambda: [c.sendall(bytes(1 << 20)) for _ in range(64)]); t.start()
n = 0
while n < 64 << 20:
    b = c.recv(1 << 20); n += len(b)
t.join()
c.sendall(b"k")
while True:
    b = c.recv(1)
    if not b: break
    c.sendall(b)
"""], stdout=subprocess.PIPE, text=True)
srv.stdout.readline()
out = subprocess.run(pin + ["ip", "netns", "exec", sys.argv[2], "python3", "-c", """
import socket, time
c = socket.create_connection(("198.18.0.1", 5599)); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
import threading
buf = bytes(1 << 20); got = [0]
def rx():
    while got[0] < (64 << 20) + 1:
        b = c.recv(1 << 20); got[0] += len(b)
r = threading.Thread(target=rx); t = time.perf_counter(); r.start()
for _ in range(64): c.sendall(buf)
r.join(); rate = 64 * 8 * (1 << 20) / (time.perf_counter() - t) / 1e9
t = time.perf_counter()
for _ in range(2000): c.sendall(b"x"); c.recv(1)
print(f"{rate:.3f} {(time.perf_counter() - t) / 2000 / 2 * 1e6:.1f}")
"""], capture_output=True, text=True).stdout
srv.wait(timeout=30)
print(out.strip())
PY
}

limit none && run base
compute=$(med base 'max(1, r["step_ms"] - r["update_ms"] - r["exposed_comm_ms"])')
forward=$(python3 -c "print($compute * $(med base 'r["forward_ms"] / (r["forward_ms"] + r["backward_ms"])'))")
base=$(med base 'r["exposed_comm_ms"]')
base_step=$(med base 'r["step_ms"]')
pbase=$(predict 1000000 "$compute")
echo "no limit: step $base_step ms, compute $compute ms ($forward forward), exposed comm $base ms (model at an unlimited link: $pbase ms)"
if [ "${CALIBRATE:-0}" = 1 ]; then
  # CALIBRATE=1: the model given the path's own figures, as probed (a limit does not make the
  # path faster than it is without one): the total exposed communication, not the difference
  printf "%-8s %10s %9s %10s %12s %14s %8s\n" limit probe_gbps lat_us step_ms exposed_ms predicted_ms error
  for g in none $LIMITS; do
    limit "$g" || { echo "scaleout: tc cannot add tbf here"; exit 1; }
    read -r pg pl < <(probe)
    [ "$g" = none ] || run "c$g"
    limit none
    n=base; [ "$g" = none ] || n="c$g"
    e=$(med "$n" 'r["exposed_comm_ms"]'); s=$(med "$n" 'r["step_ms"]')
    p=$(predict_at "$pg" "$pl" "$compute")
    python3 -c "import sys; g,pg,pl,s,e,p=sys.argv[1],*map(float,sys.argv[2:]); print(f'{g:8s} {pg:10.3f} {pl:9.1f} {s:10.1f} {e:12.1f} {p:14.1f} {100*(p-e)/e:+7.0f}%')" \
      "$g" "$pg" "$pl" "$s" "$e" "$p"
  done
  exit 0
fi
printf "%-8s %10s %12s %14s %14s %8s\n" limit step_ms exposed_ms measured_ms predicted_ms error
for g in $LIMITS; do
  limit "$g" || { echo "scaleout: tc cannot add tbf here"; exit 1; }
  run "l$g"
  limit none
  e=$(med "l$g" 'r["exposed_comm_ms"]')
  s=$(med "l$g" 'r["step_ms"]')
  p=$(predict "$g" "$compute")
  python3 - "$g" "$s" "$e" "$base" "$p" "$pbase" <<'PY'
import sys
g, s, e, b, p, pb = sys.argv[1], *map(float, sys.argv[2:])
m, q = e - b, p - pb
print(f"{g + ' Mb/s':8s} {s:10.1f} {e:12.1f} {m:14.1f} {q:14.1f} {100 * (q - m) / m if m else float('nan'):+7.0f}%")
PY
done
