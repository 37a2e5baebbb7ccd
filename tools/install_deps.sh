#!/usr/bin/env bash
# Installs what csa builds and tests with, skipping what is already there: Debian packages for
# the C++ library, its tests and fuzzers (clang for libFuzzer and the sanitizer build), and
# the PyPI packages of the Python package and its tests (torch from PyPI; no GPU needed).
# The CUDA toolkit (NVRTC and headers, 12.0 or newer) must already be installed under
# /usr/local/cuda or on the CMake search path; the GPU driver is optional.
set -euo pipefail
packages=(cmake ninja-build g++ binutils pkg-config libfmt-dev libspdlog-dev nlohmann-json3-dev
          libcli11-dev libxxhash-dev libgtest-dev clang libclang-rt-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}"
fi
if ! command -v nvcc >/dev/null && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "note: no CUDA toolkit found (nvcc); install NVIDIA's CUDA toolkit (12.0 or newer) for NVRTC" >&2
fi

python=${PYTHON:-python3}
if ! "$python" -c 'import torch, pytest, scikit_build_core' >/dev/null 2>&1; then
  "$python" -m pip install --quiet "torch>=2.5" pytest numpy "scikit-build-core>=0.8"
fi
