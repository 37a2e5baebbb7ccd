#!/usr/bin/env bash
# Builds everything and runs the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CSA_BUILD_DIR:-build}
tools/install_deps.sh
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCSA_WARNINGS_AS_ERRORS=ON
cmake --build "$build"
cd "$build"
ctest --output-on-failure -j "$(nproc)"
