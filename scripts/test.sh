#!/usr/bin/env bash
# The whole test suite: installs what is missing (PyTorch too, the numerical
# reference some tests compare against), builds everything (WERROR=1 makes
# warnings errors, as CI does), and runs tests/run.sh, which ends with
# "N passed, N failed, N skipped" and exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --with-torch
make -j"$(nproc)" WERROR="${WERROR:-0}"
exec tests/run.sh "$@"
