# tests/lib.sh - what every tests/t_*.sh shares; source it first:
#   . "$(dirname "$0")/lib.sh"
# It enters the repo root, sets BUILD (default build) and TRAIN, lets mpirun
# run as root, makes a scratch directory $tmp (removed on exit), and defines
#   ok NAME            count a passed check
#   bad NAME [LINE..]  count a failed check, printing the lines as detail
#   finish             print "N passed, N failed" and exit non-zero on failures
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
