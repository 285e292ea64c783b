#!/usr/bin/env bash
# bench/swav_step.sh - SwAV step time of `fsdp-train --task swav` against
# PyTorch 1.13 (bench/swav_step_torch.py: the same model, crops, loss and
# LARS step), 1 rank, the same threads, interleaved in rounds in one run:
# each round runs fsdp-train for STEPS steps, then PyTorch for STEPS steps;
# the figure is the median over rounds of each side's median step time
# (the first step of every run not counted).
# Model: ResNet-18 trunk (cifar stem, width W), head hidden 256, dim 128,
# 300 prototypes; per image 2 crops of 24x24 and 2 of 16x16 of Fashion-MNIST.
# Usage: bench/swav_step.sh [ROUNDS] [STEPS] [BATCH] [THREADS] [WIDTH]
#        (defaults 3 8 32 2 16)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ROUNDS=${1:-3} STEPS=${2:-8} B=${3:-32} T=${4:-2} W=${5:-16}
G=24 V=2 S=16 HID=256 DIM=128 K=300
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "{\"arch\":\"resnet18\",\"in_chans\":1,\"stem\":\"cifar\",\"width\":$W}" > "$tmp/trunk.json"
echo "$(date -u '+%F %H:%M UTC'); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'); load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "batch $B, $T threads, ResNet-18 width $W (cifar stem), 2x${G}px + ${V}x${S}px crops, head $HID/$DIM/$K; $ROUNDS rounds of $STEPS steps"
for r in $(seq 1 "$ROUNDS"); do
  "$BUILD/fsdp-train" --task swav --model-config "$tmp/trunk.json" --data fashion-mnist --batch "$B" \
    --steps "$STEPS" --threads "$T" --optim lars --lr 0.1 --momentum 0.9 --weight-decay 1e-6 --warmup 0 \
    --swav-hidden $HID --swav-dim $DIM --nmb-prototypes $K --crops-global-size $G --crops-small $V \
    --crops-small-size $S --eval-every 0 --knn-train 0 --probe-epochs 0 --log "$tmp/c$r.jsonl" > "$tmp/c$r.out" 2>&1 ||
    { tail -5 "$tmp/c$r.out"; exit 1; }
  /usr/bin/python3 bench/swav_step_torch.py "$T" "$STEPS" "$B" "$W" $G $V $S $HID $DIM $K > "$tmp/p$r.out" ||
    { tail -5 "$tmp/p$r.out"; exit 1; }
done
python3 - "$tmp" "$ROUNDS" "$B" <<'PY'
import json, statistics, sys
d, rounds, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
c, p = [], []
for r in range(1, rounds + 1):
    c.append(statistics.median([x["step_ms"] for x in map(json.loads, open(f"{d}/c{r}.jsonl")) if "step" in x][1:]))
    p.append(statistics.median(float(l.split()[1]) for l in list(open(f"{d}/p{r}.out"))[1:]))
    print(f"round {r}: fsdp-train {c[-1]:.1f} ms/step, PyTorch {p[-1]:.1f} ms/step")
mc, mp = statistics.median(c), statistics.median(p)
print(f"fsdp-train {mc:.1f} ms/step ({B / mc * 1e3:.0f} images/s), PyTorch 1.13 {mp:.1f} ms/step "
      f"({B / mp * 1e3:.0f} images/s): {mp / mc:.2f}x PyTorch (target >= 1.5x)")
PY
