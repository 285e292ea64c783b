#!/usr/bin/env bash
# simhosts.sh - simulated hosts on one Linux machine, for trying and testing
# multi-host runs: each host is a network namespace with its own UTS
# namespace (its own hostname), all joined by veth pairs to a bridge in a
# "rig" namespace. Addresses come from the benchmarking range 198.18.0.0/15
# and exist only inside the namespaces: no route leads out of them. Open MPI
# starts across the hosts the normal way: mpirun runs on host 0 and reaches
# the others through its rsh launcher, whose agent (plm_rsh_agent) is a small
# script that enters the host's namespaces and runs orted there, as ssh would.
# Needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN), ip(8), nsenter and unshare.
#
# Usage:
#   scripts/simhosts.sh up HOSTS [SLOTS]   make HOSTS (2-4) hosts of SLOTS slots (default 2);
#                                          prints the rig's directory RIG
#   scripts/simhosts.sh run RIG CMD...     run CMD on host 0 with $SIMHOSTS_MPIRUN set to the
#                                          mpirun options that span the hosts
#   scripts/simhosts.sh down RIG           remove everything the rig made (also kills what
#                                          still runs in its namespaces)
#   scripts/simhosts.sh left ID            print what a rig of id ID (RIG's suffix) left
#                                          behind after down: namespaces, veths, its folder,
#                                          processes, /dev/shm files; nothing if all is gone
#   scripts/simhosts.sh demo [HOSTS]       up, a 2-step training run across the hosts, down
# Example:
#   rig=$(scripts/simhosts.sh up 2) && trap 'scripts/simhosts.sh down "$rig"' EXIT
#   scripts/simhosts.sh run "$rig" sh -c 'mpirun $SIMHOSTS_MPIRUN -np 4 build/fsdp-train ...'
# A forgotten rig: `down` on its directory removes it; every name it made carries the rig's
# id (netns fsdp-ID-*, /tmp/fsdp-simhosts.ID, hostnames hN-ID, and every process started
# in it carries SIMHOSTS_RIG=ID in its environment). `up` first removes the rigs whose owner
# ($SIMHOSTS_OWNER, default the calling process) has died, e.g. a test killed by SIGKILL.
set -u
SELF=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
NET=198.18.0 # /24 inside 198.18.0.0/15

die() { echo "simhosts: $*" >&2; exit 1; }

# can this process make namespaces? (prints why not)
can_rig() {
  [ "$(id -u)" = 0 ] || { echo "not root"; return 1; }
  for t in ip nsenter unshare hostname; do command -v $t > /dev/null || { echo "no $t"; return 1; }; done
  local probe="fsdp-probe-$$"
  ip netns add "$probe" 2> /dev/null || { echo "cannot create a network namespace (ip netns add)"; return 1; }
  ip netns del "$probe"
  unshare --uts true 2> /dev/null || { echo "cannot create a UTS namespace (unshare --uts)"; return 1; }
}

up() {
  local n=${1:-2} slots=${2:-2}
  case "$n" in 2|3|4) ;; *) die "up: HOSTS must be 2, 3 or 4 (got $n)";; esac
  local why; why=$(can_rig) || die "cannot make simulated hosts here: $why"
  sweep
  local rig; rig=$(mktemp -d /tmp/fsdp-simhosts.XXXXXX) || die "mktemp failed"
  local id=${rig##*.}
  echo "$id" > "$rig/id"
  echo "${SIMHOSTS_OWNER:-$PPID}" > "$rig/owner"
  echo "$n" > "$rig/hosts"
  : > "$rig/hostfile"
  {
    ip netns add "fsdp-$id-rig" &&
    ip -n "fsdp-$id-rig" link add br0 type bridge &&
    ip -n "fsdp-$id-rig" link set br0 up &&
    ip -n "fsdp-$id-rig" link set lo up
  } || { down "$rig"; die "up: cannot make the rig's namespace"; }
  for ((i = 0; i < n; i++)); do
    local ns="fsdp-$id-h$i" name="h$i-$id"
    {
      ip netns add "$ns" &&
      ip -n "fsdp-$id-rig" link add "v$i" type veth peer name eth0 netns "$ns" &&
      ip -n "fsdp-$id-rig" link set "v$i" master br0 up &&
      ip -n "$ns" link set lo up &&
      ip -n "$ns" addr add "$NET.$((i + 1))/24" dev eth0 &&
      ip -n "$ns" link set eth0 up
    } || { down "$rig"; die "up: cannot make host $i"; }
    # the host's UTS namespace, held by a sleeping process whose pid the agent enters by
    SIMHOSTS_RIG=$id setsid nsenter --net="/run/netns/$ns" unshare --uts sh -c \
      "hostname '$name' && echo \$\$ > '$rig/h$i.pid' && exec sleep 1000000" \
      < /dev/null > /dev/null 2>&1 &
    for _ in $(seq 100); do [ -s "$rig/h$i.pid" ] && break; sleep 0.05; done
    [ -s "$rig/h$i.pid" ] || { down "$rig"; die "up: host $i's UTS namespace did not come up"; }
    echo "$ns" > "$rig/$name.ns"
    echo "$name slots=$slots" >> "$rig/hostfile"
  done
  # the rsh agent: `agent HOST CMD...` runs CMD through a shell on HOST, as ssh would
  cat > "$rig/agent" <<EOF
#!/bin/sh
exec "$SELF" agent "$rig" "\$@"
EOF
  chmod +x "$rig/agent"
  echo "$rig"
}

# agent RIG [ssh-like options] HOST CMD...: what mpirun calls to start orted on HOST
agent() {
  local rig=$1; shift
  while [ $# -gt 0 ] && [ "${1#-}" != "$1" ]; do shift; done # -x and the like
  local host=$1; shift
  [ -f "$rig/$host.ns" ] || die "agent: no simulated host $host in $rig"
  local i; i=$(grep -n "^$host " "$rig/hostfile" | cut -d: -f1); i=$((i - 1))
  export SIMHOSTS_RIG; SIMHOSTS_RIG=$(cat "$rig/id")
  exec nsenter --target "$(cat "$rig/h$i.pid")" --net --uts sh -c "$*"
}

run() {
  local rig=$1; shift
  [ -s "$rig/h0.pid" ] || die "run: $rig is not a rig"
  # oob and btl over the veths only; vader (shared memory) between ranks of one host
  export SIMHOSTS_MPIRUN="--hostfile $rig/hostfile --mca plm_rsh_agent $rig/agent \
--mca oob_tcp_if_include $NET.0/24 --mca btl_tcp_if_include $NET.0/24 --mca btl tcp,self,vader"
  export SIMHOSTS_RIG; SIMHOSTS_RIG=$(cat "$rig/id")
  nsenter --target "$(cat "$rig/h0.pid")" --net --uts "$@"
}

down() {
  local rig=$1
  [ -f "$rig/id" ] || die "down: $rig is not a rig"
  local id; id=$(cat "$rig/id")
  local ns
  for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^fsdp-$id-"); do
    # whatever still runs in the host (ranks, orted, the UTS holder): ours, by pid
    local pids; pids=$(ip netns pids "$ns" 2> /dev/null)
    [ -n "$pids" ] && kill -9 $pids 2> /dev/null
    ip netns del "$ns" 2> /dev/null
  done
  local holders; holders=$(cat "$rig"/h*.pid 2> /dev/null)
  [ -n "$holders" ] && kill -9 $holders 2> /dev/null
  rm -rf "$rig"
  # return once they are gone (a zombie awaiting its reaper counts as gone)
  for _ in $(seq 200); do # up to 10 s: a loaded machine takes its time
    local p alive=0
    for p in $holders; do
      [ -e "/proc/$p" ] && [ "$(awk '{print $3}' "/proc/$p/stat" 2> /dev/null)" != Z ] && alive=1
    done
    [ $alive = 0 ] && break
    sleep 0.05
  done
}

# left ID: what remains of rig ID, one thing a line
left() {
  local id=$1 p
  [ -n "$id" ] || die "left: give the rig's id"
  ip netns list 2> /dev/null | awk '{print "namespace " $1}' | grep " fsdp-$id-"
  ip -o link show type veth 2> /dev/null | grep -- "fsdp-$id-" | awk '{print "veth " $2}'
  [ -e "/tmp/fsdp-simhosts.$id" ] && echo "folder /tmp/fsdp-simhosts.$id"
  for p in /proc/[0-9]*; do
    [ "$(awk '{print $3}' "$p/stat" 2> /dev/null)" = Z ] && continue # awaiting its reaper
    { tr '\0' '\n' < "$p/environ"; } 2> /dev/null | grep -qx "SIMHOSTS_RIG=$id" &&
      echo "process ${p#/proc/} $(cat "$p/comm" 2> /dev/null)"
  done
  ls /dev/shm 2> /dev/null | grep -- "-$id" | sed 's|^|file /dev/shm/|'
  return 0
}

# removes the rigs whose owner (the process that made them, or $SIMHOSTS_OWNER) is
# gone without taking them down: a test killed with SIGKILL
sweep() {
  local r
  for r in /tmp/fsdp-simhosts.*; do
    [ -s "$r/owner" ] && [ -f "$r/id" ] || continue
    kill -0 "$(cat "$r/owner")" 2> /dev/null || down "$r"
  done
}

demo() {
  local n=${1:-2}
  cd "$(dirname "$SELF")/.." || exit 1
  demo_rig=$(up "$n") || exit 1 # global: the trap runs after this function has returned
  trap 'down "$demo_rig"' EXIT
  trap 'exit 130' INT TERM
  local rig=$demo_rig
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  echo "hosts: $(awk '{print $1}' "$rig/hostfile" | tr '\n' ' ')"
  run "$rig" sh -c 'mpirun $SIMHOSTS_MPIRUN --oversubscribe -np '$((2 * n))' \
    build/fsdp-train --model tiny --steps 2 --batch 8 --seq 32 --threads 1 --sample 0 \
    --sharding HYBRID_SHARD'
}

cmd=${1:-}; [ $# -gt 0 ] && shift
case "$cmd" in
  up) up "$@" ;;
  run) run "$@" ;;
  down) down "$@" ;;
  left) left "$@" ;;
  agent) agent "$@" ;;
  check) can_rig ;;
  demo) demo "$@" ;;
  *) sed -n '2,31p' "$SELF" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
