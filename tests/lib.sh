# tests/lib.sh - what every tests/t_*.sh shares; source it first:
#   . "$(dirname "$0")/lib.sh"
# It enters the repo root, sets BUILD (default build) and TRAIN, lets mpirun
# run as root, makes a scratch directory $tmp (removed on exit), and defines
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
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0 fail=0
ok() { echo "ok $1"; pass=$((pass + 1)); }
bad() { echo "FAIL $1"; shift; for l in "$@"; do echo "  $l"; done; fail=$((fail + 1)); }
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
