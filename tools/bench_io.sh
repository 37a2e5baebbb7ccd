#!/usr/bin/env bash
# The layout and element-type seams against the bf16 THD-contiguous kernels, one `csa bench`
# run per (shape, variant) on this GPU: SBHD (the pack's segments as batch columns), row-strided
# kv/score/grad rows (the halves of a fused (T, 2W) projection output), fp16 and fp32. Prints a
# table of kernel times, their ratio to bf16 THD, and each one's ratio to its own DRAM floor.
# usage: tools/bench_io.sh OUTDIR [BUILD_DIR] [SHAPE ...]
set -euo pipefail
out=${1:?usage: tools/bench_io.sh OUTDIR [BUILD_DIR] [SHAPE ...]}
build=${2:-build}
shift $(( $# >= 2 ? 2 : 1 ))
shapes=("$@")
[ ${#shapes[@]} -gt 0 ] || shapes=(4,2,512,3x8192 4,2,128,1x8192 128,1,512,1x4096)
mkdir -p "$out"
for shape in "${shapes[@]}"; do
  IFS=, read -r ratio coff d _ <<<"$shape"
  fused=$((2 * coff * d))
  tag=${shape//[,x]/_}
  for variant in "bf16-thd:" "sbhd:--layout sbhd" "strided:--stride $fused" "fp16:--dtype fp16" \
                 "fp32:--dtype fp32"; do
    name=${variant%%:*}
    # shellcheck disable=SC2086
    "$build/csa" bench --no-jit --direction fwd --direction bwd -s "$shape" ${variant#*:} \
      --save "$out/$tag-$name.json" >"$out/$tag-$name.txt" 2>&1
  done
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for f in sorted(out.glob("*.json")):
    tag, name = f.stem.rsplit("-", 1) if not f.stem.endswith("bf16-thd") else (f.stem[:-9], "bf16-thd")
    for row in json.loads(f.read_text())["rows"]:
        runs[(tag, row["direction"], name)] = row
print(f"{'shape':<22} {'dir':<4} {'variant':<9} {'kernel us':>10} {'x bf16 thd':>11} {'x floor':>8}")
for (tag, direction, name), row in sorted(runs.items()):
    base = runs.get((tag, direction, "bf16-thd"))
    rel = row["kernel_us"] / base["kernel_us"] if base else float("nan")
    print(f"{tag:<22} {direction:<4} {name:<9} {row['kernel_us']:>10.2f} {rel:>11.3f} "
          f"{row['ratio_to_floor']:>8.2f}")
PY
