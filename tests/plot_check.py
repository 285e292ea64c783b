"""plot_check.py - reads an fsdp-plot SVG and its rendering (a PNG from
headless Chromium) and checks that the curves fall where the data says.
Usage: plot_check.py CURVES.svg CURVES.png
The logs are tests/t_plot.sh's: run A (blue, the first colour) has loss
5 - 0.04 step for steps 1..50 with no value at step 25, eval_loss = loss + 0.5
every 10 steps, lr 1e-3 to step 20, 5e-4 to step 35, 2.5e-4 after, tokens
1000 per step; run B (red, the second colour) has loss 3 and lr 8e-4 for
steps 1..30.
Each panel's data-* attributes give its plot area and data range. Prints one
line per check, "FAIL ..." on a failure, and exits non-zero then."""
import struct, sys, zlib
import xml.etree.ElementTree as ET

svg_path, png_path = sys.argv[1], sys.argv[2]
fails = 0


def check(ok, what):
    global fails
    print(("ok " if ok else "FAIL ") + what)
    fails += 0 if ok else 1


def read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, w = 8, b"", None
    while pos < len(data):
        n, typ = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if typ == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0, f"PNG kind {depth} {ctype} {interlace}"
            bpp = 3 if ctype == 2 else 4
        elif typ == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride = zlib.decompress(idat), w * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(h):
        f, line = raw[i], bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b, c = prev[x], prev[x - bpp] if x >= bpp else 0
            if f == 1: line[x] = (line[x] + a) & 255
            elif f == 2: line[x] = (line[x] + b) & 255
            elif f == 3: line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append([tuple(line[x * bpp:x * bpp + 3]) for x in range(w)])
        prev = line
    return w, h, rows


def blue(p):
    r, g, b = p
    return b - r > 50 and b - g > 20


def red(p):
    r, g, b = p
    return r - max(g, b) > 50


root = ET.parse(svg_path).getroot()
W, H = int(root.get("width")), int(root.get("height"))
w, h, px = read_png(png_path)
check((w, h) == (W, H), f"the picture is {w}x{h}, the SVG {W}x{H}")
nonwhite = sum(1 for row in px for p in row if p != (255, 255, 255))
check(nonwhite > 0.02 * w * h, f"the picture is not blank ({nonwhite} of {w * h} pixels drawn)")

panels = {}
for g in root.iter("{http://www.w3.org/2000/svg}g"):
    if g.get("class") == "panel":
        panels[(g.get("data-field"), g.get("data-xfield"))] = g
for key in [("loss", "step"), ("lr", "step"), ("loss", "tokens")]:
    check(key in panels, f"a panel of {key[0]} against {key[1]}")
if fails:
    sys.exit(1)


class Map:
    def __init__(self, g):
        f = lambda k: float(g.get("data-" + k))
        self.x0, self.x1, self.y0, self.y1 = f("x0"), f("x1"), f("y0"), f("y1")
        self.xmin, self.xmax, self.ymin, self.ymax = f("xmin"), f("xmax"), f("ymin"), f("ymax")
        self.g = g

    def data_x(self, c):  # pixel column centre -> data x
        return self.xmin + (c + 0.5 - self.x0) / (self.x1 - self.x0) * (self.xmax - self.xmin)

    def px_x(self, x):
        return self.x0 + (x - self.xmin) / (self.xmax - self.xmin) * (self.x1 - self.x0)

    def px_y(self, y):
        return self.y1 - (y - self.ymin) / (self.ymax - self.ymin) * (self.y1 - self.y0)

    def pixels(self, pred):  # (column, row) of the matching pixels in the plot area and on its edges
        out = []
        for r in range(int(self.y0) - 2, int(self.y1) + 3):
            for c in range(int(self.x0) - 2, int(self.x1) + 3):
                if pred(px[r][c]):
                    out.append((c, r))
        return out


def nice_ticks(m, cls):
    vals = []
    for t in m.g.iter("{http://www.w3.org/2000/svg}text"):
        if t.get("class") == cls:
            s = t.text.strip()
            mult = {"k": 1e3, "M": 1e6, "G": 1e9}.get(s[-1], 1)
            vals.append(float(s.rstrip("kMG")) * mult)
    if len(vals) < 3:
        return False, vals
    d = [b - a for a, b in zip(vals, vals[1:])]
    step = d[0]
    mant = step / 10 ** __import__("math").floor(__import__("math").log10(step))
    even = all(abs(x - step) <= 1e-6 * step for x in d)
    return even and any(abs(mant - k) < 1e-6 for k in (1, 2, 5)), vals


TOL = 3.0
# ---- loss against step: run A's line, its gap and eval points, run B's level ----
m = Map(panels[("loss", "step")])
ok, ticks = nice_ticks(m, "xt")
check(ok and ticks[0] == m.xmin and ticks[-1] == m.xmax and m.xmin <= 1 and m.xmax >= 50,
      f"loss panel: x ticks at nice numbers spanning the data: {ticks}")
ok, ticks = nice_ticks(m, "yt")
check(ok and ticks[0] == m.ymin and ticks[-1] == m.ymax and m.ymin <= 3 and m.ymax >= 5.46,
      f"loss panel: y ticks at nice numbers spanning the data: {ticks}")
train = lambda s: 5 - 0.04 * s
bp = m.pixels(blue)
off = [(c, r) for c, r in bp if min(abs(r + 0.5 - m.px_y(train(m.data_x(c)))),
                                   abs(r + 0.5 - m.px_y(train(m.data_x(c)) + 0.5))) > TOL]
check(len(bp) > 300 and len(off) <= len(bp) // 100,
      f"loss panel: run A's {len(bp)} pixels lie on loss = 5 - 0.04 step or its eval line "
      f"({len(off)} off by more than {TOL} px{', e.g. ' + str(off[:5]) if off else ''})")
on_train = {c for c, r in bp if abs(r + 0.5 - m.px_y(train(m.data_x(c)))) <= TOL}
cols = [c for c in range(int(m.px_x(1)) + 2, int(m.px_x(50)) - 1)
        if not (m.px_x(24) + 1 < c < m.px_x(26) - 1)]
missing = [c for c in cols if c not in on_train]
check(len(missing) <= len(cols) // 50, f"loss panel: run A's line is drawn from step 1 to 50 "
      f"({len(missing)} of {len(cols)} columns without it)")
gap = [c for c in on_train if m.px_x(24) + 3 < c < m.px_x(26) - 3]
check(not gap, f"loss panel: no line across the missing step 25 ({len(gap)} columns drawn there)")
for s in (10, 20, 30, 40, 50):  # eval markers: a blob of blue at (s, loss + 0.5)
    cx, cy = m.px_x(s), m.px_y(train(s) + 0.5)
    n = sum(1 for c, r in bp if abs(c + 0.5 - cx) <= 3 and abs(r + 0.5 - cy) <= 3)
    check(n >= 8, f"loss panel: an eval marker at step {s} ({n} pixels around ({cx:.0f}, {cy:.0f}))")
rp = m.pixels(red)
off = [(c, r) for c, r in rp if abs(r + 0.5 - m.px_y(3.0)) > TOL]
check(len(rp) > 100 and not off, f"loss panel: run B's {len(rp)} pixels lie on loss = 3 ({len(off)} off)")
rcols = {c for c, r in rp} or {-1}
check(min(rcols) <= m.px_x(1) + 2 and max(rcols) >= m.px_x(30) - 2 and max(rcols) <= m.px_x(30) + 3,
      f"loss panel: run B spans steps 1..30 (columns {min(rcols)}..{max(rcols)}, "
      f"expected {m.px_x(1):.0f}..{m.px_x(30):.0f})")

# ---- lr: a step function ----
m = Map(panels[("lr", "step")])
lr = lambda s: 1e-3 if s <= 20 else 5e-4 if s <= 35 else 2.5e-4
bp = m.pixels(blue)
off = []
for c, r in bp:
    s = m.data_x(c)
    lo, hi = sorted((lr(s - 1), lr(s + 1)))  # within a step of a jump, anywhere between the levels
    if not (m.px_y(hi) - TOL <= r + 0.5 <= m.px_y(lo) + TOL):
        off.append((c, r))
check(len(bp) > 300 and len(off) <= len(bp) // 100,
      f"lr panel: the {len(bp)} pixels follow the step function ({len(off)} off{', e.g. ' + str(off[:5]) if off else ''})")
for s, v in ((10, 1e-3), (28, 5e-4), (45, 2.5e-4)):
    c = int(m.px_x(s))
    rows = [r for cc, r in bp if cc == c]
    check(rows and all(abs(r + 0.5 - m.px_y(v)) <= TOL for r in rows),
          f"lr panel: at step {s} the curve is at lr {v:g} (rows {rows}, expected {m.px_y(v):.1f})")
ok, ticks = nice_ticks(m, "yt")
check(ok and m.ymin <= 2.5e-4 and m.ymax >= 1e-3, f"lr panel: y ticks at nice numbers: {ticks}")

# ---- loss against tokens: run A only (run B has no tokens) ----
m = Map(panels[("loss", "tokens")])
bp = m.pixels(blue)
off = [(c, r) for c, r in bp if min(abs(r + 0.5 - m.px_y(train(m.data_x(c) / 1000))),
                                   abs(r + 0.5 - m.px_y(train(m.data_x(c) / 1000) + 0.5))) > TOL]
check(len(bp) > 300 and len(off) <= len(bp) // 100 and m.xmax >= 50000,
      f"tokens panel: the {len(bp)} pixels lie on loss = 5 - 0.04 tokens/1000 ({len(off)} off)")
check(not m.pixels(red), "tokens panel: run B, without tokens, is not drawn")
sys.exit(1 if fails else 0)
