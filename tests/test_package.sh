#!/usr/bin/env bash
# The installed package as a user meets it: cmake --install of BUILD_DIR into a fresh prefix;
# consumers through find_package (C and C++), add_subdirectory and pkg-config, each running;
# the installed CLI runs; libcsa.so exports only csa_* and csa:: symbols.
#   tests/test_package.sh BUILD_DIR
set -euo pipefail
build=$(cd "${1:?usage: tests/test_package.sh BUILD_DIR}" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >/dev/null

# find_package(csa) from the prefix: C++ and C.
cmake -S "$src/tests/package/consumer" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" \
  -DCMAKE_BUILD_RPATH="$prefix/lib" >/dev/null
cmake --build "$work/consumer" >/dev/null
"$work/consumer/consumer_cpp"
"$work/consumer/consumer_c"

# pkg-config.
PKG_CONFIG_PATH="$prefix/lib/pkgconfig" cc "$src/tests/package/consumer/main.c" -o "$work/pc" \
  $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs csa) -Wl,-rpath,"$prefix/lib"
"$work/pc"

# add_subdirectory of the source tree.
cmake -S "$src/tests/package/subproject" -B "$work/sub" -G Ninja -DCSA_SOURCE_DIR="$src" >/dev/null
cmake --build "$work/sub" --target consumer_cpp >/dev/null
"$work/sub/consumer_cpp"

# The installed CLI finds the installed library (install RPATH), and reports.
env -u LD_LIBRARY_PATH "$prefix/bin/csa" info >/dev/null
echo "installed csa info: ok"

# Only the public symbols are exported.
leaked=$(nm -D --defined-only "$prefix/lib/libcsa.so" | awk '{print $3}' | c++filt |
  grep -vE '^(csa_|csa::|typeinfo for csa::|typeinfo name for csa::|vtable for csa::)' || true)
if [ -n "$leaked" ]; then
  echo "libcsa.so exports non-public symbols:"
  echo "$leaked" | head -20
  exit 1
fi
echo "exports: $(nm -D --defined-only "$prefix/lib/libcsa.so" | wc -l) symbols, all csa_* or csa::"
[ -f "$prefix/lib/cmake/csa/csaConfigVersion.cmake" ] && [ ! -e "$prefix/include/csa/testing" ]
echo "package tests: 5 passed, 0 failed"
