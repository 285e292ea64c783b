#!/usr/bin/env bash
# t_ckpt.sh - end-to-end checks of checkpoints with fsdp-train and fsdp-ckpt:
#  - exact resume: 20 steps straight vs 10 + save + resume + 10 (same losses
#    and bit-identical saved parameters and AdamW state);
#  - resharding: saved at N in 1..4, loaded at every M in 1..4: parameters and
#    optimizer state identical (read back by an independent Python reader),
#    and continued training within 1e-5 of the 1-rank continuation;
#  - full <-> sharded round trips are lossless; the safetensors output obeys
#    the format (checked by the Python reader); --init-from takes our file and
#    a Hugging Face GPT-2 style file (HF names, Conv1D transposed, buffers);
#  - a save killed at several points leaves the previous checkpoint loadable; one whose commit
#    fails (FSDP_FAULT ckpt-commit:...:fail) leaves nothing of its own;
#  - truncations and byte corruptions are rejected with a clear message.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"
CKPT="$BUILD/fsdp-ckpt"

common=(--model tiny --data synthetic --batch 12 --seq 32 --lr 3e-3 --warmup 2 --threads 1 --sample 0 "${PEAK[@]}")
train() { timeout -k 5 120 "$TRAIN" "${common[@]}" "$@"; }

# The independent reader: Python's standard library only.
cat > "$tmp/st.py" <<'EOF'
import json, struct, sys, array, os

def read_st(path):
    """Validates a safetensors file like any reader would; returns {name: (dtype, shape, bytes)}, metadata."""
    b = open(path, 'rb').read()
    n = struct.unpack('<Q', b[:8])[0]
    assert (8 + n) % 8 == 0, f'{path}: data section not 8-byte aligned'
    h = json.loads(b[8:8 + n].decode('utf-8'))
    meta = h.pop('__metadata__', {})
    data = b[8 + n:]
    spans = sorted((v['data_offsets'][0], v['data_offsets'][1], k) for k, v in h.items())
    at = 0
    for s, e, k in spans:
        assert s == at, f'{path}: {k} does not start where the previous tensor ended'
        at = e
    assert at == len(data), f'{path}: {len(data) - at} bytes after the last tensor'
    out = {}
    for k, v in h.items():
        size = {'F32': 4, 'U8': 1, 'F16': 2, 'BF16': 2, 'I32': 4, 'U16': 2}[v['dtype']]
        numel = 1
        for d in v['shape']:
            numel *= d
        s, e = v['data_offsets']
        assert e - s == numel * size, f'{path}: {k} size'
        out[k] = (v['dtype'], v['shape'], data[s:e])
    return out, meta

def assemble(ckdir):
    """Sharded folder -> {fqn or fqn#state: bytes} using meta.json's byte ranges, cross-checked with each file."""
    m = json.load(open(os.path.join(ckdir, 'meta.json')))
    raw = [open(os.path.join(ckdir, f['name']), 'rb').read() for f in m['files']]
    files = [read_st(os.path.join(ckdir, f['name']))[0] for f in m['files']]
    out = {}
    for p in m['params']:
        for suffix in [''] + ['#' + s for s in m['optim_state']]:
            buf = bytearray()
            for r in sorted(p['ranges'], key=lambda r: r['start']):
                t = files[r['file']][p['fqn'] + suffix][2]
                assert len(t) == 4 * (r['end'] - r['start'])
                if suffix == '':
                    b0, b1 = r['bytes']
                    assert raw[r['file']][b0:b1] == t, 'meta.json byte range disagrees with the file header'
                buf += t
            n = 1
            for d in p['shape']:
                n *= d
            assert len(buf) == 4 * n
            out[p['fqn'] + suffix] = bytes(buf)
    return m, out

def same(dir_a, dir_b):
    """Two sharded folders hold identical params and optimizer state."""
    (ma, a), (mb, b) = assemble(dir_a), assemble(dir_b)
    assert a.keys() == b.keys(), 'different tensors'
    diff = [k for k in a if a[k] != b[k]]
    assert not diff, f'{len(diff)} tensors differ, e.g. {diff[0]}'
    assert ma['optim_step'] == mb['optim_step'] and ma['step'] == mb['step']
    return f'{len(a)} tensors identical'

def losses(path, after):
    """(step, loss, param_norm) of a --log file's steps after a given one."""
    rows = (json.loads(l) for l in open(path))
    return [(j['step'], j['loss'], j['param_norm']) for j in rows if 'step' in j and j['step'] > after]

def close(a, b):
    """Two runs' losses (lists of losses) within 1e-5."""
    assert len(a) == len(b) and len(a) > 0, f'{len(a)} vs {len(b)} steps'
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst <= 1e-5, f'loss differs by {worst}'
    return f'max loss difference {worst:.2e}'

cmd = sys.argv[1]
if cmd == 'same':            # two sharded folders hold identical params and optimizer state
    print(same(sys.argv[2], sys.argv[3]))
elif cmd == 'full-matches':  # a full safetensors file equals a sharded folder's parameters
    t, meta = read_st(sys.argv[3])
    m, a = assemble(sys.argv[2])
    for p in m['params']:
        dt, shape, data = t[p['fqn']]
        assert dt == 'F32' and shape == p['shape'] and data == a[p['fqn']], p['fqn']
    assert len(t) == len(m['params'])
    print(f'{len(t)} tensors match')
elif cmd == 'to-hf':         # our full file -> a Hugging Face GPT-2 style file
    t, meta = read_st(sys.argv[2])
    prefix = sys.argv[4] if len(sys.argv) > 4 else ''
    conv = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
    items = []
    for k, (dt, shape, data) in t.items():
        name = k[len('transformer.'):] if k.startswith('transformer.') else k
        if name.endswith(conv):
            o, i = shape
            a = array.array('f'); a.frombytes(data)
            tr = array.array('f', [a[r * i + c] for c in range(i) for r in range(o)])
            shape, data = [i, o], tr.tobytes()
        items.append((prefix + name, shape, data))
        if name.endswith('attn.c_attn.bias'):   # the causal-mask buffer HF files carry
            items.append((prefix + name.replace('c_attn.bias', 'bias'), [1, 1, 4, 4], bytes(64)))
    items.append(('lm_head.weight', t['transformer.wte.weight'][1], t['transformer.wte.weight'][2]))
    hdr, off = {'__metadata__': {'format': 'pt'}}, 0
    for k, shape, data in items:
        hdr[k] = {'dtype': 'F32', 'shape': shape, 'data_offsets': [off, off + len(data)]}
        off += len(data)
    js = json.dumps(hdr).encode()
    js += b' ' * (-(8 + len(js)) % 8)
    with open(sys.argv[3], 'wb') as f:
        f.write(struct.pack('<Q', len(js)) + js + b''.join(d for _, _, d in items))
elif cmd == 'reseal':        # recompute meta.json's crc32c (Castagnoli) after an edit
    path = sys.argv[2]
    text = open(path).read()
    pre = '{\n\t"crc32c":\t"'
    assert text.startswith(pre)
    body = text[:len(pre)] + '00000000' + text[len(pre) + 8:]
    crc = 0xffffffff
    for byte in body.encode():
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    open(path, 'w').write(body[:len(pre)] + '%08x' % (crc ^ 0xffffffff) + body[len(pre) + 8:])
elif cmd == 'losses':        # steps and losses of a --log file from a given step on
    for step, loss, pnorm in losses(sys.argv[2], int(sys.argv[3])):
        print(step, repr(loss), repr(pnorm))
elif cmd == 'reshard':       # reshard TMP LOADED CONTINUED: the resharding checks of the pairs NM listed
    # (saved at N, loaded at M) in one process: LOADED's state against the saved one, CONTINUED's
    # losses after step 6 against 1 -> 1's; a failure is a line "load|continue<TAB>name<TAB>detail"
    t, failed = sys.argv[2], False
    for nm in sys.argv[3].split():
        try:
            same(f'{t}/s{nm[0]}/step-00000006', f'{t}/r{nm}/step-00000006')
        except Exception as e:
            print(f'load\tload {nm[0]} -> {nm[1]}: state differs\t{type(e).__name__}: {e}'); failed = True
    for nm in sys.argv[4].split():
        try:
            close([l for _, l, _ in losses(f'{t}/c11.jsonl', 6)], [l for _, l, _ in losses(f'{t}/c{nm}.jsonl', 6)])
        except Exception as e:
            print(f'continue\tcontinue {nm[0]} -> {nm[1]} vs 1 -> 1\t{type(e).__name__}: {e}'); failed = True
    sys.exit(failed)
EOF
py() { python3 "$tmp/st.py" "$@"; }

# ---- exact resume at the same world size (2 ranks) ----
train --nproc 2 --steps 20 --save-dir "$tmp/a" --save-every 10 --log "$tmp/a.jsonl" > "$tmp/o" 2>&1 ||
  bad "20 straight steps" "$(tail -3 "$tmp/o")"
train --nproc 2 --steps 20 --resume "$tmp/a/step-00000010" --save-dir "$tmp/b" --log "$tmp/b.jsonl" > "$tmp/o" 2>&1 ||
  bad "resume after 10" "$(tail -3 "$tmp/o")"
py losses "$tmp/a.jsonl" 10 > "$tmp/la"; py losses "$tmp/b.jsonl" 10 > "$tmp/lb"
if [ -s "$tmp/la" ] && cmp -s "$tmp/la" "$tmp/lb" && [ "$(wc -l < "$tmp/lb")" -eq 10 ]; then
  ok "exact resume: steps 11-20 have bit-identical losses and parameter norms"
else bad "exact resume" "$(diff "$tmp/la" "$tmp/lb" | head -4)"; fi
if msg=$(py same "$tmp/a/step-00000020" "$tmp/b/step-00000020" 2>&1); then ok "exact resume: step-20 checkpoints identical ($msg)"
else bad "exact resume: step-20 checkpoints" "$msg"; fi

# ---- resharding: save at N, load at M ----
# (sanitized builds: 1-3, one world, an even and an uneven one, the code paths; the plain suite
# keeps 1-4, as tests/run.sh does for the MPI tests)
worlds="1 2 3 4"
case "$BUILD" in *asan*|*tsan*) worlds="1 2 3" ;; esac
for n in $worlds; do spawn s$n train --nproc $n --steps 6 --save-dir "$tmp/s$n" > "$tmp/os$n" 2>&1; done # at once
for n in $worlds; do reap s$n || bad "save at $n" "$(tail -3 "$tmp/os$n")"; done
rf=0 rc=0 loaded="" continued=""
for n in $worlds; do
  for m in $worlds; do
    # zero steps: load at M and save again at M; beside it (at once: both only read the
    # checkpoint), 3 steps on from it at M
    spawn load train --nproc $m --steps 6 --resume "$tmp/s$n" --save-dir "$tmp/r$n$m" > "$tmp/ol" 2>&1
    spawn cont train --nproc $m --steps 9 --override steps --resume "$tmp/s$n" --log "$tmp/c$n$m.jsonl" > "$tmp/oc" 2>&1
    if reap load; then loaded="$loaded $n$m"; else bad "load $n -> $m" "$(tail -3 "$tmp/ol")"; rf=1; fi
    if reap cont; then continued="$continued $n$m"; else bad "continue $n -> $m" "$(tail -3 "$tmp/oc")"; rc=1; fi
  done
done
# every pair's state and losses read in one process, not a python3 start per pair and check (48)
if ! out=$(py reshard "$tmp" "$loaded" "$continued" 2>&1); then
  while IFS=$'\t' read -r what name detail; do
    bad "${name:-resharding: the reader failed}" "${detail:-$what}"; [ "$what" = continue ] && rc=1 || rf=1
  done <<< "${out:-$'load\tresharding: the reader failed\tno output'}"
fi
[ $rf -eq 0 ] && ok "resharding: saved at N, loaded at M (N, M in $worlds): parameters and AdamW state identical"
[ $rc -eq 0 ] && ok "resharding: continued training at every (N, M) within 1e-5 of the 1-rank continuation"

# ---- full <-> sharded ----
src="$tmp/a/step-00000020"
if "$CKPT" to-full "$src" "$tmp/full.safetensors" > "$tmp/o" 2>&1 &&
   "$CKPT" to-sharded "$tmp/full.safetensors" "$tmp/sh3" 3 >> "$tmp/o" 2>&1 &&
   "$CKPT" to-full "$tmp/sh3" "$tmp/full2.safetensors" >> "$tmp/o" 2>&1 &&
   cmp -s "$tmp/full.safetensors" "$tmp/full2.safetensors" &&
   msg=$(py full-matches "$src" "$tmp/full.safetensors" 2>&1); then
  ok "sharded -> full -> sharded(3) -> full is lossless; Python reader agrees ($msg)"
else bad "full <-> sharded round trip" "$(tail -3 "$tmp/o")" "${msg:-}"; fi
# the trainer's --save-full (rank 0 writes one gathered unit at a time) equals the offline conversion
train --nproc 3 --steps 20 --resume "$src" --save-full "$tmp/full3.safetensors" > "$tmp/o" 2>&1 &&
  cmp -s "$tmp/full.safetensors" "$tmp/full3.safetensors" && ok "--save-full at 3 ranks equals fsdp-ckpt to-full" ||
  bad "--save-full" "$(tail -3 "$tmp/o")"
"$CKPT" verify "$tmp/sh3" > "$tmp/o" 2>&1 && grep -q "verified: ok" "$tmp/o" && ok "fsdp-ckpt verify of a converted folder" ||
  bad "fsdp-ckpt verify" "$(tail -3 "$tmp/o")"

# --init-from: ours and Hugging Face style give the same first loss, at 1 and 3 ranks
py to-hf "$tmp/full.safetensors" "$tmp/hf.safetensors"
py to-hf "$tmp/full.safetensors" "$tmp/hf2.safetensors" transformer.
# (the nine runs at once)
spawn fresh train --steps 1 --log "$tmp/fresh.jsonl" > /dev/null 2>&1
for f in full hf hf2; do
  for n in 1 3; do
    spawn i$f$n train --nproc $n --steps 1 --init-from "$tmp/$f.safetensors" --log "$tmp/i$f$n.jsonl" > "$tmp/oi$f$n" 2>&1
  done
done
spawn i0 train --nproc 3 --steps 1 --init-from "$tmp/hf.safetensors" --init rank0 --log "$tmp/i0.jsonl" > "$tmp/oi0" 2>&1
spawn rs train --steps 1 --resume "$tmp/sh3" --log "$tmp/rs.jsonl" > "$tmp/ors" 2>&1
declare -A first
for f in full hf hf2; do
  for n in 1 3; do
    if reap i$f$n; then
      first[$f$n]=$(py losses "$tmp/i$f$n.jsonl" 0 | awk '{print $2}')
    else bad "--init-from $f at $n ranks" "$(tail -3 "$tmp/oi$f$n")"; fi
  done
done
reap fresh
freshloss=$(py losses "$tmp/fresh.jsonl" 0 | awk '{print $2}')
reap i0
first[hf03]=$(py losses "$tmp/i0.jsonl" 0 | awk '{print $2}')
reap rs
rsloss=$(py losses "$tmp/rs.jsonl" 0 | awk '{print $2}')
near() { python3 -c "import sys; sys.exit(not abs(float(sys.argv[1]) - float(sys.argv[2])) <= 1e-5)" "$1" "$2"; }
if [ -n "${first[full1]:-}" ] && [ "${first[full1]}" = "${first[hf1]:-}" ] && [ "${first[full1]}" = "${first[hf21]:-}" ] &&
   [ -n "${first[full3]:-}" ] && [ "${first[full3]}" = "${first[hf3]:-}" ] && [ "${first[full3]}" = "${first[hf23]:-}" ] && [ "${first[full3]}" = "${first[hf03]:-}" ] &&
   near "${first[full1]}" "${first[full3]}" && [ "${first[full1]}" = "$rsloss" ] && [ "${first[full1]}" != "$freshloss" ]; then
  ok "--init-from: our file and HF names (with and without transformer.), at 1 and 3 ranks, and read on rank 0 only (--init rank0): first loss ${first[full1]} (fresh init $freshloss)"
else bad "--init-from" "full1=${first[full1]:-} hf1=${first[hf1]:-} hf21=${first[hf21]:-} full3=${first[full3]:-} hf3=${first[hf3]:-} hf23=${first[hf23]:-} hf03=${first[hf03]:-} resume=$rsloss fresh=$freshloss"; fi
grep -q "no optimizer state" "$tmp/ors" && ok "resume from a converted folder says it has no optimizer state" ||
  bad "resume from converted folder" "$(tail -3 "$tmp/ors")"

# ---- a save killed part-way leaves the previous checkpoint loadable ----
# (its log is also the uninterrupted run --autoresume below must reproduce)
train --steps 4 --save-dir "$tmp/k" --log "$tmp/k.jsonl" > /dev/null 2>&1
cf=0 crashed=0
for k in 1 40 84 85 86 87 88; do
  FSDP_CKPT_CRASH_AT=$k train --steps 8 --override steps --resume "$tmp/k" --save-dir "$tmp/k" > "$tmp/o" 2>&1
  rc=$?
  if [ $rc -eq 0 ] && [ $k = 88 ]; then
    # past the last crash point (a 1-rank save of the tiny model has 87): the new checkpoint is complete
    [ -f "$tmp/k/step-00000008/meta.json" ] || { bad "crash at $k: exit 0 without a checkpoint"; cf=1; }
    rm -rf "$tmp/k/step-00000008"; continue
  fi
  [ $rc -eq 86 ] || { bad "crash at $k: exit $rc, expected 86" "$(tail -2 "$tmp/o")"; cf=1; continue; }
  crashed=$((crashed + 1))
  if ! train --steps 5 --override steps --resume "$tmp/k" > "$tmp/o" 2>&1 || ! grep -q "step-00000004" "$tmp/o"; then
    bad "crash at $k: previous checkpoint not loadable" "$(tail -3 "$tmp/o")"; cf=1
  fi
done
FSDP_CKPT_CRASH_AT=30 train --nproc 2 --steps 8 --override steps --resume "$tmp/k" --save-dir "$tmp/k" > "$tmp/o" 2>&1
rc=$?
[ $rc -eq 86 ] || { bad "2-rank crash: exit $rc, expected 86" "$(tail -2 "$tmp/o")"; cf=1; }
"$CKPT" verify "$tmp/k/step-00000004" > /dev/null 2>&1 || { bad "2-rank crash: step-4 damaged"; cf=1; }
[ -f "$tmp/k/step-00000008/meta.json" ] && { bad "2-rank crash left a complete-looking step-8"; cf=1; }
train --nproc 2 --steps 5 --override steps --resume "$tmp/k" > "$tmp/o" 2>&1 || { bad "2-rank crash: resume" "$(tail -3 "$tmp/o")"; cf=1; }
[ $cf -eq 0 ] && ok "saves killed at $crashed points (1 rank) and mid-file (2 ranks) leave step-4 loadable"

# --keep-last
train --steps 6 --save-dir "$tmp/kl" --save-every 2 --keep-last 2 > /dev/null 2>&1
[ "$(ls "$tmp/kl" | tr '\n' ' ')" = "step-00000004 step-00000006 " ] && ok "--keep-last 2 keeps the newest two" ||
  bad "--keep-last" "$(ls "$tmp/kl")"
# a removal killed between the rank files and meta.json ([Note: removal order]): the old folder
# still reads as a checkpoint, and the next run's --keep-last removes what is left of it
FSDP_FAULT=ckpt-remove:0:2 train --steps 2 --save-dir "$tmp/kk" --save-every 1 --keep-last 1 > "$tmp/o" 2>&1
rc=$? kk1="$(ls -a "$tmp/kk/step-00000001" 2>&1 | tr '\n' ' ')"
train --steps 3 --override steps --resume "$tmp/kk" --save-dir "$tmp/kk" --save-every 1 --keep-last 1 > "$tmp/o2" 2>&1
rc2=$?
if [ $rc -ne 0 ] && grep -q "raises SIGKILL at ckpt-remove" "$tmp/o" && [ "$kk1" = ". .. meta.json " ] &&
   [ $rc2 -eq 0 ] && grep -q "resumed from .*step-00000002" "$tmp/o2" &&
   [ "$(ls "$tmp/kk" | tr '\n' ' ')" = "step-00000003 " ]; then
  ok "a --keep-last removal killed before meta.json is finished by the next run"
else
  bad "--keep-last killed mid-removal" "exit $rc, step-1 holds: $kk1" "$(tail -2 "$tmp/o")" "exit $rc2" \
    "$(tail -3 "$tmp/o2")" "$(ls "$tmp/kk")"
fi

# a commit that fails (rank 0 moving the complete step-2 folder into place; FSDP_FAULT's fail acts as
# the rename's I/O error): every rank stops naming the folder, the save's own files are gone (no
# step-2, no step-00000002.tmp), step-1 stays, and a resume from it reaches the uninterrupted
# run's loss
train --nproc 2 --steps 3 --log "$tmp/cf_ref.jsonl" > /dev/null 2>&1
FSDP_FAULT=ckpt-commit:0:2:fail train --nproc 2 --steps 3 --save-dir "$tmp/cf" --save-every 1 > "$tmp/o" 2>&1; rc=$?
cf1=$(ls -a "$tmp/cf" 2>&1 | tr '\n' ' ')
train --nproc 2 --steps 3 --resume "$tmp/cf" --log "$tmp/cf.jsonl" > "$tmp/o2" 2>&1; rc2=$?
if [ $rc -ne 0 ] && grep -q "FSDP_FAULT: rank 0 fails at ckpt-commit" "$tmp/o" &&
   grep -q "cf/step-00000002: cannot move .*step-00000002.tmp into place: Input/output error" "$tmp/o" &&
   [ "$cf1" = ". .. .lock step-00000001 " ] && [ -f "$tmp/cf/step-00000001/meta.json" ] &&
   [ $rc2 -eq 0 ] && grep -q "resumed from .*cf/step-00000001" "$tmp/o2" &&
   [ "$(sed -nE 's/.*"step": 3, "loss": ([^,]*),.*/\1/p' "$tmp/cf.jsonl")" = \
     "$(sed -nE 's/.*"step": 3, "loss": ([^,]*),.*/\1/p' "$tmp/cf_ref.jsonl")" ] &&
   [ -n "$(sed -nE 's/.*"step": 3, "loss": ([^,]*),.*/\1/p' "$tmp/cf_ref.jsonl")" ]; then
  ok "a failed commit leaves no file of its own and the previous checkpoint as it was; resuming gives the same step 3"
else
  bad "a failed commit" "exit $rc; the folder holds: $cf1" "$(grep -E 'fsdp|error|cannot' "$tmp/o" | head -4)" "exit $rc2" \
    "$(tail -2 "$tmp/o2")"
fi

# the same for fsdp-ckpt to-sharded (its commit is the library's): into a new folder, nothing stays;
# over an existing checkpoint, that checkpoint stays as it was, byte for byte
"$CKPT" to-full "$tmp/cf/step-00000001" "$tmp/cf.safetensors" > /dev/null 2>&1
sum1=$(cd "$tmp/cf/step-00000001" && md5sum * 2>&1)
FSDP_FAULT=ckpt-commit:0:0:fail "$CKPT" to-sharded "$tmp/cf.safetensors" "$tmp/cfo" 2 > "$tmp/o" 2>&1; rc=$?
FSDP_FAULT=ckpt-commit:0:0:fail "$CKPT" to-sharded "$tmp/cf.safetensors" "$tmp/cf/step-00000001" 2 > "$tmp/o2" 2>&1; rc2=$?
if [ $rc = 1 ] && [ $rc2 = 1 ] && grep -q "cfo: cannot move .*cfo.tmp into place" "$tmp/o" &&
   grep -q "step-00000001: cannot move .*step-00000001.tmp into place" "$tmp/o2" &&
   [ "$(ls -a "$tmp" | grep -c '^cfo')" = 0 ] && [ "$(ls -a "$tmp/cf" | tr '\n' ' ')" = ". .. .lock step-00000001 " ] &&
   [ "$(cd "$tmp/cf/step-00000001" && md5sum * 2>&1)" = "$sum1" ] && [ -n "$sum1" ]; then
  ok "fsdp-ckpt to-sharded whose commit fails: nothing of its own stays, the checkpoint it would replace stays as it was"
else bad "to-sharded with a failed commit" "exits $rc $rc2" "$(tail -1 "$tmp/o")" "$(tail -1 "$tmp/o2")" "$(ls -a "$tmp" "$tmp/cf")"; fi
# a rank file of a checkpoint is no full file: to-sharded refused it as its only input (it wrote the rank's
# flat shards as a model's parameters, over the checkpoint it came from)
rf=$(ls "$tmp/cf/step-00000001"/rank-*.safetensors | head -1)
"$CKPT" to-sharded "$rf" "$tmp/cf/step-00000001" 2 > "$tmp/o" 2>&1; rc=$?
if [ $rc != 0 ] && grep -q "rank-.*: a rank file of a sharded checkpoint (rank 0 of [0-9]*), not a full file" "$tmp/o" &&
   [ "$(cd "$tmp/cf/step-00000001" && md5sum * 2>&1)" = "$sum1" ]; then
  ok "fsdp-ckpt to-sharded of a checkpoint's rank file: refused naming it, the checkpoint as it was"
else bad "to-sharded of a rank file" "exit $rc" "$(tail -2 "$tmp/o")"; fi
# a command line fsdp-ckpt cannot read says what is wrong (it said "bad command line"), and --help is help anywhere
"$CKPT" bogus x > /dev/null 2> "$tmp/e1"; rc1=$?
"$CKPT" to-full "$tmp/cf/step-00000001" > /dev/null 2> "$tmp/e2"; rc2=$?
"$CKPT" list --help > "$tmp/h" 2>&1; rc3=$?
if [ $rc1 = 2 ] && grep -q "unknown command 'bogus' (list, verify, to-full, to-sharded)" "$tmp/e1" && [ $rc2 = 2 ] &&
   grep -q "to-full takes DIR OUT.safetensors; 1 argument given" "$tmp/e2" && [ $rc3 = 0 ] && grep -q 'to-sharded' "$tmp/h"
then ok "fsdp-ckpt: an unknown command and a missing argument are named; --help after a command is help"
else bad "fsdp-ckpt usage errors" "exits $rc1 $rc2 $rc3" "$(head -1 "$tmp/e1")" "$(head -1 "$tmp/e2")" "$(head -1 "$tmp/h")"; fi
"$CKPT" list "$tmp/cf" > /dev/null 2> "$tmp/e4"; rc=$?
[ $rc = 1 ] && grep -q "cf: no meta.json: a folder of checkpoints, not one; give one of them, e.g. .*cf/step-00000001" "$tmp/e4" &&
  ok "fsdp-ckpt list of a --save-dir names a checkpoint in it" || bad "fsdp-ckpt list of a save folder" "exit $rc" "$(cat "$tmp/e4")"
# a checkpoint folder renamed by hand (step-9, not step-00000009) is not one of the save's: it was
# listed as step-00000009, which --resume then could not open
mkdir "$tmp/ren" && cp -r "$tmp/cf/step-00000001" "$tmp/ren/" && cp -r "$tmp/cf/step-00000001" "$tmp/ren/step-9"
"$TRAIN" --resume "$tmp/ren" --steps 1 --override steps > "$tmp/o" 2>&1; rc=$?
if [ $rc = 0 ] && grep -q "nothing left to train: .*ren/step-00000001 is at step 1" "$tmp/o" && ! grep -q 'step-00000009' "$tmp/o"
then ok "--resume of a folder holding a hand-renamed step-9: the writer's own step-00000001 is the newest"
else bad "--resume beside a renamed checkpoint" "exit $rc" "$(tail -2 "$tmp/o")"; fi

# --autoresume (Composer's autoresume): one command line starts the job and, after it is killed,
# continues it from --save-dir's newest checkpoint, the log appended to; the resumed steps are the
# uninterrupted run's (the 4 steps that saved $tmp/k above)
ar=(--steps 4 --save-dir "$tmp/ar" --save-every 2 --autoresume --log "$tmp/ar.jsonl")
FSDP_FAULT=forward:0:3 train "${ar[@]}" > "$tmp/o1" 2>&1; rc1=$?
train "${ar[@]}" > "$tmp/o2" 2>&1; rc2=$?
cp "$tmp/ar.jsonl" "$tmp/ar2.jsonl"
train "${ar[@]}" > "$tmp/o3" 2>&1; rc3=$?
if [ $rc1 -ne 0 ] && grep -q "autoresume: no checkpoint in .*ar yet: starting afresh" "$tmp/o1" &&
   [ $rc2 -eq 0 ] && grep -q "autoresume: continuing from .*ar/step-00000002" "$tmp/o2" &&
   [ $rc3 -eq 0 ] && grep -q "nothing left to train" "$tmp/o3" &&
   python3 - "$tmp/ar2.jsonl" "$tmp/k.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ref = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2])) if "step" in r}
steps = [r["step"] if "step" in r else "config" for r in rows]
assert steps[:3] == ["config", 1, 2] and steps[-3:] == ["config", 3, 4], steps
assert all(r["loss"] == ref[r["step"]] for r in rows if "step" in r), (rows, ref)
PY
then ok "--autoresume starts the job, continues it after a kill with the uninterrupted run's losses, and stops when done"
else bad "--autoresume" "exits $rc1 $rc2 $rc3" "$(grep autoresume "$tmp/o1" "$tmp/o2")" "$(tail -2 "$tmp/o2")" \
  "$(tail -2 "$tmp/o3")"; fi
# --autoresume where the ranks see different --save-dir contents (each host's own disk; here each
# rank its own working folder under one mpirun and a relative --save-dir): every rank stops naming
# the folder before any loads, the checkpoint one of them found is left as it was
T=$(realpath "$TRAIN")
mkdir -p "$tmp/host0" "$tmp/host1"
(cd "$tmp/host0" && timeout -k 5 120 "$T" "${common[@]}" --steps 2 --save-dir ck) > "$tmp/o" 2>&1
sum0=$(cat "$tmp/host0/ck/step-00000002"/* 2> /dev/null | md5sum)
hr=("$T" "${common[@]}" --steps 4 --save-dir ck --autoresume)
timeout -k 5 120 mpirun --oversubscribe -np 1 --wdir "$tmp/host0" "${hr[@]}" : -np 1 --wdir "$tmp/host1" "${hr[@]}" \
  > "$tmp/o2" 2>&1; rc=$?
if [ -f "$tmp/host0/ck/step-00000002/meta.json" ] && [ $rc -ne 0 ] && [ $rc -ne 124 ] &&
   grep -q "the ranks find different checkpoints in --save-dir 'ck'" "$tmp/o2" &&
   [ "$(cat "$tmp/host0/ck/step-00000002"/* | md5sum)" = "$sum0" ] && [ -z "$(ls -A "$tmp/host1/ck" 2> /dev/null)" ] &&
   ! grep -q "^step" "$tmp/o2"; then
  ok "--autoresume with a checkpoint on one host's --save-dir only: every rank stops naming the folder"
else bad "--autoresume, ranks disagreeing" "exit $rc" "$(tail -4 "$tmp/o2")" "$(ls "$tmp/host0/ck" "$tmp/host1/ck" 2>&1)"; fi
"$TRAIN" --model tiny --data synthetic --steps 2 --autoresume > "$tmp/o" 2>&1; rc=$?
[ $rc -eq 2 ] && grep -q -- "--autoresume needs --save-dir" "$tmp/o" && ok "--autoresume without --save-dir: usage error" ||
  bad "--autoresume without --save-dir" "exit $rc" "$(head -2 "$tmp/o")"

# SIGUSR1 ([Note: stop on SIGUSR1] in tools/fsdp-train.c), sent to the launcher as a batch system
# would: both ranks stop after the same step, save it, exit 3; the same command with --autoresume
# then continues from it
"$TRAIN" "${common[@]}" --nproc 2 --steps 100000 --save-dir "$tmp/su" --save-every 100000 --log "$tmp/su.jsonl" \
  > "$tmp/o" 2>&1 & # not through train's timeout: the signal is for fsdp-train's launcher itself
pid=$!
for _ in $(seq 600); do grep -q "^step" "$tmp/o" && break; sleep 0.1; done
(sleep 120 && kill -9 $pid) > /dev/null 2>&1 & guard=$! # a run that ignored the signal ends
kill -USR1 $pid 2> /dev/null; wait $pid; rc=$?
pkill -P $guard 2> /dev/null; kill $guard 2> /dev/null
n=$(ls "$tmp/su" 2> /dev/null | sed -n 's/^step-0*\([0-9][0-9]*\)$/\1/p')
logged=$(python3 -c 'import json, sys; print([json.loads(l)["step"] for l in open(sys.argv[1]) if "\"step\"" in l][-1])' \
  "$tmp/su.jsonl" 2> /dev/null)
if [ $rc -eq 3 ] && [ -n "$n" ] && [ "$n" = "$logged" ] && [ -f "$tmp/su/step-$(printf %08d "$n")/meta.json" ] &&
   grep -q "stopping after step $n of 100000 on SIGUSR1" "$tmp/o" &&
   train --nproc 2 --steps $((n + 2)) --override steps --save-dir "$tmp/su" --save-every 100000 --autoresume \
     --log "$tmp/su.jsonl" > "$tmp/o2" 2>&1 && grep -q "autoresume: continuing from .*step-$(printf %08d "$n")" "$tmp/o2" &&
   [ -f "$tmp/su/step-$(printf %08d $((n + 2)))/meta.json" ]; then
  ok "SIGUSR1 stops both ranks after step $n with its checkpoint (exit 3), and --autoresume continues"
else bad "SIGUSR1" "exit $rc, checkpoint step '$n', last logged step '$logged'" "$(grep -v '^step' "$tmp/o" | tail -3)" \
  "$(tail -2 "$tmp/o2" 2> /dev/null)"; fi

# ---- corruption and truncation of a sharded checkpoint ----
good="$tmp/s2/step-00000006"
rankf="$good/rank-00001-of-00002.safetensors"
size=$(stat -c %s "$rankf")
hdr=$(python3 -c "import struct,sys; print(8 + struct.unpack('<Q', open(sys.argv[1],'rb').read(8))[0])" "$rankf")
sf=0 n=0
for cut in 0 4 8 $((hdr / 2)) $((hdr - 1)) $hdr $((hdr + 3)) $((size / 2)) $((size - 4)) $((size - 1)); do
  rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"
  truncate -s $cut "$tmp/bad/rank-00001-of-00002.safetensors"
  n=$((n + 1))
  if "$CKPT" verify "$tmp/bad" > /dev/null 2> "$tmp/e" || ! grep -q "rank-00001-of-00002.safetensors" "$tmp/e"; then
    bad "truncation to $cut bytes not rejected with the file named" "$(cat "$tmp/e")"; sf=1
  fi
done
for i in $(seq 1 24); do
  off=$(( hdr + (size - hdr) * i / 25 ))
  rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"
  printf '\x5a' | dd of="$tmp/bad/rank-00001-of-00002.safetensors" bs=1 seek=$off conv=notrunc 2> /dev/null
  cmp -s "$rankf" "$tmp/bad/rank-00001-of-00002.safetensors" && continue
  n=$((n + 1))
  if "$CKPT" verify "$tmp/bad" > /dev/null 2> "$tmp/e" || ! grep -q "checksum mismatch" "$tmp/e"; then
    bad "corruption at byte $off not rejected" "$(cat "$tmp/e")"; sf=1
  fi
done
[ $sf -eq 0 ] && ok "$n truncations and data corruptions of a rank file rejected, naming the file/tensor"

# the trainer refuses them with a clear message and a non-zero exit, on every world size
# expect_resume_error NAME PATTERN NPROC: starts a resume from $tmp/bad (moved to a folder of its
# own); resume_errors_checked waits for them and checks each (the runs at once: those of several
# ranks spend their time waiting on the launcher, not on a core)
resumes=()
expect_resume_error() {
  local i=${#resumes[@]}
  resumes+=("$1"$'\t'"$2")
  mv "$tmp/bad" "$tmp/bad$i"
  spawn err$i train --nproc $3 --steps 8 --override steps --resume "$tmp/bad$i" > "$tmp/oerr$i" 2>&1
}
resume_errors_checked() {
  local i name pat rc out
  for i in "${!resumes[@]}"; do
    name=${resumes[$i]%%$'\t'*} pat=${resumes[$i]#*$'\t'}
    reap err$i; rc=$?; out=$(cat "$tmp/oerr$i")
    if [ $rc -eq 0 ]; then bad "$name" "exit 0"
    elif [ $rc -ge 124 ]; then bad "$name" "hung or killed (exit $rc)"
    elif ! grep -qE -- "$pat" <<< "$out"; then bad "$name" "lacks /$pat/:" "$(tail -2 <<< "$out")"
    else ok "$name (exit $rc)"; fi
  done
}
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"
printf '\x5a' | dd of="$tmp/bad/rank-00000-of-00002.safetensors" bs=1 seek=$((size - 100)) conv=notrunc 2> /dev/null
expect_resume_error "resume: corrupted data at 3 ranks" "checksum mismatch" 3
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; rm "$tmp/bad/rank-00001-of-00002.safetensors"
expect_resume_error "resume: missing rank file at 2 ranks" "rank-00001-of-00002.safetensors: missing file of the checkpoint" 2
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; truncate -s 300 "$tmp/bad/meta.json"
expect_resume_error "resume: truncated meta.json" "meta.json: checksum mismatch" 1
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; rm "$tmp/bad/meta.json"
expect_resume_error "resume: folder without meta.json" "not a checkpoint folder|no meta.json" 2
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; sed -i 's/"end":\t2048/"end":\t2047/' "$tmp/bad/meta.json"
expect_resume_error "resume: an edited meta.json" "meta.json: checksum mismatch" 2
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; sed -i 's/"end":\t2048/"end":\t2047/' "$tmp/bad/meta.json"
py reseal "$tmp/bad/meta.json"
expect_resume_error "resume: meta.json (resealed) whose ranges do not tile" "gap|cover|do not fit" 2
rm -rf "$tmp/bad"; cp -r "$good" "$tmp/bad"; sed -i -E 's/"seed":\t"[0-9]+"/"seed":\t"-1"/' "$tmp/bad/meta.json"
py reseal "$tmp/bad/meta.json" # strtoull read "-1" as 2^64 - 1
expect_resume_error "resume: meta.json (resealed) with the seed \"-1\"" '"seed" is not a decimal string' 1
resume_errors_checked
out=$(train --model small --steps 8 --resume "$tmp/sh3" 2>&1); rc=$? # converted: no model_config (t_ckpt_model.sh)
[ $rc -ne 0 ] && grep -q "checkpoint shape" <<< "$out" && ok "resume into a different model names the parameter and shapes" ||
  bad "model mismatch" "$(tail -2 <<< "$out")"
out=$(train --steps 1 --init-from "$tmp/nonexistent.safetensors" 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "nonexistent.safetensors: cannot open" <<< "$out" && ok "--init-from a missing file" ||
  bad "--init-from missing" "$out"

finish
