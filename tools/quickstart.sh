#!/usr/bin/env bash
# Fresh machine to first result: install, build, prewarm the default configurations, then a
# short benchmark on a GPU if there is one, else compile for sm_90 without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CSA_BUILD_DIR:-build}
tools/install_deps.sh
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build"
"$build/csa" info
if "$build/csa" info | grep -q '^driver: CUDA'; then
  "$build/csa" prewarm
  "$build/csa" bench --shape 4,2,512,1x8192 --shape 4,2,128,1x8192 --reps 9
else
  "$build/csa" prewarm --arch sm_90
fi
