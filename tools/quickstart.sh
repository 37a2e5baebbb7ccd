#!/usr/bin/env bash
# A fresh machine to a first result: installs what is needed (apt, pip), builds the library and
# the CLI, installs the Python package, then prewarms the production set and benchmarks it on a
# GPU, or, without one, compiles it for sm_90 and runs the README's Python quick start on meta
# tensors.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CSA_BUILD_DIR:-build}
python=${PYTHON:-python3}
tools/install_deps.sh
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build "$build"
"$python" -m pip install --quiet --no-build-isolation .
"$build/csa" info
if "$build/csa" info | grep -q '^driver: CUDA'; then
  "$build/csa" prewarm
  "$build/csa" bench --shape 4,2,512,1x8192 --shape 4,2,128,1x8192 --reps 9
else
  "$build/csa" prewarm --arch sm_90
fi
(cd /tmp && "$python" -c 'import csa; print("python package: csa", csa.version())')
