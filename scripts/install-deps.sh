#!/usr/bin/env bash
# Installs the Debian packages fsdp.c needs to build, test and run, when missing.
# Idempotent: asks apt-get only for packages that dpkg does not list as installed.
# Usage: scripts/install-deps.sh [--with-torch] [--with-fuzz]   (--with-torch adds
# python3-torch and python3-torchvision, the optional numerical references some
# tests use when present;
# --with-fuzz adds clang and libclang-rt-14-dev for `make fuzz` / scripts/fuzz.sh;
# --with-torch also adds Node.js and npm, unless node and npm are already on the PATH
# (from any source): tests/t_bpe.sh installs the JavaScript GPT-2 encoder with npm;
# and chromium, in which tests/t_plot.sh renders fsdp-plot's SVG to check the picture)
set -euo pipefail
pkgs=(build-essential pkg-config libdnnl-dev libopenmpi-dev openmpi-bin libcjson-dev zlib1g-dev python3
      dataset-fashion-mnist)
for a in "$@"; do
  case "$a" in
    --with-torch) pkgs+=(python3-torch python3-torchvision python3-numpy chromium)
      command -v node > /dev/null && command -v npm > /dev/null || pkgs+=(nodejs npm) ;;
    --with-fuzz) pkgs+=(clang libclang-rt-14-dev libomp-14-dev) ;;
    *) echo "install-deps.sh: unknown option '$a'" >&2; exit 2 ;;
  esac
done
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "installing: ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
