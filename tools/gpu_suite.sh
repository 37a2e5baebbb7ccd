#!/usr/bin/env bash
# Runs everything that needs a GPU on an already built tree: the GPU tests (C++ and Python), the
# memory checker over the adversarial-offset tests and every 128,1,512 bucket, the race checker
# over the ring backwards, and the benchmarks (csa bench, the launch benchmark, the PyTorch
# comparison). Full logs go to OUTDIR; a summary is printed last.
#   tools/gpu_suite.sh OUTDIR [BUILD_DIR]
# CSA_SUITE_PARTS: the parts to run, ','-separated, of tests, atomic, prebuilt, sanitizers,
#   resident, tail, python, tune, bench, launch, long, torch (default: all).
# CSA_SUITE_VARIANTS: extra benchmark runs, ';'-separated CSA_SHORT_WINDOW_SCHEDULE values.
# The Python package is taken from python/ with CSA_LIBRARY=BUILD_DIR/libcsa.so.0 unless an
# installed one is importable.
set -u
out=${1:?usage: tools/gpu_suite.sh OUTDIR [BUILD_DIR]}
build=${2:-build}
mkdir -p "$out"
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export PATH=$PATH:/usr/local/cuda/bin
CSA_CACHE_DIR=${CSA_CACHE_DIR:-$(mktemp -d)/csa}
export CSA_CACHE_DIR
parts=",${CSA_SUITE_PARTS:-tests,atomic,prebuilt,sanitizers,resident,tail,python,tune,bench,launch,long,torch},"
want() { [[ $parts == *",$1,"* ]]; }
if ! python3 -c 'import csa' 2>/dev/null; then
  export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
  export CSA_LIBRARY=${CSA_LIBRARY:-$PWD/$build/libcsa.so.0}
fi
export PYTHONUNBUFFERED=1
summary=()

nvidia-smi >"$out/nvidia-smi.txt" 2>&1
"$build/csa" info >"$out/info.txt" 2>&1

# Cold JIT of the default production set (fresh cache), then the same again from the cache.
"$build/csa" prewarm >"$out/prewarm.txt" 2>&1
"$build/csa" prewarm >>"$out/prewarm.txt" 2>&1
summary+=("prewarm: $(grep -cE ' compiled ' "$out/prewarm.txt") compiled, $(grep -cE ' cache ' "$out/prewarm.txt") from cache")

if want tests; then
  start=$(date +%s)
  "$build/tests/csa_gpu_tests" >"$out/gpu_tests.log" 2>&1
  rc=$?
  summary+=("gpu tests: rc=$rc ($(($(date +%s) - start)) s): $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$out/gpu_tests.log" | tr '\n' ' ')")
  "$build/csa_trainer_loop" >"$out/trainer_loop.log" 2>&1
  summary+=("trainer loop example: rc=$? $(tail -1 "$out/trainer_loop.log")")
fi

if want atomic; then
  # The atomic grad_ape variant (not the default) over the same correctness matrix.
  CSA_SHORT_WINDOW_SCHEDULE=fixed=0 "$build/tests/csa_gpu_tests" --gtest_filter='Configs/*:Gpu.NothingToPool*' \
    >"$out/gpu_tests_atomic.log" 2>&1
  summary+=("gpu tests, atomic grad_ape: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_tests_atomic.log" | tr '\n' ' ')")
fi

if want prebuilt && [ -d "$build/csa-kernels" ]; then
  # The prebuilt layer beside the library serves the production set with JIT off and an empty
  # cache directory (the CLI and the Python package).
  empty=$(mktemp -d)/cache
  CSA_DISABLE_JIT=1 CSA_CACHE_DIR=$empty "$build/csa" prewarm >"$out/prebuilt.txt" 2>&1
  rc=$?
  CSA_DISABLE_JIT=1 CSA_CACHE_DIR=$empty python3 -c 'import csa; print(csa.prewarm())' \
    >>"$out/prebuilt.txt" 2>&1
  summary+=("prebuilt layer, JIT off: cli rc=$rc, python rc=$?, $(grep -c 'csa-kernels' "$out/prebuilt.txt") served from csa-kernels")
fi

if want resident; then
  # The resident backward kernels (by default only calls of 2^19 output elements or more take
  # them) on every call of the layout and type matrix, and under the memory checker.
  CSA_SHORT_WINDOW_SCHEDULE=bresmin=0 "$build/tests/csa_gpu_tests" --gtest_filter='*GpuIo*:Gpu.Adversarial*:Gpu.Sbhd*' \
    >"$out/gpu_tests_resident.log" 2>&1
  summary+=("gpu tests, resident backward on every call: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_tests_resident.log" | tr '\n' ' ')")
  # The tails' resident backward kernels (windows of 5..8 slots) on every call likewise.
  CSA_SHORT_WINDOW_SCHEDULE=bresmin=0 "$build/tests/csa_gpu_tests" --gtest_filter='Tails/GpuTail.Backward*/r4_c2*' \
    >"$out/gpu_tests_resident_tail.log" 2>&1
  summary+=("gpu tests, tails' resident backward on every call: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_tests_resident_tail.log" | tr '\n' ' ')")
  # The wide forward (its fp16 kernel with the residency target) on every call likewise.
  CSA_SHORT_WINDOW_SCHEDULE=fwmin=0 "$build/tests/csa_gpu_tests" --gtest_filter='*GpuIo*' \
    >"$out/gpu_tests_wide.log" 2>&1
  summary+=("gpu tests, wide forward on every call: rc=$? $(grep -E '^\[  (PASSED|FAILED) ' "$out/gpu_tests_wide.log" | tr '\n' ' ')")
  if command -v compute-sanitizer >/dev/null; then
    CSA_SHORT_WINDOW_SCHEDULE=bresmin=0 compute-sanitizer --tool memcheck --error-exitcode 9 \
      "$build/tests/csa_gpu_tests" --gtest_filter='Gpu.AdversarialStrides*:Gpu.SbhdShorter*' \
      >"$out/memcheck_resident.log" 2>&1
    summary+=("memcheck, resident backward: rc=$? $(grep -E 'ERROR SUMMARY' "$out/memcheck_resident.log" | tail -1)")
  fi
fi

if want tail; then
  # The fused tail's forward: its test matrix under the memory checker, and its benchmark
  # against the plain pooling forward (tools/bench_tail.sh).
  if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/csa_gpu_tests" \
      --gtest_filter='Tails/GpuTail.*bf16_thd:Tails/GpuTail.*fp32_sbhd:Gpu.TailRejections*' \
      >"$out/memcheck_tail.log" 2>&1
    summary+=("memcheck, fused tail: rc=$? $(grep -E 'ERROR SUMMARY' "$out/memcheck_tail.log" | tail -1)")
  fi
  tools/bench_tail.sh "$out/bench_tail" "$build" >"$out/bench_tail.txt" 2>&1
  summary+=("bench tail: rc=$?")
fi

if want python; then
  start=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider python/tests >"$out/python_tests.log" 2>&1
  summary+=("python tests: rc=$? ($(($(date +%s) - start)) s): $(tail -1 "$out/python_tests.log")")
fi

if ! want sanitizers; then
  :
elif command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/tests/csa_gpu_tests" \
    --gtest_filter='Gpu.AdversarialOffsets*:Gpu.AdversarialStrides*:Gpu.SbhdShorter*:Gpu.NothingToPool*:Gpu.Misaligned*:Configs/LongWindow.EveryBucketKernelRuns/r128_c1_d512' \
    >"$out/memcheck.log" 2>&1
  summary+=("memcheck: rc=$? $(grep -E 'ERROR SUMMARY' "$out/memcheck.log" | tail -1)")
  # Shared-memory hazards of the backward's cp.async ring (shipped at ratio 128, head_dim 128/512;
  # every 128,2,128 bucket: the ring-less, the two-stage and the one-CTA three-stage kernels).
  timeout 600 compute-sanitizer --tool racecheck --error-exitcode 9 "$build/tests/csa_gpu_tests" \
    --gtest_filter='Configs/LongWindow.EveryBucketKernelRuns/r128_c2_d128' >"$out/racecheck.log" 2>&1
  summary+=("racecheck: rc=$? $(grep -E 'RACECHECK SUMMARY' "$out/racecheck.log" | tail -1)")
else
  summary+=("memcheck: compute-sanitizer not found")
fi

if want tune; then
  # A keyed tune: fp16 SBHD entries, which schedule select then names for fp16 SBHD calls only.
  start=$(date +%s)
  tuned="$out/tuned_fp16_sbhd.json"
  "$build/csa" tune --ratio 128 --coff 1 --head-dim 512 --dtype fp16 --layout sbhd \
    --rows 32,256 --reps 3 --out "$tuned" >"$out/tune.txt" 2>&1
  rc=$?
  keyed=$(python3 -c 'import json, sys
t = json.load(open(sys.argv[1]))
print(sum(e.get("dtype") == "fp16" and e.get("layout") == "sbhd" for e in t["entries"]))' "$tuned" 2>&1)
  names_entry() { CSA_SCHEDULE_FILE="$tuned" "$build/csa" schedule select --ratio 128 --coff 1 \
    --head-dim 512 --rows 1024 "$@" 2>&1 | grep -c "(the fp16 sbhd entry)"; }
  summary+=("tune fp16 sbhd: rc=$rc ($(($(date +%s) - start)) s), $keyed keyed entries; select names them for fp16 sbhd: $(names_entry --dtype fp16 --layout sbhd), for bf16 thd: $(names_entry)")
fi

if want bench; then
  "$build/csa" bench --save "$out/bench.json" >"$out/bench.txt" 2>&1
  summary+=("bench: rc=$?")
fi

if want launch; then
  # Host cost per call (plan, runtime, raw driver launches of the same kernels), graph replay.
  "$build/csa_launch_bench" "$out/launch.json" >"$out/launch.txt" 2>&1
  summary+=("launch bench: rc=$?")
fi

if want long; then
  # Long-window shapes (ratio 128 production and experiment shapes).
  long_shapes=()
  for c in 128,1,128 128,2,128 128,1,512 128,2,512; do
    for pack in 1x4096 1x8192 1x65536 1x131072; do long_shapes+=(-s "$c,$pack"); done
  done
  "$build/csa" bench --no-jit --save "$out/bench_long.json" "${long_shapes[@]}" >"$out/bench_long.txt" 2>&1
  summary+=("bench long-window: rc=$?")
fi

if want torch; then
  # csa.compress against the eager region and torch.compile of it (tools/bench_torch.py), with
  # csa bench's kernel times of the same shapes for the graph-replay target.
  torch_shapes=()
  for s in 4,2,128,1x8192 4,2,512,3x8192 128,1,512,1x4096 2,2,512,1x4096; do
    torch_shapes+=(-s "$s")
  done
  "$build/csa" bench --no-jit --direction fwd --direction bwd --save "$out/bench_torch_kernels.json" \
    "${torch_shapes[@]}" >"$out/bench_torch_kernels.txt" 2>&1
  python3 tools/bench_torch.py --csa-bench "$out/bench_torch_kernels.json" \
    --save "$out/bench_torch.json" >"$out/bench_torch.txt" 2>&1
  summary+=("torch bench: rc=$?")
fi

# CSA_SUITE_PROFILE=SHAPE: hardware counters of the kernels of one benchmark shape.
if [ -n "${CSA_SUITE_PROFILE:-}" ] && command -v ncu >/dev/null; then
  ncu --clock-control none -k regex:"short_window|ape_reduce" -c 9 --section SpeedOfLight --section WarpStateStats \
    --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
    "$build/csa" bench --no-jit --reps 1 --shape "$CSA_SUITE_PROFILE" >"$out/ncu.txt" 2>&1
  summary+=("ncu: rc=$?")
fi

IFS=';' read -r -a variants <<<"${CSA_SUITE_VARIANTS:-}"
i=0
for v in "${variants[@]}"; do
  [ -n "$v" ] || continue
  i=$((i + 1))
  echo "# CSA_SHORT_WINDOW_SCHEDULE=$v" >"$out/bench_variant_$i.txt"
  CSA_SHORT_WINDOW_SCHEDULE="$v" "$build/csa" bench --no-jit --reps 9 >>"$out/bench_variant_$i.txt" 2>&1
done

for f in bench.txt launch.txt bench_torch.txt bench_tail.txt; do [ -f "$out/$f" ] && cat "$out/$f"; done
[ -f "$out/bench_long.txt" ] && grep -E '^ratio=' "$out/bench_long.txt" | grep -v bwd-det
for f in "$out"/bench_variant_*.txt; do [ -f "$f" ] && { head -1 "$f"; grep -E '^ratio=' "$f" | awk '{print $1, $2, $5, $6}'; }; done
printf '%s\n' "${summary[@]}"
