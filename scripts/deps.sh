#!/usr/bin/env bash
# Installs the Debian 12 packages strata needs to build, test and benchmark. Idempotent and quiet
# when everything is already there. Needs root (or sudo) only when something is missing.
# The CUDA toolkit is not a Debian package: it is used when found (/usr/local/cuda), else skipped.
# python3-dev, pybind11-dev and libtorch-dev build the Python package (import strata);
# libopenblas0-serial becomes the system BLAS torch's FP32 matmuls go through (Debian's default,
# the netlib reference BLAS, is ~5x slower; the serial build keeps results independent of threads).
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache git
  liburing-dev libyaml-cpp-dev libcli11-dev nlohmann-json3-dev libxxhash-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libopenmpi-dev openmpi-bin
  python3 python3-torch python3-yaml python3-matplotlib python3-numpy
  python3-dev pybind11-dev libtorch-dev libopenblas0-serial
  fio util-linux procps
  clang-16 libclang-rt-16-dev clang-format universal-ctags
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[ ${#missing[@]} -eq 0 ] && exit 0

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else
    echo "deps.sh: missing packages (${missing[*]}) and not root; run as root" >&2
    exit 1
  fi
fi
echo "deps.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
