#!/usr/bin/env bash
# t_vision_init.sh - a torchvision ResNet-18 state dict (a safetensors file
# under torchvision's names, batch-norm buffers included) as fsdp-train's
# --init-from; 3 SGD steps from it give PyTorch's batch-norm buffers and
# PyTorch's evaluation (tests/torchvision_init_ref.py), at 1 rank without and
# with activation checkpointing and at 2 ranks with it (the forward that --ac
# runs again in backward must not update the running statistics a second
# time); a tensor
# missing from the file or of the wrong shape is one line naming it.
# Needs /usr/bin/python3 with torch and torchvision (skipped otherwise).
# Prints "N passed, N failed" at the end.
. "$(dirname "$0")/lib.sh"

PY=/usr/bin/python3
if ! $PY -c 'import torch, torchvision, numpy' > /dev/null 2>&1; then
  echo "skip: $PY cannot import torch, torchvision and numpy"; echo "0 passed, 0 failed, 1 skipped"; exit 0
fi
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
$PY tests/torchvision_init_ref.py write "$tmp" > "$tmp/oref" 2>&1 || { bad "PyTorch reference" "$(tail -3 "$tmp/oref")"; finish; }

echo '{"arch":"resnet18","in_chans":1,"num_classes":10,"stem":"imagenet"}' > "$tmp/r18.json"
run=(--model-config "$tmp/r18.json" --data "$tmp/data" --batch 8 --steps 3 --threads 1 --optim sgd --lr 0.01
     --momentum 0 --weight-decay 0 --clip 0 --warmup 0 --lr-schedule constant --augment none --shuffle off
     --eval-batch 16)
for cfg in "1 none" "1 blocks" "2 blocks"; do
  n=${cfg% *} ac=${cfg#* }
  name="$n rank(s), --ac $ac"
  if timeout -k 5 300 "$TRAIN" "${run[@]}" --nproc $n --ac $ac --init-from "$tmp/tv.safetensors" \
       --save-full "$tmp/out-$n-$ac.safetensors" --log "$tmp/l-$n-$ac.jsonl" > "$tmp/o-$n-$ac" 2>&1 &&
     msg=$($PY tests/torchvision_init_ref.py compare "$tmp" "$tmp/out-$n-$ac.safetensors" "$tmp/l-$n-$ac.jsonl" 2>&1); then
    ok "$name: torchvision's resnet18 loaded by name, 3 steps: PyTorch's batch-norm buffers and evaluation"
  else bad "$name: 3 steps from torchvision's resnet18 match PyTorch" "${msg:-}" "$(tail -3 "$tmp/o-$n-$ac")"; fi
done

# expect_load_error NAME PATTERN -- ARGS...: exit 1 or 2 within 60 s, one error line on stderr matching PATTERN
expect_load_error() {
  local name=$1 pat=$2; shift 3
  timeout -k 5 60 "$TRAIN" "$@" > "$tmp/out" 2> "$tmp/err"
  local rc=$?
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then bad "$name" "hung (killed by timeout)"
  elif [ $rc -ne 2 ] && [ $rc -ne 1 ]; then bad "$name" "exit $rc, expected 1 or 2" "$(head -3 "$tmp/err")"
  elif [ "$(grep -c 'fsdp-train' "$tmp/err")" != 1 ] || ! grep -qE -- "$pat" "$tmp/err"; then
    bad "$name" "stderr is not one line matching /$pat/:" "$(head -5 "$tmp/err")"
  else ok "$name (exit $rc, one line)"; fi
}
short=(--model-config "$tmp/r18.json" --data "$tmp/data" --batch 8 --steps 1 --threads 1)
expect_load_error "a buffer missing from the file" "missing.safetensors.*'layer1.0.bn2.running_var' is not in the file" -- \
  "${short[@]}" --nproc 2 --init-from "$tmp/missing.safetensors"
expect_load_error "a parameter missing from the file" "noparam.safetensors: parameter 'layer2.0.downsample.0.weight' is not in the file$" -- \
  "${short[@]}" --init-from "$tmp/noparam.safetensors"
expect_load_error "a parameter of the wrong shape" "shape.safetensors.*'fc.weight' has shape \[10, 256\].*\[10, 512\]" -- \
  "${short[@]}" --init-from "$tmp/shape.safetensors"
finish
