#!/usr/bin/env bash
# Fuzzes one reader of outside data for a given time with libFuzzer.
# Usage: scripts/fuzz.sh TARGET SECONDS [JOBS]   TARGET: data | config | safetensors | ckpt_meta | idx | bpe (fuzz/fuzz_TARGET.c)
# Builds `make fuzz` (clang, -fsanitize=fuzzer,address,undefined; install with
# scripts/install-deps.sh --with-fuzz), starts from the seed corpus in
# fuzz/corpus/TARGET/ (copied to build-fuzz/inputs/TARGET/, where new inputs
# accumulate between runs) and writes crashers to build-fuzz/artifacts/TARGET/.
# FUZZ_TIMEOUT (seconds, default 10): the time one input may take before it counts as a
# finding (raise it on a loaded machine, where a starved run can pass 10 s).
# Exit 0: no finding. A finding: copy the crasher into fuzz/corpus/TARGET/
# (tests/test_readers.c replays that directory in the normal suite) and fix it.
set -euo pipefail
cd "$(dirname "$0")/.."
target=${1:?usage: scripts/fuzz.sh TARGET SECONDS [JOBS]}
secs=${2:?usage: scripts/fuzz.sh TARGET SECONDS [JOBS]}
jobs=${3:-1}
[ -f "fuzz/fuzz_$target.c" ] || { echo "fuzz.sh: no target fuzz/fuzz_$target.c" >&2; exit 2; }
make -s fuzz >/dev/null
bin=build-fuzz/fuzz/fuzz_$target
work=build-fuzz/inputs/$target art=build-fuzz/artifacts/$target
mkdir -p "$work" "$art"
cp -n fuzz/corpus/"$target"/* "$work"/ 2>/dev/null || true
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
set +e
par=()  # with JOBS > 1, libFuzzer runs parallel workers logging to fuzz-N.log in the cwd
[ "$jobs" -gt 1 ] && par=(-jobs="$jobs" -workers="$jobs")
(cd build-fuzz && "../$bin" -max_total_time="$secs" -timeout="${FUZZ_TIMEOUT:-10}" -rss_limit_mb=2048 -max_len=65536 \
    -print_final_stats=1 -artifact_prefix="../$art/" "${par[@]}" "../$work") 2>&1 |
    grep -vE '^#[0-9]+.*(NEW|REDUCE|pulse)' | tail -n 40
rc=${PIPESTATUS[0]}
set -e
n=$(ls "$art" | wc -l)
echo "fuzz.sh: target $target, ${secs}s, exit $rc, $(ls "$work" | wc -l) corpus inputs, $n findings in $art"
[ "$rc" -eq 0 ] && [ "$n" -eq 0 ]
