# tests/lib.sh - what every tests/t_*.sh shares; source it first:
#   . "$(dirname "$0")/lib.sh"
# It enters the repo root, sets BUILD (default build) and TRAIN, lets mpirun
# run as root, has python3 call the interpreter itself, makes a scratch
# directory $tmp (removed on exit), and defines
#   PEAK               fsdp-train flags that skip the MFU peak's measurement
#   spawn NAME CMD..   run CMD in the background (redirect its output): independent runs at
#                      once, on the two cores the suite is sized for, most runs using one
#   reap NAME          wait for it: CMD's exit code
#   expect_input NAME PATTERN -- ARGS..  start fsdp-train ARGS (spawned), which must fail on bad
#                      input: exit 2 within 60 s, one "fsdp-train:" line on stderr matching PATTERN
#   inputs_checked     wait for the expect_input runs and check each
#   ok NAME            count a passed check
#   bad NAME [LINE..]  count a failed check, printing the lines as detail
#   finish             print "N passed, N failed" and exit non-zero on failures
#   same_bits A B      fsdp-train --log files A and B (with steps) print the same loss,
#                      grad_norm and param_norm at every step (the lines with a "step";
#                      the first line of a log is the run's configuration)
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build}
TRAIN="$BUILD/fsdp-train"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# python3 found once and then called directly: a version manager's shim in front of it (pyenv's
# is a shell script) costs 0.4 s a call, and a script calls python3 dozens of times
PYTHON3=$(command python3 -c 'import sys; print(sys.executable)' 2> /dev/null) && [ -n "$PYTHON3" ] || PYTHON3=python3
python3() { command "$PYTHON3" "$@"; }
# fsdp-train flags for runs whose checks read no MFU: its peak given, not measured (the GEMM probe
# takes 0.2 s of every rank at every start, a third of a tiny model's run; t_trainer_mfu_ckpt.sh
# checks the probe and MFU)
PEAK=(--peak-gflops 100)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; shift; for l in "$@"; do echo "  $l"; done; fail=$((fail + 1)); }
declare -A spawned
# at most SPAWN_MAX at once (2 in the sanitized builds, whose processes take several times the memory)
case "$BUILD" in *asan*|*tsan*) SPAWN_MAX=${SPAWN_MAX:-2} ;; *) SPAWN_MAX=${SPAWN_MAX:-4} ;; esac
spawn() {
  while [ "$(jobs -rp | wc -l)" -ge "$SPAWN_MAX" ]; do sleep 0.1; done
  "${@:2}" & spawned[$1]=$!
}
reap() { wait "${spawned[$1]}"; }
inputs=()
expect_input() { # (the runs at once: those of several ranks spend their second or two waiting on the
  # launcher, not on a core)
  local i=${#inputs[@]}
  inputs+=("$1"$'\t'"$2"); shift 3
  spawn in$i timeout -k 5 60 "$TRAIN" "$@" > "$tmp/in$i.out" 2> "$tmp/in$i.err"
}
inputs_checked() {
  local i name pat rc err
  for i in "${!inputs[@]}"; do
    name=${inputs[$i]%%$'\t'*} pat=${inputs[$i]#*$'\t'} err="$tmp/in$i.err"
    reap in$i; rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then bad "$name" "hung (killed by timeout)"
    elif [ $rc -ne 2 ]; then bad "$name" "exit $rc, expected 2" "$(head -3 "$err")"
    elif [ "$(grep -c '^fsdp-train:' "$err")" != 1 ] || ! grep -qE -- "$pat" "$err"; then
      bad "$name" "stderr is not one line matching /$pat/:" "$(head -5 "$err")"
    else ok "$name (exit 2, one line)"; fi
  done
  inputs=()
}
finish() { echo "$pass passed, $fail failed"; [ "$fail" -eq 0 ]; exit; }
# LOG's configuration (its first line) with KEY=JSON values replaced, as a --config file on stdout
config_again() {
  python3 - "$@" <<'EOF'
import json, sys
c = json.loads(open(sys.argv[1]).readline())["config"]
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    c[k] = json.loads(v)
print(json.dumps(c))
EOF
}
same_bits() { # logged with every bit of the doubles; a log without steps matches nothing
  local show='import json,sys; [print(r["loss"], r["grad_norm"], r["param_norm"]) for r in map(json.loads, open(sys.argv[1])) if "step" in r]'
  local a b
  a=$(python3 -c "$show" "$1") && b=$(python3 -c "$show" "$2") && [ -n "$a" ] && [ "$a" = "$b" ]
}
