#!/usr/bin/env bash
# t_plot.sh - fsdp-plot: logs of known curves are drawn where the data says
# (the SVG rendered by headless Chromium, the PNG read back by
# tests/plot_check.py against each panel's data-* mapping); a real
# fsdp-train --log plots, and one a resumed run appended to plots as two
# parts; values no double arithmetic can step through (denormals, +-1e308)
# plot on finite axes in bounded time; bad input gives one line and a non-zero exit;
# -o never replaces a file fsdp-plot did not write. Chromium comes with
# scripts/install-deps.sh --with-torch; without it the rendering checks are
# skipped, saying so. Prints "N passed, N failed".
. "$(dirname "$0")/lib.sh"
PLOT="$BUILD/fsdp-plot"

# run A: loss 5 - 0.04 step (none at step 25), eval every 10, lr steps, tokens;
# a configuration line first, as fsdp-train may write. Run B: loss 3, lr 8e-4, 30 steps.
python3 - "$tmp" <<'PY'
import json, sys
d = sys.argv[1]
with open(f"{d}/a.jsonl", "w") as f:
    f.write(json.dumps({"config": {"model": "tiny"}}) + "\n")
    for s in range(1, 51):
        r = {"step": s, "loss": None if s == 25 else 5 - 0.04 * s,
             "lr": 1e-3 if s <= 20 else 5e-4 if s <= 35 else 2.5e-4, "grad_norm": 1.0, "tokens_per_s": 1000.0,
             "peak_rss_mb": 100.0, "tokens": 1000 * s}
        if s % 10 == 0:
            r["eval_loss"] = 5 - 0.04 * s + 0.5
        f.write(json.dumps(r) + "\n")
with open(f"{d}/b.jsonl", "w") as f:
    for s in range(1, 31):
        f.write(json.dumps({"step": s, "loss": 3.0, "lr": 8e-4, "grad_norm": 2.0, "tokens_per_s": 900.0,
                            "peak_rss_mb": 120.0}) + "\n")
PY

if "$PLOT" "$tmp/a.jsonl" "$tmp/b.jsonl" -o "$tmp/curves.svg" > "$tmp/out" 2>&1 && [ -s "$tmp/curves.svg" ]; then
  ok "two logs plot ($(head -1 "$tmp/out"))"
else bad "two logs plot" "$(head -3 "$tmp/out")"; fi
if python3 -c 'import sys, xml.etree.ElementTree as E; E.parse(sys.argv[1])' "$tmp/curves.svg" 2> "$tmp/xml" \
   && grep -q 'r1.jsonl\|a.jsonl' "$tmp/curves.svg" && grep -q 'b.jsonl' "$tmp/curves.svg" \
   && ! grep -qE 'href=|<image|@import|url\((http|file)' "$tmp/curves.svg"; then
  ok "the SVG is well-formed XML, names both files in the legend and refers to nothing outside itself"
else bad "the SVG is well-formed and self-contained" "$(head -2 "$tmp/xml")"; fi

# ---- rendered in headless Chromium ----
chrome=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$chrome" ]; then
  echo "skip: the rendering checks: no chromium on the PATH (scripts/install-deps.sh --with-torch installs Debian's chromium)"
else
  read -r W H < <(python3 -c 'import sys, xml.etree.ElementTree as E; r = E.parse(sys.argv[1]).getroot(); print(r.get("width"), r.get("height"))' "$tmp/curves.svg")
  timeout -k 5 180 "$chrome" --headless --no-sandbox --disable-gpu --hide-scrollbars --force-device-scale-factor=1 \
    --user-data-dir="$tmp/chrome" --screenshot="$tmp/curves.png" --window-size="$W,$H" "file://$tmp/curves.svg" \
    > "$tmp/chrome.log" 2>&1
  if [ -s "$tmp/curves.png" ]; then
    ok "Chromium renders the SVG (${W}x${H})"
    if python3 tests/plot_check.py "$tmp/curves.svg" "$tmp/curves.png" > "$tmp/check" 2>&1; then
      ok "the curves fall where the data says ($(grep -c '^ok' "$tmp/check") pixel checks)"
    else bad "the curves fall where the data says" "$(grep -v '^ok' "$tmp/check" | head -8)"; fi
  else bad "Chromium renders the SVG" "$(tail -3 "$tmp/chrome.log")"; fi
fi

# ---- a real log ----
if "$TRAIN" --model tiny --data synthetic --batch 4 --seq 16 --steps 4 --threads 1 --sample 0 --log "$tmp/real.jsonl" \
     > "$tmp/train" 2>&1 && "$PLOT" "$tmp/real.jsonl" -o "$tmp/real.svg" > "$tmp/out" 2>&1 \
   && for f in loss lr grad_norm tokens_per_s peak_rss_mb mfu; do grep -q "data-field=\"$f\"" "$tmp/real.svg" || exit 1; done; then
  ok "an fsdp-train --log plots with panels for loss, lr, grad_norm, tokens/s, peak memory and MFU"
else bad "an fsdp-train --log plots" "$(tail -3 "$tmp/train")" "$(head -3 "$tmp/out")"; fi

# ---- a resumed run appends to its --log; each part is its own line ----
# run 4 steps saving at 2 and 4, then resume the step-2 checkpoint into the same log: the log keeps
# the first run's lines, then the resumed run's config record and steps 3, 4 (the same losses:
# resuming reproduces the run), and the plot draws each series as two polylines, not one that
# runs back from step 4 to step 3
if "$TRAIN" --model tiny --data synthetic --batch 4 --seq 16 --steps 4 --threads 1 --sample 0 --log "$tmp/rs.jsonl" \
     --save-dir "$tmp/rsck" --save-every 2 > "$tmp/train" 2>&1 &&
   "$TRAIN" --resume "$tmp/rsck/step-00000002" --threads 1 --log "$tmp/rs.jsonl" > "$tmp/train2" 2>&1 &&
   grep -q "appending to .*rs.jsonl after its earlier lines (the run resumed at step 2)" "$tmp/train2" &&
   python3 - "$tmp/rs.jsonl" <<'PY' &&
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert ["config" in r for r in rows] == [True] + [False] * 4 + [True] + [False] * 2, rows
steps = [r for r in rows if "step" in r]
assert [r["step"] for r in steps] == [1, 2, 3, 4, 3, 4], [r["step"] for r in steps]
assert [r["loss"] for r in steps[2:4]] == [r["loss"] for r in steps[4:]], steps
PY
   "$PLOT" "$tmp/rs.jsonl" -o "$tmp/rs.svg" > "$tmp/out" 2>&1 &&
   [ "$(grep -c 'data-series="loss"' "$tmp/rs.svg")" -eq $((2 * $(grep -c 'data-series="loss"' "$tmp/real.svg"))) ]
then ok "a resumed run appends to its --log, and each part plots as its own line"
else bad "a resumed run appends to its --log" "$(tail -2 "$tmp/train2")" "$(cat "$tmp/rs.jsonl" 2>&1 | cut -c1-80)" \
  "$(grep -c 'data-series="loss"' "$tmp/rs.svg" "$tmp/real.svg" 2>&1)"; fi

# ---- value ranges a double's arithmetic cannot step through: a finite axis, in bounded time ----
# (a span of denormals made the tick step 0, one of -1e308..1e308 made it inf: the tick loops wrote forever;
# each run here is capped at 1 MiB of output and 30 s, in a folder of its own)
mkdir -p "$tmp/range"
printf '{"step": 1, "loss": 0}\n{"step": 2, "loss": 5e-324}\n' > "$tmp/range/denormal.jsonl"
printf '{"step": 1, "loss": 5e-324}\n' > "$tmp/range/one_denormal.jsonl"
printf '{"step": 1, "loss": -1e308}\n{"step": 2, "loss": 1e308}\n' > "$tmp/range/huge.jsonl"
printf '{"step": 1e308, "loss": 1}\n{"step": -1e308, "loss": 2}\n' > "$tmp/range/huge_step.jsonl"
# tokens and loss never on one step: the loss-against-tokens panel has no point to range over
printf '{"step": 1, "tokens": 100, "loss": null}\n{"step": 2, "loss": 1}\n' > "$tmp/range/apart.jsonl"
for n in denormal one_denormal huge huge_step apart; do
  (ulimit -f 1024; timeout -k 5 30 "$PLOT" "$tmp/range/$n.jsonl" -o "$tmp/range/$n.svg") > "$tmp/out" 2>&1; rc=$?
  if [ $rc -eq 0 ] && msg=$(python3 - "$tmp/range/$n.svg" <<'EOF' 2>&1
import math, sys, xml.etree.ElementTree as E
panels = [g for g in E.parse(sys.argv[1]).iter("{http://www.w3.org/2000/svg}g") if g.get("class") == "panel"]
assert panels, "no panel"
for g in panels:
    lim = [float(g.get("data-" + k)) for k in ("xmin", "xmax", "ymin", "ymax")]
    assert all(math.isfinite(v) for v in lim) and lim[0] < lim[1] and lim[2] < lim[3], f"{g.get('data-field')}: {lim}"
EOF
  ); then ok "$n.jsonl plots on finite axes (exit 0, $(stat -c %s "$tmp/range/$n.svg") bytes)"
  else bad "$n.jsonl plots on finite axes" "exit $rc$([ $rc -ge 124 ] && echo ': killed, it wrote past 1 MiB or ran past 30 s')" \
    "${msg:-}" "$(head -2 "$tmp/out")"; fi
done

# ---- bad input: one line, non-zero exit, no output file ----
expect_fail() { # NAME PATTERN ARGS...
  local name=$1 pat=$2; shift 2
  rm -f "$tmp/bad.svg"
  timeout -k 5 60 "$PLOT" "$@" > "$tmp/out" 2> "$tmp/err"
  local rc=$?
  if [ $rc -eq 0 ]; then bad "$name" "exit 0"
  elif [ "$(wc -l < "$tmp/err")" -ne 1 ] || ! grep -qE -- "$pat" "$tmp/err"; then bad "$name" "stderr: $(head -3 "$tmp/err")"
  elif ls "$tmp" | grep -q '\.tmp\.'; then bad "$name" "a temporary file was left: $(ls "$tmp" | grep '\.tmp\.')"
  else ok "$name (exit $rc: $(cat "$tmp/err"))"; fi
}
printf '{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.9}\n{"step": 3, "loss": \n' > "$tmp/broken.jsonl"
printf '{"config": {"lr": 0.001}}\n\n' > "$tmp/nosteps.jsonl"
printf '{"step": "one", "loss": 2.0}\n' > "$tmp/badstep.jsonl"
expect_fail "a missing log" "cannot open '.*nothere.jsonl'" "$tmp/nothere.jsonl" -o "$tmp/bad.svg"
expect_fail "a line that is not JSON names file:line" "broken.jsonl:3: not a JSON object" "$tmp/a.jsonl" "$tmp/broken.jsonl" -o "$tmp/bad.svg"
expect_fail "a log with no steps" "nosteps.jsonl: no steps" "$tmp/nosteps.jsonl" -o "$tmp/bad.svg"
expect_fail "a step that is not a number" "badstep.jsonl:1: \"step\" is not a number" "$tmp/badstep.jsonl" -o "$tmp/bad.svg"
printf '{"step": 1, "loss": 1} {"x": 1}\n' > "$tmp/two.jsonl"
printf '{"step": 1, "loss": "x"}\n' > "$tmp/strloss.jsonl"
expect_fail "two objects on one line (the second went unread)" "two.jsonl:1: not a JSON object \(or more than one\)" \
  "$tmp/two.jsonl" -o "$tmp/bad.svg"
expect_fail "a value that is not a number (it was plotted as missing)" "strloss.jsonl:1: \"loss\" is not a number" \
  "$tmp/strloss.jsonl" -o "$tmp/bad.svg"
expect_fail "a folder as a log" "is a folder" "$tmp" -o "$tmp/bad.svg"
mkfifo "$tmp/fifo.jsonl"
expect_fail "a FIFO as a log is refused at once" "fifo.jsonl' is not a regular file" "$tmp/fifo.jsonl" -o "$tmp/bad.svg"
mkdir -p "$tmp/outdir"
expect_fail "-o a folder is refused" "not a regular file" "$tmp/a.jsonl" -o "$tmp/outdir"
printf 'my notes\n' > "$tmp/notes.svg"
expect_fail "-o a file fsdp-plot did not write is refused" "not written by fsdp-plot" "$tmp/a.jsonl" -o "$tmp/notes.svg"
[ "$(cat "$tmp/notes.svg")" = "my notes" ] && ok "the foreign file is unchanged" || bad "the foreign file is unchanged"
ln -s "$tmp/curves.svg" "$tmp/link.svg"
expect_fail "-o a symbolic link is refused" "not a regular file" "$tmp/a.jsonl" -o "$tmp/link.svg"
"$PLOT" "$tmp/b.jsonl" > /dev/null 2> "$tmp/err"; rc=$?
[ $rc -eq 2 ] && ok "no -o: usage, exit 2" || bad "no -o: usage, exit 2" "exit $rc"
# a file we wrote is replaced, through a temporary file renamed over it
if "$PLOT" "$tmp/b.jsonl" -o "$tmp/curves.svg" > "$tmp/out" 2>&1 && grep -q 'b.jsonl' "$tmp/curves.svg" \
   && ! grep -q 'a.jsonl' "$tmp/curves.svg" && ! ls "$tmp" | grep -q '\.tmp\.'; then
  ok "an SVG fsdp-plot wrote is replaced (no temporary file left)"
else bad "an SVG fsdp-plot wrote is replaced" "$(head -3 "$tmp/out")"; fi
finish
