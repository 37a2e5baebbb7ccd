#!/usr/bin/env bash
# The fused tail's forward and backward against the plain pooling kernels of the same shape,
# one `csa bench` run per (shape, variant) on this GPU. A shape is R,C,D,PACK:TAIL with TAIL the
# tail options joined by '+' ("norm+rope64+hadamard"; "+pooled": the forward keeps the pooled
# rows and the backward takes its row-stats form). Prints kernel times and the ratio to the
# plain kernels (the default backward of each: grad_ape, and the tail's grad_w, in the
# schedule's form, atomics in one launch where it takes them).
# usage: tools/bench_tail.sh OUTDIR [BUILD_DIR] [SHAPE:TAIL ...]
set -uo pipefail
out=${1:?usage: tools/bench_tail.sh OUTDIR [BUILD_DIR] [SHAPE:TAIL ...]}
build=${2:-build}
shift $(( $# >= 2 ? 2 : 1 ))
cases=("$@")
[ ${#cases[@]} -gt 0 ] || cases=(4,2,512,1x4096:norm+rope64 4,2,128,1x4096:norm+rope64+hadamard
                                 4,2,512,3x8192:norm+rope64 4,2,128,3x8192:norm+rope64+hadamard
                                 2,2,512,1x4096:norm+rope64 128,1,512,1x4096:norm+rope64
                                 128,1,512,3x8192:norm+rope64)
mkdir -p "$out"
for item in "${cases[@]}"; do
  shape=${item%%:*}
  tail=${item#*:}
  flags=()
  IFS=+ read -ra stages <<<"$tail"
  for s in "${stages[@]}"; do
    case $s in
      norm) flags+=(--norm) ;;
      norm-bf16) flags+=(--norm --norm-weight bf16) ;;
      rope*-half) n=${s#rope}; flags+=(--rope-dim "${n%-half}" --rope-half-split) ;;
      rope*) flags+=(--rope-dim "${s#rope}") ;;
      hadamard) flags+=(--hadamard) ;;
      pooled) flags+=(--keep-pooled) ;;
      *) echo "unknown tail stage '$s' in $item" >&2; exit 2 ;;
    esac
  done
  tag=${shape//[,x]/_}_${tail//+/_}
  # NOTE: a failing shape is reported and the others still run.
  "$build/csa" bench --no-jit --direction fwd --direction bwd -s "$shape" \
    --save "$out/$tag-plain.json" >"$out/$tag-plain.txt" 2>&1 || echo "bench failed: $shape plain" >&2
  "$build/csa" bench --no-jit --direction fwd --direction bwd -s "$shape" "${flags[@]}" \
    --save "$out/$tag-tail.json" >"$out/$tag-tail.txt" 2>&1 || echo "bench failed: $shape $tail" >&2
done
python3 - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
runs = {}
for f in sorted(out.glob("*-plain.json")) + sorted(out.glob("*-tail.json")):
    tag, name = f.stem.rsplit("-", 1)
    for row in json.loads(f.read_text())["rows"]:
        runs[(tag, row["direction"], name)] = row
print(f"{'shape, tail':<42} {'dir':<4} {'tail':<24} {'plain us':>9} {'fused us':>9} {'x plain':>8} {'x floor':>8}")
for tag, direction in sorted({(t, d) for t, d, _ in runs}):
    plain, tail = runs.get((tag, direction, "plain")), runs.get((tag, direction, "tail"))
    if not plain or not tail:
        continue
    label = tail["shape"].split(" tail=")[-1].split(",pack")[0]
    if tag.endswith("_pooled"):
        label += " pooled"
    print(f"{tag:<42} {direction:<4} {label:<24} {plain['kernel_us']:>9.2f} {tail['kernel_us']:>9.2f} "
          f"{tail['kernel_us'] / plain['kernel_us']:>8.3f} {tail['ratio_to_floor']:>8.2f}")
PY
