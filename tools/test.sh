#!/usr/bin/env bash
# Builds everything and runs the whole test suite: the C++ tests (GPU tests skip without a
# GPU), the CMake package, the Python package and its tests, the fake-driver concurrency tests
# under ThreadSanitizer, the CPU tests under AddressSanitizer + UndefinedBehaviorSanitizer, and
# bounded runs of the fuzzers.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${CSA_BUILD_DIR:-build}
fuzz_seconds=${CSA_FUZZ_SECONDS:-60}
tools/install_deps.sh
export PATH=$PATH:/usr/local/cuda/bin
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCSA_WARNINGS_AS_ERRORS=ON
cmake --build "$build"
(cd "$build" && ctest --output-on-failure -j "$(nproc)")

# The installed package as a user meets it: find_package, add_subdirectory, pkg-config, the
# installed CLI, the exported symbols.
tests/test_package.sh "$build"

# The Python package as a user installs it (pip builds libcsa into it), and its tests (the GPU
# ones skip without a GPU).
python=${PYTHON:-python3}
"$python" -m pip install --quiet --no-build-isolation .
"$python" -m pytest -q -p no:cacheprovider python/tests

# The registry and the launch path under ThreadSanitizer: many threads calling through the
# fake driver at once (no GPU needed).
tsan=${build}-tsan
cmake -S . -B "$tsan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCSA_WARNINGS_AS_ERRORS=ON \
  -DCSA_SANITIZE=thread -DCSA_BUILD_TOOLS=OFF
cmake --build "$tsan" --target csa_fake_driver_tests
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" "$tsan/tests/csa_fake_driver_tests" \
  --gtest_filter='FakeDriver.ManyThreads*:FakeDriver.Warm*'
echo "ThreadSanitizer: the fake-driver concurrency tests ran clean"

# clang with AddressSanitizer + UndefinedBehaviorSanitizer (every finding fatal): the CPU and
# fake-driver tests, then each libFuzzer harness for a bounded time over a copy of its seeds.
asan=${build}-asan
CC=clang CXX=clang++ cmake -S . -B "$asan" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCSA_WARNINGS_AS_ERRORS=ON -DCSA_SANITIZE=address,undefined -DCSA_BUILD_FUZZERS=ON \
  -DCSA_BUILD_TOOLS=OFF -DCSA_BUILD_EXAMPLES=OFF
fuzzers=(schedule_table cache_entry arguments)
cmake --build "$asan" --target csa_cpu_tests csa_fake_driver_tests "${fuzzers[@]/#/csa_fuzz_}"
export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1"
export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
(cd "$asan" && mkdir -p tests/cache && CSA_CACHE_DIR="$PWD/tests/cache" tests/csa_cpu_tests)
"$asan/tests/csa_fake_driver_tests"
echo "AddressSanitizer + UndefinedBehaviorSanitizer: the CPU and fake-driver tests ran clean"
for f in "${fuzzers[@]}"; do
  corpus=$(mktemp -d)
  cp -r "fuzz/corpus/$f/." "$corpus/"
  CSA_LOG_LEVEL=off "$asan/fuzz/csa_fuzz_$f" -max_total_time="$fuzz_seconds" -timeout=30 \
    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$asan/fuzz/$f-" "$corpus" \
    2>&1 | tail -n 12
  rm -rf "$corpus"
  echo "fuzzer $f: no finding in ${fuzz_seconds} s"
done
