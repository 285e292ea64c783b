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
# and a resumed run (the task read from the checkpoint) is bit-identical to the uninterrupted one.
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

FMNIST=/usr/share/datasets/fashion-mnist
if [ ! -e "$FMNIST/train-images-idx3-ubyte.gz" ] && [ ! -e "$FMNIST/train-images-idx3-ubyte" ]; then
  echo "skip: $FMNIST not installed (Debian's dataset-fashion-mnist)"; echo "0 passed, 0 failed"; exit 0
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

common=(--task swav --model cnn --data fashion-mnist --batch 12 --steps 5 --swav-hidden 32 --swav-dim 16
        --nmb-prototypes 20 --crops-small 2 --knn-train 300 --threads 1 --optim sgd --momentum 0.9 --lr 0.003
        --clip 0 --warmup 0 --comm shm --seed 7)
# (no clipping: the world-size check must see the gradients' scale)

# ---- (1) world sizes agree; (2) prototypes agree and have unit rows ----
for n in 1 2 3; do
  if ! timeout -k 5 120 "$TRAIN" "${common[@]}" --nproc $n --log "$tmp/r$n.jsonl" --save-full "$tmp/m$n.safetensors" \
       > "$tmp/o$n" 2>&1; then
    bad "$n-rank run" "$(tail -5 "$tmp/o$n")"
  fi
done
for n in 2 3; do
  if msg=$(python3 - "$tmp/r1.jsonl" "$tmp/r$n.jsonl" <<'EOF' 2>&1
import json, sys
a = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
b = [r for r in map(json.loads, open(sys.argv[2])) if "step" in r]
assert len(a) == len(b) == 5, f"step counts {len(a)} {len(b)}"
for x, y in zip(a, b):
    assert abs(x["loss"] - y["loss"]) <= 1e-5, f"step {x['step']}: loss {x['loss']} vs {y['loss']}"
assert abs(a[-1]["knn_acc"] - b[-1]["knn_acc"]) <= 5e-4, f"knn_acc {a[-1]['knn_acc']} vs {b[-1]['knn_acc']}"
assert a[-1]["eval_images"] == b[-1]["eval_images"] == 10000
EOF
  ); then ok "$n ranks reproduce the 1-rank losses (1e-5) and kNN accuracy"; else bad "$n ranks vs 1" "$msg"; fi
done
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
"$TRAIN" "${common[@]}" --save-every 3 --save-dir "$tmp/ck" --eval-every 0 > "$tmp/oc" 2>&1 || bad "save" "$(tail -3 "$tmp/oc")"
if "$TRAIN" "${common[@]:2}" --resume "$tmp/ck/step-00000003" --log "$tmp/res.jsonl" > "$tmp/orr" 2>&1 &&
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

# ---- (3) frozen prototypes ----
if timeout -k 5 120 "$TRAIN" "${common[@]}" --nproc 2 --freeze-prototypes-iters 3 --log "$tmp/f.jsonl" > "$tmp/of" 2>&1 &&
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
if timeout -k 5 120 "$TRAIN" --task swav --model-config "$tmp/r8.json" --data fashion-mnist --batch 8 --steps 2 \
     --swav-hidden 16 --swav-dim 8 --nmb-prototypes 10 --nmb-heads 2 --crops-global-size 16 --crops-small 1 \
     --crops-small-size 8 --knn-train 50 --threads 1 --optim lars --momentum 0.9 --lr 0.1 --precision AMP_BF16 \
     --nproc 2 --comm shm --verbose --log "$tmp/rn.jsonl" > "$tmp/orn" 2>&1 &&
   msg=$(python3 - "$tmp/rn.jsonl" "$tmp/orn" <<'EOF' 2>&1
import json, math, re, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "step" in r]
assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
assert "knn_acc" in rows[-1] and all(r["proto_ranks_agree"] == 1 for r in rows)
out = open(sys.argv[2]).read()
for j in (0, 1):
    assert re.search(rf"unit \d+ 'head\.prototypes{j}' \(Linear\).*precision FULL \(param F32, reduce F32, compute F32\)", out), \
        f"prototypes{j} is not an fp32 unit"
EOF
   ); then ok "ResNet-18 trunk with LARS, 2 heads, bf16 (prototypes fp32 units) at 2 ranks"
else bad "ResNet-18 trunk" "${msg:-$(tail -5 "$tmp/orn")}"; fi

# ---- (5) one resolution ----
if timeout -k 5 60 "$TRAIN" "${common[@]}" --crops-small 0 --steps 2 --log "$tmp/g.jsonl" > "$tmp/og" 2>&1 &&
   [ "$(grep -c '"step"' "$tmp/g.jsonl")" = 2 ]; then ok "global crops only"
else bad "global crops only" "$(tail -5 "$tmp/og")"; fi

# ---- (6) bad input ----
expect_input() {
  local name=$1 pat=$2; shift 3
  timeout -k 5 60 "$TRAIN" "$@" > "$tmp/out" 2> "$tmp/err"
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then bad "$name" "hung (killed by timeout)"
  elif [ $rc -ne 2 ]; then bad "$name" "exit $rc, expected 2" "$(head -3 "$tmp/err")"
  elif [ "$(grep -c '^fsdp-train:' "$tmp/err")" != 1 ] || ! grep -qE -- "$pat" "$tmp/err"; then
    bad "$name" "stderr is not one line matching /$pat/:" "$(head -5 "$tmp/err")"
  else ok "$name (exit 2, one line)"; fi
}
expect_input "global crop larger than the image" "--crops-global-size 40.*28x28" -- "${common[@]}" --nproc 2 --crops-global-size 40
expect_input "small crop larger than the image" "--crops-small-size 30" -- "${common[@]}" --crops-small-size 30
expect_input "no prototype heads" "--nmb-heads" -- "${common[@]}" --nmb-heads 0
expect_input "no prototypes" "--nmb-prototypes" -- "${common[@]}" --nmb-prototypes 0
expect_input "a bad scale range" "--crops-small-scale" -- "${common[@]}" --crops-small-scale 0.5,0.1
expect_input "a trunk that is not one" "--model.*small" -- --task swav --model small --steps 1
finish
