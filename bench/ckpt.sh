#!/usr/bin/env bash
# bench/ckpt.sh - sharded checkpoint save and load of GPT-2 124M with AdamW
# state (params + m + v, 12 bytes per parameter) at 1, 2 and 4 ranks:
#  - save time (fsdp-train --steps 1 --save-dir: saved after one step, so the
#    AdamW state is real memory, not untouched zero pages; includes the
#    fsyncs) and MB/s,
#    against plain sequential writes of the same number of bytes measured in
#    the same run: dd conv=fsync, and a C writer (bench/ckpt_write: 8 MiB
#    pwrites from memory + one fsync); ratio = save / the faster of the two,
#    the target is >= 0.7. ckpt_write also gives the CRC-32C speed alone;
#  - load time (fsdp-train --resume, reading every byte and checking its
#    CRC-32C) and MB/s, against a sequential read of the same files (cat);
#    both from the page cache when the kernel keeps them there (no cache drop);
#  - peak RSS per rank of a run that only initialises and saves, of a run that
#    trains one step, and of one that trains one step and saves (the target:
#    saving needs no more than training, so the last two are equal).
# Usage: bench/ckpt.sh [REPS]   (default 3; medians). RANKS="1 2" to choose
# the world sizes, MODEL=tiny SEQ=32 for a quick check of the script.
# THREADS=N: --threads of every run (default 0, the trainer's own: the cores
# over the local ranks, so one rank saves and loads on all of them).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
REPS=${1:-3}
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
tmp=$(mktemp -d -p "${BENCH_TMP:-/tmp}"); trap 'rm -rf "$tmp"' EXIT
common=(--model "${MODEL:-gpt2}" --data synthetic --batch 4 --seq "${SEQ:-256}" --sample 0 --threads "${THREADS:-0}")
med() { python3 -c "import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
now() { date +%s.%N; }

printf "%-6s %10s %7s %9s %8s %8s %6s %7s %9s %9s %8s %9s %9s %9s\n" ranks bytes save_s save_MB/s dd_MB/s cw_MB/s ratio load_s load_MB/s cat_MB/s crc_MB/s rss_save rss_train rss_tr+sv
for n in ${RANKS:-1 2 4}; do
  saves=() loads=() dds=() cats=() cws=() crcs=()
  for r in $(seq 1 "$REPS"); do
    rm -rf "$tmp/c"
    "$BUILD/fsdp-train" "${common[@]}" --nproc $n --steps 1 --save-dir "$tmp/c" > "$tmp/save.out" 2>&1 ||
      { cat "$tmp/save.out"; exit 1; }
    saves+=("$(sed -nE 's/^saved .* in ([0-9.]+) s$/\1/p' "$tmp/save.out")")
    rss_trsv=$(sed -nE 's/.*peak RSS ([0-9]+) MB per rank.*/\1/p' "$tmp/save.out")
    bytes=$(du -sb "$tmp/c/step-00000001" | awk '{print $1}')
    "$BUILD/fsdp-train" "${common[@]}" --nproc $n --steps 2 --override steps --resume "$tmp/c" > "$tmp/load.out" 2>&1 ||
      { cat "$tmp/load.out"; exit 1; }
    loads+=("$(sed -nE 's/^resumed .*, ([0-9.]+) s$/\1/p' "$tmp/load.out")")
    t0=$(now); cat "$tmp"/c/step-00000001/* > /dev/null; t1=$(now)
    cats+=("$(python3 -c "print($bytes / 1e6 / ($t1 - $t0))")")
    rm -rf "$tmp/c"
    t0=$(now)
    dd if=/dev/zero of="$tmp/ref" bs=4M count=$(( (bytes + 4194303) / 4194304 )) conv=fsync status=none
    t1=$(now)
    rm -f "$tmp/ref"
    dds+=("$(python3 -c "print($bytes / 1e6 / ($t1 - $t0))")")
    "$BUILD/bench/ckpt_write" "$tmp/ref" "$bytes" > "$tmp/cw.out"
    cws+=("$(awk '$1 == "plain" {print $2}' "$tmp/cw.out")")
    crcs+=("$(awk '$1 == "crc" {print $2}' "$tmp/cw.out")")
  done
  "$BUILD/fsdp-train" "${common[@]}" --nproc $n --steps 1 > "$tmp/train.out" 2>&1 || { cat "$tmp/train.out"; exit 1; }
  rss_train=$(sed -nE 's/.*peak RSS ([0-9]+) MB per rank.*/\1/p' "$tmp/train.out")
  rm -rf "$tmp/c"
  "$BUILD/fsdp-train" "${common[@]}" --nproc $n --steps 0 --save-dir "$tmp/c" > "$tmp/save0.out" 2>&1 ||
    { cat "$tmp/save0.out"; exit 1; }
  rss_save=$(sed -nE 's/.*peak RSS ([0-9]+) MB per rank.*/\1/p' "$tmp/save0.out")
  rm -rf "$tmp/c"
  s=$(med "${saves[@]}"); l=$(med "${loads[@]}"); d=$(med "${dds[@]}"); c=$(med "${cats[@]}")
  w=$(med "${cws[@]}"); k=$(med "${crcs[@]}")
  python3 - "$n" "$bytes" "$s" "$d" "$w" "$l" "$c" "$k" "$rss_save" "$rss_train" "$rss_trsv" <<'PY'
import sys
n, b, s, d, w, l, c, k, rs, rt, rts = sys.argv[1:]
b, s, d, w, l, c, k = int(b), max(float(s), 0.005), float(d), float(w), max(float(l), 0.005), float(c), float(k)  # s, l: printed to 0.01 s
print(f"{n:<6} {b:>10} {s:>7.2f} {b/1e6/s:>9.0f} {d:>8.0f} {w:>8.0f} {b/1e6/s/max(d, w):>6.2f} {l:>7.2f} {b/1e6/l:>9.0f} {c:>9.0f} {k:>8.0f} {rs:>9} {rt:>9} {rts:>9}")
PY
done
