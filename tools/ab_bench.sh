#!/usr/bin/env bash
# A/B of library builds on one GPU: runs `csa bench` once per build and round, the builds
# taking turns within every round (so drift in clocks or temperature hits them alike), then
# prints kernel µs per shape and direction, one column per build and round.
#   tools/ab_bench.sh OUTDIR NAME=LIBDIR[@SCHEDULE] [...] -- [csa bench options]
# LIBDIR holds a libcsa.so (a copy of a build's libcsa.so*); SCHEDULE, where given, is that
# build's CSA_SHORT_WINDOW_SCHEDULE (one library against itself with a schedule field changed,
# e.g. default=build resident_off=build@bres=0). The csa executable comes from
# CSA_AB_BUILD (default: build) and loads each LIBDIR's library in turn. CSA_AB_ROUNDS sets
# the rounds (default 2). CSA_AB_SECONDS: start no run after that many seconds and print the
# table of the runs done (a run cut short by an outer time limit prints nothing). Example:
#   tools/ab_bench.sh /tmp/ab base=build/var_base new=build -- --direction fwd -s 128,1,512,1x65536
#   tools/ab_bench.sh /tmp/ab res=build nores=build@bres=0 -- --direction bwd --layout sbhd \
#     -s 4,2,512,3x8192
set -u
out=${1:?usage: tools/ab_bench.sh OUTDIR NAME=LIBDIR ... -- [csa bench options]}
shift
builds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  case "$1" in
    *=*) builds+=("$1") ;;
    *) echo "ab_bench: expected NAME=LIBDIR, got '$1'" >&2; exit 2 ;;
  esac
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#builds[@]} -ge 1 ] || { echo "ab_bench: no NAME=LIBDIR given" >&2; exit 2; }
csa="${CSA_AB_BUILD:-build}/csa"
[ -x "$csa" ] || { echo "ab_bench: $csa not found (set CSA_AB_BUILD)" >&2; exit 2; }
rounds=${CSA_AB_ROUNDS:-2}
deadline=${CSA_AB_SECONDS:-}
started=$(date +%s)
mkdir -p "$out"
columns=()
for ((r = 1; r <= rounds; ++r)); do
  for b in "${builds[@]}"; do
    name=${b%%=*}
    lib=${b#*=}
    schedule=
    if [[ $lib == *@* ]]; then
      schedule=${lib#*@}
      lib=${lib%%@*}
    fi
    [ -e "$lib/libcsa.so" ] || { echo "ab_bench: no libcsa.so in $lib" >&2; exit 2; }
    if [ -n "$deadline" ] && [ $(($(date +%s) - started)) -ge "$deadline" ]; then
      echo "ab_bench: ${deadline} s passed; ${name}_$r and later runs not started" >&2
      break 2
    fi
    col="${name}_$r"
    if [ -n "$schedule" ]; then
      CSA_SHORT_WINDOW_SCHEDULE="$schedule" LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" "$csa" \
        bench --no-jit --save "$out/$col.json" "$@" >"$out/$col.txt" 2>&1
    else
      LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}" "$csa" bench --no-jit --save "$out/$col.json" \
        "$@" >"$out/$col.txt" 2>&1
    fi
    rc=$?
    echo "ab_bench: $col rc=$rc" >&2
    [ $rc -eq 0 ] || exit $rc
    columns+=("$col")
  done
done
[ ${#columns[@]} -ge 1 ] || { echo "ab_bench: no run finished" >&2; exit 1; }
python3 - "$out" "${columns[@]}" <<'EOF'
import json, sys
out, columns = sys.argv[1], sys.argv[2:]
table, order = {}, []
for col in columns:
    with open(f"{out}/{col}.json") as f:
        for row in json.load(f)["rows"]:
            key = (row["shape"], row["direction"])
            if key not in table:
                table[key] = {"target": row["target_us"]}
                order.append(key)
            table[key][col] = row["kernel_us"]
print("kernel us (median); target: the issue's rule")
print(" ".join(["shape", "dir", "target"] + columns))
for key in order:
    cells = [f"{table[key][c]:.2f}" if c in table[key] else "-" for c in columns]
    print(" ".join([key[0], key[1], f"{table[key]['target']:.2f}"] + cells))
EOF
