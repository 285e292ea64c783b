#!/usr/bin/env bash
# t_ckpt_model.sh - the model config travels with a checkpoint, and
# `fsdp-ckpt to-sharded` takes any full safetensors file:
#  - fsdp-train --resume DIR without model flags rebuilds the saved model
#    (same losses as with the right flags); --model / --model-config that
#    contradict meta.json's model_config fail naming the flag and both values;
#  - to-sharded converts our file, an F32 file with our FQNs written by
#    another tool (Python here; no fsdp.c metadata, its own tensor order) and
#    a Hugging Face GPT-2 style file (bare HF names, Conv1D (in, out),
#    buffers, lm_head.weight): each folder holds exactly the original values
#    (read back by an independent Python reader) and trains on identically;
#  - to-sharded --model checks the file against the model (a missing or
#    misshapen parameter is named with both shapes) and records the config,
#    so --resume of the converted folder needs no model flags;
#  - --init-from takes the Python-written file with our FQNs as ours.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"
CKPT="$BUILD/fsdp-ckpt"

nomodel=(--data synthetic --batch 12 --seq 32 --lr 3e-3 --warmup 2 --threads 1 --sample 0)
train() { timeout -k 5 120 "$TRAIN" "${nomodel[@]}" "$@"; }

cat > "$tmp/st.py" <<'EOF'
import json, struct, sys, array, os

def read_st(path):
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    h = json.loads(b[8:8 + n].decode('utf-8'))
    meta = h.pop('__metadata__', {})
    out = {}
    for k, v in h.items():
        s, e = v['data_offsets']
        assert v['dtype'] == 'F32'
        out[k] = (v['shape'], b[8 + n + s:8 + n + e])
    return out, meta

def write_st(path, items, meta):
    hdr, off = {'__metadata__': meta}, 0
    for k, shape, data in items:
        hdr[k] = {'dtype': 'F32', 'shape': shape, 'data_offsets': [off, off + len(data)]}
        off += len(data)
    js = json.dumps(hdr).encode()
    js += b' ' * (-(8 + len(js)) % 8)
    with open(path, 'wb') as f:
        f.write(struct.pack('<Q', len(js)) + js + b''.join(d for _, _, d in items))

def assemble(ckdir):
    """Sharded folder -> {fqn: (shape, bytes)} from meta.json's byte ranges."""
    m = json.load(open(os.path.join(ckdir, 'meta.json')))
    raw = [open(os.path.join(ckdir, f['name']), 'rb').read() for f in m['files']]
    out = {}
    for p in m['params']:
        buf = bytearray()
        for r in sorted(p['ranges'], key=lambda r: r['start']):
            b0, b1 = r['bytes']
            buf += raw[r['file']][b0:b1]
        out[p['fqn']] = (p['shape'], bytes(buf))
    return m, out

conv = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
cmd = sys.argv[1]
if cmd == 'plain':           # our full file -> the same tensors in reverse order, no fsdp.c metadata
    t, _ = read_st(sys.argv[2])
    write_st(sys.argv[3], [(k, s, d) for k, (s, d) in reversed(list(t.items()))], {'format': 'pt'})
elif cmd == 'plain-lm':        # as plain, plus a tied lm_head.weight (nanoGPT's state dict): not HF
    t, _ = read_st(sys.argv[2])
    items = [(k, s, d) for k, (s, d) in t.items()]
    items.append(('lm_head.weight',) + t['transformer.wte.weight'])
    write_st(sys.argv[3], items, {'format': 'pt'})
elif cmd == 'plain-dup':       # as plain, plus 'ln_f.bias' beside 'transformer.ln_f.bias': one parameter twice
    t, _ = read_st(sys.argv[2])
    items = [(k, s, d) for k, (s, d) in t.items()]
    items.append(('ln_f.bias',) + t['transformer.ln_f.bias'])
    write_st(sys.argv[3], items, {'format': 'pt'})
elif cmd == 'to-hf':         # our full file -> Hugging Face GPT-2 style (bare names), optionally dropping a tensor
    t, _ = read_st(sys.argv[2])
    drop = sys.argv[4] if len(sys.argv) > 4 else None
    items = []
    for k, (shape, data) in t.items():
        name = k[len('transformer.'):]
        if name == drop:
            continue
        if name.endswith(conv):
            o, i = shape
            a = array.array('f'); a.frombytes(data)
            data, shape = array.array('f', [a[r * i + c] for c in range(i) for r in range(o)]).tobytes(), [i, o]
        items.append((name, shape, data))
        if name.endswith('attn.c_attn.bias'):
            items.append((name.replace('c_attn.bias', 'bias'), [1, 1, 4, 4], bytes(64)))
    items.append(('lm_head.weight', t['transformer.wte.weight'][0], t['transformer.wte.weight'][1]))
    write_st(sys.argv[3], items, {'format': 'pt'})
elif cmd == 'poke':          # a crc-less file with element IDX of tensor NAME set to VALUE (nan, inf, -inf)
    t, meta = read_st(sys.argv[2])
    name, idx, val = sys.argv[4], int(sys.argv[5]), float(sys.argv[6])
    items = []
    for k, (shape, data) in t.items():
        if k == name:
            a = array.array('f'); a.frombytes(data); a[idx] = val; data = a.tobytes()
        items.append((k, shape, data))
    write_st(sys.argv[3], items, {'format': 'pt'})
elif cmd == 'same':          # sharded folder holds exactly the tensors of a full file (ours)
    t, _ = read_st(sys.argv[3])
    m, a = assemble(sys.argv[2])
    assert set(a) == set(t), f'names differ: {sorted(set(a) ^ set(t))[:4]}'
    for k in t:
        assert a[k][0] == t[k][0], f'{k}: shape {a[k][0]} vs {t[k][0]}'
        assert a[k][1] == t[k][1], f'{k}: values differ'
    cfg = m.get('model_config')
    print(f'{len(t)} tensors, {len(m["files"])} files, model_config {cfg}')
elif cmd == 'losses':
    for l in open(sys.argv[2]):
        j = json.loads(l)
        if 'step' in j: print(j['step'], repr(j['loss']))
EOF
py() { python3 "$tmp/st.py" "$@"; }

# ---- --resume takes the model from the checkpoint ----
train --model tiny --nproc 2 --steps 3 --save-dir "$tmp/a" > "$tmp/o" 2>&1 || bad "save" "$(tail -3 "$tmp/o")"
ck="$tmp/a/step-00000003"
if train --steps 5 --override steps --resume "$ck" --log "$tmp/l0.jsonl" > "$tmp/o0" 2>&1 &&
   train --model tiny --steps 5 --override steps --resume "$ck" --log "$tmp/l1.jsonl" > "$tmp/o1" 2>&1 &&
   [ -s "$tmp/l0.jsonl" ] && [ "$(py losses "$tmp/l0.jsonl")" = "$(py losses "$tmp/l1.jsonl")" ]; then
  ok "--resume without model flags rebuilds the saved model (losses as with --model tiny)"
else bad "--resume without model flags" "$(tail -2 "$tmp/o0")" "$(tail -2 "$tmp/o1")"; fi
out=$(train --model small --steps 5 --override steps --resume "$ck" 2>&1); rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 124 ] &&
   grep -qE -- "--model small: n_layer [0-9]+, but the checkpoint .*step-00000003 was saved with n_layer 2" <<< "$out"; then
  ok "--model contradicting the checkpoint: names the flag and both values (exit $rc)"
else bad "--model contradicting" "exit $rc" "$(tail -2 <<< "$out")"; fi
printf '{"n_layer": 2, "n_head": 4, "n_embd": 32, "vocab_size": 256, "block_size": 64}\n' > "$tmp/cfg.json"
out=$(train --model-config "$tmp/cfg.json" --steps 5 --override steps --resume "$ck" 2>&1); rc=$?
if [ $rc -ne 0 ] && [ $rc -lt 124 ] && grep -qE -- "--model-config .*cfg.json: n_head 4, but .* n_head 2" <<< "$out"; then
  ok "--model-config contradicting the checkpoint: names the flag and both values"
else bad "--model-config contradicting" "exit $rc" "$(tail -2 <<< "$out")"; fi

# ---- to-sharded: ours, our FQNs from another writer, Hugging Face GPT-2 ----
"$CKPT" to-full "$ck" "$tmp/full.st" > /dev/null || bad "to-full"
py plain "$tmp/full.st" "$tmp/plain.st"
py to-hf "$tmp/full.st" "$tmp/hf.st"
py to-hf "$tmp/full.st" "$tmp/hf-short.st" h.1.mlp.c_fc.bias
conv_ok=1
for spec in "full 2" "plain 3" "hf 2 --model tiny" "hf 1"; do
  set -- $spec
  src=$1; shift
  if "$CKPT" to-sharded "$tmp/$src.st" "$tmp/sh-$src-$1" "$@" > "$tmp/o" 2>&1 &&
     msg=$(py same "$tmp/sh-$src-$1" "$tmp/full.st" 2>&1); then :
  else bad "to-sharded $src.st $*" "$(tail -3 "$tmp/o")" "${msg:-}"; conv_ok=0; fi
done
[ $conv_ok -eq 1 ] && ok "to-sharded of ours, of our FQNs written by Python, and of HF GPT-2: every value as in the original ($msg)"
grep -q "'n_layer': 2" <<< "$(py same "$tmp/sh-hf-2" "$tmp/full.st")" && ok "to-sharded --model records the model config" ||
  bad "to-sharded --model records the config"
# the converted folders train on identically; the one made with --model needs no model flags
declare -A l
for d in full-2 plain-3 hf-1; do
  train --model tiny --steps 1 --resume "$tmp/sh-$d" --log "$tmp/r$d.jsonl" > "$tmp/o" 2>&1 || bad "resume $d" "$(tail -2 "$tmp/o")"
  l[$d]=$(py losses "$tmp/r$d.jsonl" 2> /dev/null)
done
train --nproc 2 --steps 1 --resume "$tmp/sh-hf-2" --log "$tmp/rhf.jsonl" > "$tmp/o" 2>&1 || bad "resume hf-2" "$(tail -2 "$tmp/o")"
l[hf-2]=$(py losses "$tmp/rhf.jsonl" 2> /dev/null)
if [ -n "${l[full-2]}" ] && [ "${l[full-2]}" = "${l[plain-3]}" ] && [ "${l[full-2]}" = "${l[hf-1]}" ] &&
   python3 -c "import sys; a, b = (float(x.split()[1]) for x in sys.argv[1:]); sys.exit(abs(a - b) > 1e-5)" "${l[full-2]}" "${l[hf-2]}"; then
  ok "the converted folders train on identically (loss ${l[full-2]}), the --model one without model flags at 2 ranks"
else bad "converted folders" "full=${l[full-2]} plain=${l[plain-3]} hf1=${l[hf-1]} hf2=${l[hf-2]}"; fi
# --init-from reads the Python-written file with our FQNs like ours (no transposes)
if train --model tiny --steps 1 --init-from "$tmp/plain.st" --log "$tmp/ip.jsonl" > "$tmp/o" 2>&1 &&
   train --model tiny --steps 1 --init-from "$tmp/full.st" --log "$tmp/if.jsonl" > "$tmp/o2" 2>&1 &&
   [ -s "$tmp/ip.jsonl" ] && [ "$(py losses "$tmp/ip.jsonl")" = "$(py losses "$tmp/if.jsonl")" ]; then
  ok "--init-from a file with our FQNs but no fsdp.c metadata loads as ours"
else bad "--init-from plain" "$(tail -2 "$tmp/o")"; fi
py plain-lm "$tmp/full.st" "$tmp/plain-lm.st"
out=$("$CKPT" to-sharded "$tmp/plain-lm.st" "$tmp/x0" --model tiny 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "tensor 'lm_head.weight' is no parameter of the model" <<< "$out" &&
  ok "our layout with an extra lm_head.weight is not taken for HF: the extra tensor is named" ||
  bad "plain + lm_head" "exit $rc" "$out"
py plain-dup "$tmp/full.st" "$tmp/plain-dup.st"
out=$(train --model tiny --steps 1 --init-from "$tmp/plain-dup.st" 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "plain-dup.st: tensors 'transformer.ln_f.bias' and 'ln_f.bias' name one parameter; keep one" <<< "$out" &&
  ok "--init-from a file naming one parameter twice (with and without 'transformer.') says so" ||
  bad "a parameter named twice" "exit $rc" "$(tail -2 <<< "$out")"
out=$(train --steps 1 --resume "$tmp/sh-plain-3" 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "holds no model config" <<< "$out" && ok "--resume of a folder without a model config asks for model flags" ||
  bad "resume without config" "exit $rc" "$(tail -2 <<< "$out")"

# ---- a weight that is not finite is named at the load or the conversion, not at step 1 ----
py poke "$tmp/plain.st" "$tmp/nan.st" transformer.h.1.mlp.c_fc.weight 5 nan
out=$(train --model tiny --steps 1 --init-from "$tmp/nan.st" 2>&1); rc=$?
if [ $rc -ne 0 ] && grep -q "nan.st: tensor 'transformer.h.1.mlp.c_fc.weight' holds NaN at element 5 of parameter 'transformer.h.1.mlp.c_fc.weight'" <<< "$out" &&
   ! grep -q "^step " <<< "$out"; then ok "--init-from a file with a NaN weight names the file, the tensor and the element"
else bad "--init-from NaN" "exit $rc" "$(tail -2 <<< "$out")"; fi
py poke "$tmp/hf.st" "$tmp/hf-inf.st" h.0.attn.c_attn.weight 7 inf
out=$("$CKPT" to-sharded "$tmp/hf-inf.st" "$tmp/x4" 2 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -q "hf-inf.st: tensor 'h.0.attn.c_attn.weight' holds +inf at element [0-9]* of parameter 'transformer.h.0.attn.c_attn.weight'" <<< "$out" &&
   [ ! -e "$tmp/x4" ] && [ ! -e "$tmp/x4.tmp" ]; then ok "to-sharded of an HF file with an infinite weight names it and leaves nothing"
else bad "to-sharded inf" "exit $rc" "$out" "$(ls -d "$tmp"/x4* 2>&1)"; fi
# a DIR.tmp left by an earlier crashed conversion (our file in it) is not this one's to remove
mkdir "$tmp/x5.tmp" && cp "$tmp/sh-full-2/rank-00000-of-00002.safetensors" "$tmp/x5.tmp/" &&
  before=$(md5sum < "$tmp/x5.tmp/rank-00000-of-00002.safetensors")
out=$("$CKPT" to-sharded "$tmp/hf-inf.st" "$tmp/x5" 2 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -q "holds +inf" <<< "$out" && [ ! -e "$tmp/x5" ] &&
   [ "$(md5sum < "$tmp/x5.tmp/rank-00000-of-00002.safetensors")" = "$before" ]; then
  ok "a failed conversion leaves a DIR.tmp it did not make, and the file in it, as they were"
else bad "to-sharded inf over a crashed DIR.tmp" "exit $rc" "$out" "$(ls -l "$tmp/x5.tmp" 2>&1)"; fi

# ---- to-sharded --model checks the file against the model ----
out=$("$CKPT" to-sharded "$tmp/hf.st" "$tmp/x1" --model small 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -qE -- "hf.st: parameter 'transformer\.[a-z_.0-9]+' has shape \[[0-9, ]+\].*, the model \(n_layer .*\) needs \[.*\(to-sharded with --model small\)" <<< "$out" && [ ! -e "$tmp/x1" ]; then
  ok "to-sharded --model small of a tiny file: names the flag, the parameter and both shapes; writes nothing"
else bad "to-sharded --model mismatch" "exit $rc" "$out"; fi
out=$("$CKPT" to-sharded "$tmp/hf-short.st" "$tmp/x2" 2 --model tiny 2>&1); rc=$?
if [ $rc -eq 1 ] && grep -q "parameter 'transformer.h.1.mlp.c_fc.bias' of the model (n_layer 2 .*) is not in the file" <<< "$out"; then
  ok "to-sharded --model of a file lacking a parameter names it"
else bad "to-sharded missing parameter" "exit $rc" "$out"; fi
# a file that cannot be read is the file's error, not the model flag's
out=$("$CKPT" to-sharded "$tmp/no-such.st" "$tmp/x6" --model tiny 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "^fsdp-ckpt: error: $tmp/no-such.st: cannot open" <<< "$out" &&
  ok "to-sharded --model of a missing file names the file first" || bad "to-sharded missing file" "exit $rc" "$out"
out=$("$CKPT" to-sharded "$tmp/hf.st" "$tmp/x3" 2 --model 2>&1); rc=$?
[ $rc -eq 2 ] && ok "to-sharded: --model without a value is a usage error" || bad "to-sharded usage" "exit $rc" "$out"

finish
