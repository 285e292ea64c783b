#!/usr/bin/env bash
# The demo: installs what is missing, builds, and trains a small GPT on two
# ranks (FULL_SHARD) over the built-in synthetic corpus, printing the loss
# falling towards the corpus's entropy floor. Extra flags go to fsdp-train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
make -j"$(nproc)" >/dev/null
exec build/fsdp-train --nproc 2 --model small --data synthetic --batch 16 --seq 128 \
  --steps 600 --lr 3e-3 --warmup 20 "$@"
