#!/usr/bin/env bash
# resnet_step.sh - ResNet-18 training step, batch 128 of Fashion-MNIST's
# 28x28x1 images, 10 classes: fsdp-train (1 rank x 2 threads; FP32 and
# AMP_BF16) against PyTorch + torchvision (/usr/bin/python3,
# bench/resnet_step_torch.py: the same model, batch, SGD with momentum and
# threads), interleaved round by round in the same run, so a busy machine
# slows both alike; and fsdp-train at 2 ranks x 1 thread FULL_SHARD against
# its 1-rank step; and oneDNN's own convolution rate on the model's main
# shapes (build/bench/conv_rate) in the same run.
# Prints per round the step times (median and best of the timed steps; the
# first 2 steps of each run are warm-up) and at the end the ratios of the
# rounds' medians: images/s ours / PyTorch's, model GFLOP/s (3 x the
# forward's convolution and fc FLOPs per image) and its share of oneDNN's
# convolution rate, and 2-rank step / 1-rank step.
# Usage: bench/resnet_step.sh [STEPS] [ROUNDS]  (default 8 2)
#   env STEMS (default imagenet; "imagenet cifar" for both; imagenet: torchvision's 7x7 stride-2 conv and
#   max-pool; cifar: a 3x3 stride-1 conv, no max-pool: 16x the FLOPs), PRECISIONS="FP32 AMP_BF16",
#   PROFILE=1 also runs one FP32 step set under ONEDNN_VERBOSE=1 and prints
#   where oneDNN's time goes (by primitive kind and pass).
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${1:-8}
ROUNDS=${2:-2}
STEMS=${STEMS:-imagenet}
PRECISIONS=${PRECISIONS:-FP32 AMP_BF16}
PY=/usr/bin/python3
FMNIST=/usr/share/datasets/fashion-mnist
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
make -s -j2 "$BUILD/fsdp-train" "$BUILD/bench/conv_rate" >/dev/null || exit 1

# the training split, and a test split of 128 images (fsdp-train evaluates after its last step)
mkdir "$tmp/data"
ln -s "$FMNIST/train-images-idx3-ubyte.gz" "$FMNIST/train-labels-idx1-ubyte.gz" "$tmp/data/"
python3 - "$FMNIST" "$tmp/data" <<'EOF'
import gzip, sys
src, dst = sys.argv[1:3]
img = gzip.open(f"{src}/t10k-images-idx3-ubyte.gz").read()
lab = gzip.open(f"{src}/t10k-labels-idx1-ubyte.gz").read()
open(f"{dst}/t10k-images-idx3-ubyte", "wb").write(img[:4] + (128).to_bytes(4, "big") + img[8:16] + img[16:16 + 128 * 784])
open(f"{dst}/t10k-labels-idx1-ubyte", "wb").write(lab[:4] + (128).to_bytes(4, "big") + lab[8:8 + 128])
EOF

echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores; $(date -u '+%Y-%m-%d %H:%M UTC'); load $(cut -d' ' -f1-3 /proc/loadavg)"
echo "torch $($PY -c 'import torch, torchvision; print(torch.__version__, "torchvision", torchvision.__version__)')"

# ours NAME STEM PREC NPROC THREADS: runs fsdp-train, prints "median best forward backward update" (ms)
ours() {
  echo "{\"arch\":\"resnet18\",\"in_chans\":1,\"num_classes\":10,\"stem\":\"$2\"}" > "$tmp/m.json"
  if ! "$BUILD/fsdp-train" --model-config "$tmp/m.json" --data "$tmp/data" --batch 128 --steps "$STEPS" \
       --threads "$5" --nproc "$4" --sharding FULL_SHARD --precision "$3" --optim sgd --lr 0.01 --momentum 0.9 \
       --augment none --eval-batch 128 --log "$tmp/$1.jsonl" > "$tmp/$1.out" 2>&1; then
    echo "fsdp-train failed:" >&2; tail -3 "$tmp/$1.out" >&2; exit 1
  fi
  python3 - "$tmp/$1.jsonl" <<'EOF'
import json, statistics, sys
r = [x for x in map(json.loads, open(sys.argv[1])) if "step" in x][2:]  # step lines without the first 2
med = lambda k: statistics.median(x[k] for x in r)
print(f"{med('step_ms'):.1f} {min(x['step_ms'] for x in r):.1f} {med('forward_ms'):.1f} {med('backward_ms'):.1f} {med('update_ms'):.1f}")
EOF
}
theirs() { # STEM PREC: "median best" (ms)
  $PY bench/resnet_step_torch.py "$1" "$2" 128 "$STEPS" 2 | sed -n 's/^torch_step_ms //p'
}

declare -A R
for stem in $STEMS; do
  for prec in $PRECISIONS; do
    for round in $(seq 1 "$ROUNDS"); do
      a=$(ours "$stem-$prec-$round" "$stem" "$prec" 1 2) || exit 1
      b=$(theirs "$stem" "$prec")
      R[$stem,$prec,ours]+="${a%% *} " R[$stem,$prec,torch]+="${b%% *} "
      echo "$stem $prec round $round: ours step ${a%% *} ms (best $(echo "$a" | cut -d' ' -f2); forward/backward/update" \
           "$(echo "$a" | cut -d' ' -f3-5 | tr ' ' /) ms) | PyTorch ${b%% *} ms (best ${b##* })"
      if [ "$prec" = FP32 ]; then
        c=$(ours "$stem-2r-$round" "$stem" FP32 2 1) || exit 1
        R[$stem,2r]+="${c%% *} "
        echo "$stem FP32 round $round: 2 ranks x 1 thread FULL_SHARD step ${c%% *} ms (best $(echo "$c" | cut -d' ' -f2))"
      fi
    done
    dt=$([ "$prec" = FP32 ] && echo f32 || echo bf16)
    "$BUILD/bench/conv_rate" 2 "$dt" "$stem" 128 5 > "$tmp/conv.out" || exit 1
    R[$stem,$prec,conv]=$(sed -n 's/^conv_gflops //p' "$tmp/conv.out")
    R[$stem,flops]=$(sed -n 's/^resnet18_flops_per_image //p' "$tmp/conv.out")
    grep '^conv ' "$tmp/conv.out" | sed 's/^/  oneDNN /'
  done
done

median() { tr ' ' '\n' | grep . | sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
echo "== summary (medians over rounds; batch 128, 1 rank x 2 threads unless said)"
for stem in $STEMS; do
  f=${R[$stem,flops]:-0}
  for prec in $PRECISIONS; do
    o=$(echo "${R[$stem,$prec,ours]}" | median) t=$(echo "${R[$stem,$prec,torch]}" | median)
    awk -v s="$stem" -v p="$prec" -v o="$o" -v t="$t" -v f="$f" -v c="${R[$stem,$prec,conv]}" 'BEGIN {
      io = 128000 / o; it = 128000 / t; g = 3 * f * io / 1e9
      printf "%s stem %s: ours %.1f images/s, PyTorch %.1f images/s: ratio %.2f | model %.2f GFLOP/s = %.0f%% of oneDNN conv %.2f GFLOP/s\n",
             s, p, io, it, io / it, g, 100 * g / c, c }'
  done
  case " $PRECISIONS " in *" FP32 "*)
    o=$(echo "${R[$stem,FP32,ours]}" | median) d=$(echo "${R[$stem,2r]}" | median)
    awk -v s="$stem" -v o="$o" -v d="$d" 'BEGIN { printf "%s stem FP32: 2 ranks x 1 thread FULL_SHARD step %.1f ms / 1 rank x 2 threads %.1f ms = %.2f\n", s, d, o, d / o }' ;;
  esac
done

if [ "${PROFILE:-0}" = 1 ]; then
  for stem in $STEMS; do
    echo "{\"arch\":\"resnet18\",\"in_chans\":1,\"num_classes\":10,\"stem\":\"$stem\"}" > "$tmp/m.json"
    ONEDNN_VERBOSE=1 "$BUILD/fsdp-train" --model-config "$tmp/m.json" --data "$tmp/data" --batch 128 --steps 3 \
      --threads 2 --optim sgd --momentum 0.9 --augment none --eval-batch 128 > "$tmp/prof.out" 2>&1
    echo "== oneDNN time by primitive and pass, $stem stem, FP32, 3 steps + the 128-image evaluation (ms)"
    grep '^onednn_verbose,exec' "$tmp/prof.out" | awk -F, '{ k = $4 " " $6; t[k] += $NF; n[k]++; all += $NF }
      END { for (k in t) printf "  %-45s %8.1f ms %5d calls %5.1f%%\n", k, t[k], n[k], 100 * t[k] / all }' | sort -k3 -g -r
  done
fi
