#!/usr/bin/env bash
# Builds everything and runs the whole test suite (GPU tests skip without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CSA_BUILD_DIR:-build}
tools/install_deps.sh
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCSA_WARNINGS_AS_ERRORS=ON
cmake --build "$build"
(cd "$build" && ctest --output-on-failure -j "$(nproc)")

# The registry and the launch path under ThreadSanitizer: many threads calling through the
# fake driver at once (no GPU needed).
tsan=${build}-tsan
cmake -S . -B "$tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCSA_WARNINGS_AS_ERRORS=ON \
  -DCSA_SANITIZE=thread -DCSA_BUILD_TOOLS=OFF
cmake --build "$tsan" --target csa_fake_driver_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "$tsan/tests/csa_fake_driver_tests" \
  --gtest_filter='FakeDriver.ManyThreads*:FakeDriver.Warm*'
echo "ThreadSanitizer: the fake-driver concurrency tests ran clean"
