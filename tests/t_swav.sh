#!/usr/bin/env bash
# t_swav.sh - fsdp-train --task swav (tools/train/task_swav.c) on Fashion-MNIST
# (Debian's dataset-fashion-mnist) with the small CNN as trunk:
#  (1) 2 and 3 ranks (FULL_SHARD, SyncBatchNorm) reproduce the 1-rank run's
#      losses within 1e-5, and the kNN accuracy within 5 test images;
#  (2) after the head's re-initialisation and after every step each rank
#      holds the same prototypes (proto_ranks_agree) and every row has norm 1;
#  (3) with --freeze-prototypes-iters 3 the prototypes stay bit-identical to
#      the start for 3 steps and move at step 4;
#  (4) a ResNet-18 trunk (width 8) with LARS, 2 prototype heads and bf16
#      runs at 2 ranks, the prototypes in fp32 units of their own;
#  (5) no small crops (one resolution) trains too;
#  (6) bad input: one line naming the flag, exit 2;
#  (7) SwAV's queue (global: the same codes at any world size): 2 and 3 ranks reproduce the
#      1-rank losses once the queue is in use; a run resumed mid-way (the queue from the
#      checkpoint) is bit-identical at the same world size and matches at another;
#  (8) the linear probe (probe_acc) agrees across world sizes (1); --eval-baseline logs the
#      untrained trunk's and raw pixels' kNN and probe accuracies (5); --probe-wd with
#      candidates trains the probe with the one the held-out training images chose (5);
#      --eval-batches N evaluates on the test split's first N global batches (5);
#  (9) --bn-stats-crops global: the same training, running statistics from the global crops only;
#  (10) --eval-pool 2: the evaluations read a ResNet trunk's last map pooled to 2 x 2, at 1 and 2
#      ranks alike, the training untouched;
#  (11) --eval-precise-bn N: the evaluations read the trunk with batch norm statistics of N whole
#      training images, at 1 and 2 ranks alike; the training and the saved model untouched;
#  (12) --eval-layer 3,4: the layer chosen on held-out training images for the kNN and for the
#      probe, reporting that layer's own figure, at 1 and 2 ranks alike;
# and a resumed run (the task read from the checkpoint) is bit-identical to the uninterrupted one.
# Crops carry the intensity jitter (default 0.4) everywhere, so (1) checks it is rank-independent.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -e "$FMNIST/train-images-idx3-ubyte.gz" ] && [ ! -e "$FMNIST/train-images-idx3-ubyte" ]; then
  echo "skip: $FMNIST not installed (Debian's dataset-fashion-mnist)"; echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

common=(--task swav --model cnn --data fashion-mnist --batch 12 --steps 5 --swav-hidden 32 --swav-dim 16
        --nmb-prototypes 20 --crops-small 2 --knn-train 300 --probe-train 1000 --threads 1 --optim sgd --momentum 0.9 --lr 0.003
        --clip 0 --warmup 0 --comm shm --seed 7 "${PEAK[@]}")
# (no clipping: the world-size check must see the gradients' scale)
# sanitized builds evaluate on the first 2000 test images (--eval-batches), not all 10000: the
# evaluations' forwards were most of this script's time under ASan (9 of CI's minutes); the
# ResNet-18 runs from (4) on do in every build (ev8), and so do the small CNN's whose figures are
# only checked to be sane (first); in the plain build, the world sizes' runs (1) and the evaluation
# of their checkpoint read all 10000
first=(--eval-batches 25 --eval-batch 80) # the first 25 x 80 test images
export T_SWAV_R8_IMAGES=$((25 * 80))       # the test images each evaluation reads; accuracies agree within 5 of them
ev=() T_SWAV_IMAGES=10000
case "$BUILD" in *asan*|*tsan*) ev=("${first[@]}") T_SWAV_IMAGES=$T_SWAV_R8_IMAGES ;; esac
export T_SWAV_IMAGES
common+=("${ev[@]}")
ev8=("${first[@]}")
# the runs whose checks read no accuracy evaluate nothing (no kNN bank, no probe epochs: no
# evaluation), or only a little where they check that an evaluation ran
noeval=(--knn-train 0 --probe-epochs 0)

# ---- (1) world sizes agree; (2) prototypes agree and have unit rows ----
# (the three runs at once)
for n in 1 2 3; do
  spawn r$n timeout -k 5 120 "$TRAIN" "${common[@]}" --nproc $n --log "$tmp/r$n.jsonl" --save-full "$tmp/m$n.safetensors" \
    > "$tmp/o$n" 2>&1
done
for n in 1 2 3; do reap r$n || bad "$n-rank run" "$(tail -5 "$tmp/o$n")"; done
for n in 2 3; do
  if msg=$(python3 - "$tmp/r1.jsonl" "$tmp/r$n.jsonl" <<'EOF' 2>&1
import os, json, sys
TOL = 5.5 / int(os.environ["T_SWAV_IMAGES"])  # five test images
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert len(a) == len(b) == 5, f"step counts {len(a)} {len(b)}"
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-5, f"step {x['step']}: loss {x['loss']} vs {y['loss']}"
assert abs(a[-1]["knn_acc"] - b[-1]["knn_acc"]) <= TOL, f"knn_acc {a[-1]['knn_acc']} vs {b[-1]['knn_acc']}"
assert a[-1]["eval_images"] == b[-1]["eval_images"] == int(os.environ["T_SWAV_IMAGES"])
assert 0.3 < a[-1]["probe_acc"] <= 1 and abs(a[-1]["probe_acc"] - b[-1]["probe_acc"]) <= TOL, \
    f"probe_acc {a[-1]['probe_acc']} vs {b[-1]['probe_acc']}"
EOF
  ); then ok "$n ranks reproduce the 1-rank losses (1e-5) and kNN accuracy"; else bad "$n ranks vs 1" "$msg"; fi
done
# --bn-stats-crops global: the same training (batch statistics), the running statistics from the
# global crops' forward alone (num_batches_tracked counts one forward a step, not two)
timeout -k 5 120 "$TRAIN" "${common[@]}" "${noeval[@]}" --bn-stats-crops global --log "$tmp/bg.jsonl" \
  --save-full "$tmp/bg.safetensors" > "$tmp/obg" 2>&1 || bad "--bn-stats-crops global" "$(tail -3 "$tmp/obg")"
if msg=$(python3 - "$tmp/r1.jsonl" "$tmp/bg.jsonl" "$tmp/m1.safetensors" "$tmp/bg.safetensors" <<'EOF' 2>&1
import json, struct, sys
def read_st(path):
    b = open(path, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n])
    return {k: b[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]] for k, v in h.items() if k != "__metadata__"}
a, b = [[(r["loss"], r["proto_hash"]) for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:3]]
assert a == b, "the training changed"
x, y = read_st(sys.argv[3]), read_st(sys.argv[4])
nbt = [k for k in x if k.endswith("num_batches_tracked")]
assert nbt and all(struct.unpack("<q", x[k])[0] == 10 and struct.unpack("<q", y[k])[0] == 5 for k in nbt), \
    [(k, struct.unpack("<q", x[k])[0], struct.unpack("<q", y[k])[0]) for k in nbt]
assert any(x[k] != y[k] for k in x if k.endswith("running_mean")), "the running means did not change"
assert all(x[k] == y[k] for k in x if "running" not in k and "batches" not in k), "a parameter differs"
EOF
); then ok "--bn-stats-crops global: the same losses and prototypes, running statistics from one forward a step (5 of 5 steps, not 10)"
else bad "--bn-stats-crops global" "$msg"; fi
for n in 1 2 3; do
  if msg=$(python3 - "$tmp/r$n.jsonl" "$tmp/o$n" <<'EOF' 2>&1
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
assert rows and all(r["proto_ranks_agree"] == 1 for r in rows), "ranks hold different prototypes"
assert all(r["proto_norm_err"] <= 1e-6 for r in rows), [r["proto_norm_err"] for r in rows]
assert len({r["proto_hash"] for r in rows}) == len(rows), "the prototypes did not move"
out = open(sys.argv[2]).read()
assert "the same on every rank: yes" in out, "start: ranks differ"
assert 0.15 < rows[-1]["knn_acc"] <= 1, rows[-1]["knn_acc"]
EOF
  ); then ok "$n ranks: the same prototypes on every rank, unit rows after every step"; else bad "$n-rank prototypes" "$msg"; fi
done

# the global crops' second forward leaves batch norm's running statistics alone: 2 counted
# train-mode forwards per step (global, small)
if msg=$(python3 - "$tmp/m1.safetensors" "$tmp/m3.safetensors" <<'EOF' 2>&1
import json, struct, sys
for path in sys.argv[1:]:
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    names = [k for k in h if k.endswith("num_batches_tracked")]
    assert len(names) == 3, names
    for k in names:
        lo, hi = h[k]["data_offsets"]
        v = struct.unpack("<q", b[8 + n + lo:8 + n + hi])[0]
        assert v == 10, f"{path}: {k} = {v}, expected 10 (5 steps x 2 resolutions)"
EOF
); then ok "batch norm counts each resolution once per step (the recompute does not)"; else bad "batch norm recompute" "$msg"; fi

# resuming (the checkpoint names its task: no --task needed) reproduces the uninterrupted run
"$TRAIN" "${common[@]}" --save-every 3 --save-dir "$tmp/ck" "${noeval[@]}" > "$tmp/oc" 2>&1 || bad "save" "$(tail -3 "$tmp/oc")"
if "$TRAIN" "${common[@]:2}" "${noeval[@]}" --resume "$tmp/ck/step-00000003" --log "$tmp/res.jsonl" > "$tmp/orr" 2>&1 &&
   msg=$(python3 - "$tmp/r1.jsonl" "$tmp/res.jsonl" <<'EOF' 2>&1
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r][3:]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert [x["step"] for x in b] == [4, 5], [x["step"] for x in b]
for x, y in zip(a, b):
    for k in ("loss", "grad_norm", "param_norm", "proto_hash"):
        assert x[k] == y[k], f"step {x['step']}: {k} {x[k]} vs {y[k]}"
EOF
   ); then ok "a resumed run (its task from the checkpoint) reproduces the uninterrupted one"
else bad "resume" "${msg:-$(tail -5 "$tmp/orr")}"; fi
# --init-from DIR --steps 0 --eval-baseline evaluates a checkpoint's trunk and trains nothing: the
# run's final checkpoint reads as the run's own last evaluation did
if "$TRAIN" "${common[@]}" --init-from "$tmp/ck/step-00000005" --steps 0 --eval-baseline > "$tmp/oe" 2>&1 &&
   msg=$(python3 - "$tmp/r1.jsonl" "$tmp/oe" "$tmp/ck/step-00000005" <<'EOF' 2>&1
import json, re, sys
r = [r for r in map(json.loads, open(sys.argv[1])) if "knn_acc" in r][-1]
out = open(sys.argv[2]).read()
m = re.search(r"baseline: the trunk loaded from (\S+), knn_acc ([0-9.]+)% probe_acc ([0-9.]+)%", out)
assert m and m.group(1) == sys.argv[3], out
assert abs(float(m.group(2)) - 100 * r["knn_acc"]) < 0.006 and abs(float(m.group(3)) - 100 * r["probe_acc"]) < 0.006, \
    (m.groups(), r["knn_acc"], r["probe_acc"])
assert not re.search(r"^step +[0-9]", out, re.M), "a step ran"
EOF
   ); then ok "--init-from DIR --steps 0 --eval-baseline: the checkpoint's trunk reads as the run's last evaluation"
else bad "--steps 0 --eval-baseline" "${msg:-$(tail -5 "$tmp/oe")}"; fi

# ---- (3) frozen prototypes ----
if timeout -k 5 120 "$TRAIN" "${common[@]}" "${noeval[@]}" --nproc 2 --freeze-prototypes-iters 3 --log "$tmp/f.jsonl" \
     > "$tmp/of" 2>&1 &&
   msg=$(python3 - "$tmp/f.jsonl" "$tmp/of" <<'EOF' 2>&1
import json, re, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
start = re.search(r"start hash ([0-9a-f]{16})", open(sys.argv[2]).read()).group(1)
h = [r["proto_hash"] for r in rows]
assert h[:3] == [start] * 3, f"frozen steps moved: start {start}, {h[:3]}"
assert h[3] != start and h[4] != h[3], f"unfrozen steps did not move: {h}"
assert [r["proto_frozen"] for r in rows] == [1, 1, 1, 0, 0]
assert all(r["proto_norm_err"] <= 1e-6 for r in rows)
EOF
   ); then ok "frozen prototypes stay bit-identical for 3 steps, then train"
else bad "frozen prototypes" "${msg:-$(tail -5 "$tmp/of")}"; fi

# ---- (4) ResNet-18 trunk, LARS, 2 heads, bf16 ----
echo '{"arch":"resnet18","in_chans":1,"stem":"cifar","width":8}' > "$tmp/r8.json"
# (one batch of test images: the check reads that an evaluation ran, not its figures)
if timeout -k 5 120 "$TRAIN" --task swav --model-config "$tmp/r8.json" --eval-batches 1 --eval-batch 80 --data fashion-mnist \
     --batch 8 --steps 2 --swav-hidden 16 --swav-dim 8 --nmb-prototypes 10 --nmb-heads 2 --crops-global-size 16 \
     --crops-small 1 --crops-small-size 8 --knn-train 50 --probe-train 500 --threads 1 --optim lars --momentum 0.9 --lr 0.1 \
     --precision AMP_BF16 --nproc 2 --comm shm --verbose "${PEAK[@]}" --log "$tmp/rn.jsonl" > "$tmp/orn" 2>&1 &&
   msg=$(python3 - "$tmp/rn.jsonl" "$tmp/orn" <<'EOF' 2>&1
import json, math, re, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
# an evaluation ran: its accuracies are numbers (a kNN over no image would log null)
ev = rows[-1]
assert all(isinstance(ev.get(k), float) and 0 <= ev[k] <= 1 for k in ("knn_acc", "probe_acc")), ev
assert all(r["proto_ranks_agree"] == 1 for r in rows)
out = open(sys.argv[2]).read()
for j in (0, 1):
    assert re.search(rf"unit \d+ 'head\.prototypes{j}' \(Linear\).*precision FULL \(param F32, reduce F32, compute F32\)", out), \
        f"prototypes{j} is not an fp32 unit"
EOF
   ); then ok "ResNet-18 trunk with LARS, 2 heads, bf16 (prototypes fp32 units) at 2 ranks"
else bad "ResNet-18 trunk" "${msg:-$(tail -5 "$tmp/orn")}"; fi

# ---- (10) --eval-pool 2 and (11) --eval-precise-bn 200 on the ResNet-18 trunk: the same 2 steps
# with each flag at 1 and 2 ranks, and at 1 rank with neither (pb0, evaluating after each step), the
# run both compare with
r8=(--task swav --model-config "$tmp/r8.json" "${ev8[@]}" --data fashion-mnist --batch 8 --steps 2 --swav-hidden 16
    --swav-dim 8 --nmb-prototypes 10 --crops-global-size 16 --crops-small 1 --crops-small-size 8 --knn-train 200
    --probe-train 500 --threads 1 --optim lars --momentum 0.9 --lr 0.1 --comm shm "${PEAK[@]}")
# (the five runs at once: none reads another's files)
# (10): kNN and probe on layer4's map pooled to 2 x 2 (4 x 64 features), the same at 1 and 2 ranks;
# the training is pb0's (the evaluation only reads); the untrained trunk's pooled probe at 1 rank
for n in 1 2; do
  f=(--nproc $n); [ $n = 1 ] && f+=(--eval-baseline)
  spawn ep$n timeout -k 5 120 "$TRAIN" "${r8[@]}" "${f[@]}" --eval-pool 2 --log "$tmp/ep$n.jsonl" > "$tmp/oep$n" 2>&1
done
# (11): the evaluations read the trunk with batch norm statistics of 200 whole training images, at 1
# and 2 ranks alike; the training's own statistics come back after each evaluation (here after
# step 1 and 2), so the losses and the saved model are the run's without it
for n in 0 1 2; do
  f=(); [ $n = 0 ] || f=(--eval-precise-bn 200 --nproc $n)
  spawn pb$n timeout -k 5 120 "$TRAIN" "${r8[@]}" --eval-every 1 "${f[@]}" --save-full "$tmp/pb$n.safetensors" \
    --log "$tmp/pb$n.jsonl" > "$tmp/opb$n" 2>&1
done
for n in 1 2; do reap ep$n || bad "--eval-pool 2 at $n ranks" "$(tail -5 "$tmp/oep$n")"; done
for n in 0 1 2; do reap pb$n || bad "--eval-precise-bn at $n ranks" "$(tail -5 "$tmp/opb$n")"; done
if msg=$(python3 - "$tmp/ep1.jsonl" "$tmp/ep2.jsonl" "$tmp/pb0.jsonl" "$tmp/oep1" <<'EOF' 2>&1
import os, json, sys
TOL = 5.5 / int(os.environ["T_SWAV_R8_IMAGES"])  # five test images
a, b, c = ([r for r in map(json.loads, open(f)) if "step" in r] for f in sys.argv[1:4])
assert [r["loss"] for r in a] == [r["loss"] for r in c], "--eval-pool changed the training"
for k in ("knn_acc", "probe_acc"):
    assert 0.3 < a[-1][k] <= 1 and abs(a[-1][k] - b[-1][k]) <= TOL, (k, a[-1][k], b[-1][k])
assert a[-1]["probe_acc"] != c[-1]["probe_acc"], "the same probe with and without the pooled grid"
assert 0.3 < a[0]["base_probe_acc"] <= 1
assert "features: 256 (layer4's map pooled to 2 x 2)" in open(sys.argv[4]).read()
EOF
); then ok "--eval-pool 2: the kNN and probe read the 2 x 2 pooled map (256 features), the same at 1 and 2 ranks"
else bad "--eval-pool 2" "$msg"; fi
if msg=$(python3 - "$tmp/pb0.jsonl" "$tmp/pb1.jsonl" "$tmp/pb2.jsonl" "$tmp/opb1" <<'EOF' 2>&1
import os, json, sys
TOL = 5.5 / int(os.environ["T_SWAV_R8_IMAGES"])  # five test images
a, b, c = ([r for r in map(json.loads, open(f)) if "step" in r] for f in sys.argv[1:4])
assert [r["loss"] for r in a] == [r["loss"] for r in b], "--eval-precise-bn changed the training"
for k in ("knn_acc", "probe_acc"):
    assert 0.3 < b[-1][k] <= 1 and abs(b[-1][k] - c[-1][k]) <= TOL, (k, b[-1][k], c[-1][k])
assert (a[0]["knn_acc"], a[0]["probe_acc"]) != (b[0]["knn_acc"], b[0]["probe_acc"]), "the same evaluation"
assert "re-estimated on 200 whole training images" in open(sys.argv[4]).read()
EOF
) && cmp -s "$tmp/pb0.safetensors" "$tmp/pb1.safetensors"; then
  ok "--eval-precise-bn 200: other evaluations, the same at 1 and 2 ranks; the training and the saved model untouched"
else bad "--eval-precise-bn" "${msg:-the saved models differ: the running statistics were not restored}"; fi

# ---- (12) --eval-layer 3,4: each evaluation reads layer3's and layer4's maps and reports, for the
# kNN and the probe apart, the layer that did best on held-out training images; the figure of the
# layer chosen is that layer's read alone (--eval-layer 3, --eval-layer 4), at 1 and 2 ranks alike;
# the untrained trunk's layers chosen too (--eval-baseline, read of the 1-rank run with both layers);
# the four runs at once
for v in 3 4 34 34n2; do
  case $v in 3|4) f=(--eval-layer "$v") ;; 34) f=(--eval-layer 3,4 --eval-baseline) ;; *) f=(--eval-layer 3,4 --nproc 2) ;; esac
  spawn el$v timeout -k 5 120 "$TRAIN" --task swav --model-config "$tmp/r8.json" "${ev8[@]}" --data fashion-mnist --batch 8 \
    --steps 1 --swav-hidden 16 --swav-dim 8 --nmb-prototypes 10 --crops-global-size 16 --crops-small 1 --crops-small-size 8 \
    --knn-train 300 --probe-train 600 --threads 1 --optim lars --momentum 0.9 --lr 0.1 --comm shm --eval-pool 2 \
    --eval-precise-bn 100 "${PEAK[@]}" "${f[@]}" --log "$tmp/el$v.jsonl" > "$tmp/oel$v" 2>&1
done
for v in 3 4 34 34n2; do reap el$v || bad "--eval-layer $v" "$(tail -5 "$tmp/oel$v")"; done
if msg=$(python3 - "$tmp" <<'EOF' 2>&1
import os, json, sys
TOL = 5.5 / int(os.environ["T_SWAV_R8_IMAGES"])  # five test images
t = sys.argv[1]
last = {v: [r for r in map(json.loads, open(f"{t}/el{v}.jsonl")) if "step" in r][-1] for v in ("3", "4", "34", "34n2")}
first = [r for r in map(json.loads, open(f"{t}/el34.jsonl")) if "step" in r][0]
c = last["34"]
assert c["knn_layer"] in (3, 4) and c["probe_layer"] in (3, 4), c
assert c["knn_acc"] == last[str(int(c["knn_layer"]))]["knn_acc"], "the kNN figure is not its layer's"
for L in (3, 4):
    assert c[f"knn_acc_layer{L}"] == last[str(L)]["knn_acc"] and c[f"probe_acc_layer{L}"] == last[str(L)]["probe_acc"], L
assert c["probe_acc"] == last[str(int(c["probe_layer"]))]["probe_acc"], "the probe figure is not its layer's"
assert first["base_knn_layer"] in (3, 4) and first["base_probe_layer"] in (3, 4), first
assert last["3"]["knn_acc"] != last["4"]["knn_acc"] or last["3"]["probe_acc"] != last["4"]["probe_acc"]
d = last["34n2"]
for k in ("knn_layer", "probe_layer"): assert d[k] == c[k], (k, c[k], d[k])
for k in ("knn_acc", "probe_acc"): assert abs(d[k] - c[k]) <= TOL, (k, c[k], d[k])
out = open(f"{t}/oel34").read()
assert "features: 128 (layer3's map pooled to 2 x 2), 256 (layer4's map pooled to 2 x 2)" in out, out
assert "chosen)" in out
EOF
); then ok "--eval-layer 3,4: the layer chosen on held-out images for the kNN and the probe, its own figure, 1 and 2 ranks alike"
else bad "--eval-layer 3,4" "$msg"; fi

# ---- (5) one resolution ----
# (and --eval-baseline: the untrained trunk's and raw pixels' kNN and probe in the first log line)
if timeout -k 5 60 "$TRAIN" "${common[@]}" "${first[@]}" --crops-small 0 --steps 2 --eval-baseline --log "$tmp/g.jsonl" \
     > "$tmp/og" 2>&1 &&
   [ "$(grep -c '"step"' "$tmp/g.jsonl")" = 2 ]; then ok "global crops only"
else bad "global crops only" "$(tail -5 "$tmp/og")"; fi
if msg=$(python3 - "$tmp/g.jsonl" "$tmp/og" <<'EOF' 2>&1
import json, sys
r = [json.loads(l) for l in open(sys.argv[1]) if '"base_knn_acc"' in l][0]
for k in ("base_knn_acc", "base_probe_acc", "raw_knn_acc", "raw_probe_acc"):
    assert 0.3 < r[k] <= 1, (k, r[k])
assert "baseline: untrained trunk knn_acc" in open(sys.argv[2]).read()
EOF
); then ok "--eval-baseline: the untrained trunk's and raw pixels' kNN and probe accuracies"
else bad "--eval-baseline" "$msg"; fi
# --eval-batches N: the evaluations read the test split's first N global batches (of --eval-batch)
if timeout -k 5 60 "$TRAIN" "${common[@]}" --crops-small 0 --steps 1 --eval-batches 3 --eval-batch 50 > "$tmp/oeb" 2>&1 &&
   grep -q "^eval: knn_acc .*(150 test images)" "$tmp/oeb"; then ok "--eval-batches 3 --eval-batch 50: 150 test images"
else bad "--eval-batches" "$(tail -3 "$tmp/oeb")"; fi
# --probe-wd with candidates: the probe is trained again on all its images with the weight decay
# the held-out sixth chose, so its accuracy is the one of a run given that weight decay alone (the
# three runs at once)
for w in 1e-4 1 1e-4,1; do
  spawn "w$w" timeout -k 5 60 "$TRAIN" "${common[@]}" "${first[@]}" --crops-small 0 --steps 2 --probe-wd $w \
    --log "$tmp/w$w.jsonl" > "$tmp/ow$w" 2>&1
done
for w in 1e-4 1 1e-4,1; do reap "w$w" || bad "--probe-wd $w: the run" "$(tail -3 "$tmp/ow$w")"; done
if msg=$(python3 - "$tmp/w1e-4.jsonl" "$tmp/w1.jsonl" "$tmp/w1e-4,1.jsonl" "$tmp/ow1e-4,1" <<'EOF' 2>&1
import json, sys
last = lambda f: [json.loads(l) for l in open(f) if '"probe_acc"' in l][-1]
a, b, c = (last(f) for f in sys.argv[1:4])
assert a["probe_acc"] != b["probe_acc"], f"weight decay 1e-4 and 1: the same probe ({a['probe_acc']})"
assert "probe_wd" not in a and "probe_wd" not in b, "probe_wd logged without a choice"
want = {1e-4: a, 1.0: b}[min((1e-4, 1.0), key=lambda w: abs(w - c["probe_wd"]))]
assert abs(want["probe_acc"] - c["probe_acc"]) < 1e-9, (c["probe_wd"], c["probe_acc"], want["probe_acc"])
assert f"(wd {c['probe_wd']:g} chosen)" in open(sys.argv[4]).read()
print(f"chose {c['probe_wd']:g}: {100 * c['probe_acc']:.2f}% (1e-4: {100 * a['probe_acc']:.2f}%, "
      f"1: {100 * b['probe_acc']:.2f}%)")
EOF
); then ok "--probe-wd 1e-4,1: $msg"
else bad "--probe-wd 1e-4,1" "$msg"; fi

# ---- (7) the queue: 2 batches, filled from the first step, in the codes from step 3 ----
# 1 rank (saving at step 3) and 3 ranks; resumed from the 1-rank checkpoint at 1 and 3 ranks
q=(--queue-length 24 --queue-start-epoch 0 "${noeval[@]}")
# (the two runs at once, and the two resumed ones below)
spawn q1 timeout -k 5 120 "$TRAIN" "${common[@]}" "${q[@]}" --save-every 3 --save-dir "$tmp/qck" --log "$tmp/q1.jsonl" \
  > "$tmp/oq1" 2>&1
spawn q3 timeout -k 5 120 "$TRAIN" "${common[@]}" "${q[@]}" --nproc 3 --log "$tmp/q3.jsonl" > "$tmp/oq3" 2>&1
reap q1 || bad "1-rank run with a queue" "$(tail -5 "$tmp/oq1")"
reap q3 || bad "3-rank run with a queue" "$(tail -5 "$tmp/oq3")"
if msg=$(python3 - "$tmp/r1.jsonl" "$tmp/q1.jsonl" "$tmp/q3.jsonl" <<'EOF' 2>&1
import json, sys
r, q1, q3 = [[r for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:]]
assert [x["queue_used"] for x in q1] == [0, 0, 1, 1, 1], [x["queue_used"] for x in q1]
assert [x["queue_filled"] for x in q1] == [12, 24, 24, 24, 24], [x["queue_filled"] for x in q1]
assert [x["loss"] for x in q1[:2]] == [x["loss"] for x in r[:2]], "the queue changed the steps before its use"
assert abs(q1[2]["loss"] - r[2]["loss"]) > 1e-4, "the queue did not change the codes"
for x, y in zip(q1, q3):
    assert abs(x["loss"] - y["loss"]) <= 1e-5, f"3 ranks, step {x['step']}: loss {x['loss']} vs {y['loss']}"
    assert x["queue_used"] == y["queue_used"]
EOF
); then ok "the queue: 3 ranks reproduce the 1-rank losses (1e-5) once it is in the codes"
else bad "the queue at 1 and 3 ranks" "$msg"; fi
for n in 1 3; do
  spawn qres$n timeout -k 5 120 "$TRAIN" "${common[@]:2}" "${q[@]}" --nproc $n --resume "$tmp/qck/step-00000003" \
    --log "$tmp/qres$n.jsonl" > "$tmp/oqr$n" 2>&1
done
for n in 1 3; do reap qres$n || bad "resume at $n ranks with a queue" "$(tail -3 "$tmp/oqr$n")"; done
if msg=$(python3 - "$tmp/q1.jsonl" "$tmp/qres1.jsonl" "$tmp/qres3.jsonl" <<'EOF' 2>&1
import json, sys
a, b, c = [[r for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:]]
a = a[3:]
assert [x["step"] for x in b] == [x["step"] for x in c] == [4, 5], [x["step"] for x in b]
for x, y, z in zip(a, b, c):
    for k in ("loss", "grad_norm", "param_norm", "proto_hash", "queue_used", "queue_filled"):
        assert x[k] == y[k], f"resumed, step {x['step']}: {k} {x[k]} vs {y[k]}"
    assert z["queue_used"] == 1 and abs(x["loss"] - z["loss"]) <= 1e-5, f"3 ranks resumed: {z['loss']} vs {x['loss']}"
EOF
); then ok "a run with a queue resumed mid-way: bit-identical at 1 rank, within 1e-5 at 3 ranks"
else bad "resume with a queue" "$msg"; fi

# the queue and jitter flags are part of the run's configuration, and the trunk is in meta.json:
# resumed with no training or model flags (threads are the machine's, never restored), and the
# log's configuration given back as --config, the run is the same
timeout -k 5 120 "$TRAIN" --resume "$tmp/qck/step-00000003" --threads 1 --log "$tmp/qbare.jsonl" > "$tmp/oqb" 2>&1 ||
  bad "resume with no flags" "$(tail -3 "$tmp/oqb")"
config_again "$tmp/q1.jsonl" log="\"$tmp/qagain.jsonl\"" save-dir=null save-every=0 > "$tmp/qagain.json"
timeout -k 5 120 "$TRAIN" --config "$tmp/qagain.json" > "$tmp/oqa" 2>&1 || bad "--config from the log" "$(tail -3 "$tmp/oqa")"
if msg=$(python3 - "$tmp/q1.jsonl" "$tmp/qbare.jsonl" "$tmp/qagain.jsonl" <<'EOF' 2>&1
import json, sys
cfg = json.loads(open(sys.argv[1]).readline())["config"]
assert cfg["queue-length"] == 24 and cfg["queue-start-epoch"] == 0 and cfg["crops-jitter"] == 0.4, cfg
a, b, c = [[r for r in map(json.loads, open(p)) if "step" in r] for p in sys.argv[1:]]
assert [x["step"] for x in b] == [4, 5] and len(c) == len(a), ([x["step"] for x in b], len(c))
for x, y in zip(a[3:], b):
    assert (x["loss"], x["queue_used"], x["proto_hash"]) == (y["loss"], y["queue_used"], y["proto_hash"]), (x, y)
for x, y in zip(a, c):
    assert (x["loss"], x["grad_norm"], x["queue_used"]) == (y["loss"], y["grad_norm"], y["queue_used"]), (x, y)
EOF
); then ok "the queue and jitter flags are in the configuration: --resume alone continues with the queue bit for bit, the log's configuration as --config reruns the run"
else bad "the queue flags in the configuration" "$msg"; fi

# ---- (6) bad input ----
expect_input "global crop larger than the image" "--crops-global-size 40.*28x28" -- "${common[@]}" --nproc 2 --crops-global-size 40
expect_input "small crop larger than the image" "--crops-small-size 30" -- "${common[@]}" --crops-small-size 30
expect_input "no prototype heads" "--nmb-heads" -- "${common[@]}" --nmb-heads 0
expect_input "no prototypes" "--nmb-prototypes" -- "${common[@]}" --nmb-prototypes 0
expect_input "a bad scale range" "--crops-small-scale" -- "${common[@]}" --crops-small-scale 0.5,0.1
expect_input "a queue that is not whole batches" "--queue-length 30.*--batch 12" -- "${common[@]}" --nproc 2 --queue-length 30
expect_input "a queue of too many batches" "--queue-length 780 is longer" -- "${common[@]}" --nproc 3 --queue-length 780
expect_input "--eval-pool with the cnn trunk" "--eval-pool 2: the cnn trunk" -- "${common[@]}" --eval-pool 2
expect_input "--eval-layer with the cnn trunk" "--eval-layer: the cnn trunk" -- "${common[@]}" --eval-layer 3
expect_input "--eval-layer outside 1..4" "--eval-layer: '3,5'" -- "${common[@]}" --eval-layer 3,5
expect_input "a trunk that is not one" "--model.*small" -- --task swav --model small --steps 1
inputs_checked
finish
