#!/usr/bin/env bash
# The csa CLI as a user meets it: every usage error exits 2 naming the option; failures exit 1;
# JSON output is pure JSON; read-only commands create nothing; every option has help text.
#   tests/test_cli.sh CSA_BINARY
set -uo pipefail
csa=${1:?usage: tests/test_cli.sh CSA_BINARY}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export CSA_CACHE_DIR=$work/never-created
passed=0
failed=0
ok() { passed=$((passed + 1)); }
bad() { failed=$((failed + 1)); echo "FAILED: $*"; }

# usage NEEDLE ARGS...: exit 2 and NEEDLE in the message.
usage() {
  local needle=$1
  shift
  local err
  err=$("$csa" "$@" 2>&1 >/dev/null)
  local rc=$?
  if [ "$rc" -eq 2 ] && grep -qF -- "$needle" <<<"$err"; then ok; else bad "csa $* -> rc $rc: $err"; fi
}
usage --config prewarm --config 4294967300,2,128
usage --config prewarm --config 4,2
usage --config prewarm --config ratio=4,coff=2
usage --config prewarm --config ratio=4,coff=2,head_dim=512,colour=1
usage --arch prewarm --arch sm_99999999999 --config 4,2,128
usage --arch prewarm --arch bogus
usage --device prewarm --device -1 --arch sm_90
usage --jobs prewarm --jobs many --arch sm_90
usage --shape bench --shape 4,2,128,2147483647x2147483647
usage --shape bench --shape 4,2,512
usage --shape bench --shape ratio=4,coff=2,head_dim=4097,pack=1x4096
usage --direction bench --direction sideways
usage --reps bench --reps 0
usage --dtype prewarm --dtype fp64 --arch sm_90
usage --layout prewarm --layout bshd --arch sm_90
usage --dtype bench --dtype half
usage --stride bench --stride -8
usage --layout schedule select --ratio 4 --coff 2 --head-dim 128 --rows 1 --arch sm_90 --layout x
usage --arch schedule show --arch bogus
usage --rows schedule select --ratio 4 --coff 2 --head-dim 128
usage --ratio schedule select --ratio 300 --coff 2 --head-dim 128 --rows 1 --arch sm_90
usage --direction schedule select --ratio 4 --coff 2 --head-dim 128 --rows 1 --arch sm_90 --direction both
usage FILE schedule validate "$work/absent.json"
usage --coff tune --ratio 4 --head-dim 128
usage --rows tune --ratio 128 --coff 1 --head-dim 512 --rows 0
usage --dtype tune --ratio 128 --coff 1 --head-dim 512 --dtype fp8
usage --layout tune --ratio 128 --coff 1 --head-dim 512 --layout bshd
usage --ratio tune --ratio 4 --coff 2 --head-dim 512 --norm --rope-dim 64
usage rope_dim tune --ratio 128 --coff 1 --head-dim 512 --rope-dim 63
usage subcommand cache frobnicate
usage subcommand

# Without a GPU, prewarm says to use --arch; with one this case does not apply.
if ! "$csa" info | grep -q '^driver: CUDA'; then usage "--arch sm_90" prewarm; fi

# A failure (not a usage error) exits 1: a malformed table.
echo '{"schema_version": 1, "arch": "sm_90", "entries": [[1]]}' >"$work/t.json"
out=$("$csa" schedule validate "$work/t.json" 2>&1)
if [ $? -eq 1 ] && grep -qF "entries[0]: must be an object" <<<"$out"; then ok; else bad "validate: $out"; fi

# schedule select names the kernel a row count takes: the resident backward for large SBHD calls
# only (packed bf16 has none), the wide forward for large calls.
sel() { "$csa" schedule select --ratio 4 --coff 2 --head-dim 512 --arch sm_90 "$@" 2>&1; }
if sel --rows 6144 --layout sbhd --direction bwd | grep -q "kernel=resident" &&
  sel --rows 16 --layout sbhd --direction bwd | grep -q "kernel=default" &&
  sel --rows 6144 --direction bwd | grep -q "kernel=default" &&
  sel --rows 6144 --direction fwd | grep -q "kernel=wide" &&
  sel --rows 16 --direction fwd | grep -q "kernel=narrow"; then ok; else bad "select: kernel names"; fi
# A fused tail's large backward takes it in SBHD, not on row-strided THD rows (none there).
tail=(--norm --rope-dim 64 --rows 6144 --direction bwd)
if sel "${tail[@]}" --layout sbhd | grep -q "kernel=resident" &&
  sel "${tail[@]}" --strided | grep -q "strided tail=norm+rope64 rows=6144" &&
  sel "${tail[@]}" --strided | grep -q "kernel=default"; then ok; else bad "select: the tail's kernel"; fi

# schedule select follows an entry keyed on the element type to the calls of that type only.
cat >"$work/keyed.json" <<'JSON'
{"schema_version": 1, "arch": "sm_90", "entries": [
 {"family": "long_window", "direction": "forward", "coff": 1, "head_dim": [1, 4096],
  "ratio": [17, 256], "dtype": "fp32", "buckets": [{"max_rows": null, "vec": 2, "cols": 16,
  "threads": 256, "serial": false, "fast_exp": true}]}]}
JSON
select_keyed() {
  CSA_SCHEDULE_FILE=$work/keyed.json "$csa" schedule select --ratio 128 --coff 1 --head-dim 512 \
    --rows 4096 --arch sm_90 --direction fwd --json "$@" |
    python3 -c 'import json, sys; t = json.load(sys.stdin)["choices"][0]["table"]; print(t and t["dtype"])'
}
if [ "$(select_keyed --dtype fp32)" = fp32 ] && [ "$(select_keyed)" != fp32 ]; then ok; else
  bad "schedule select: the fp32-keyed entry: $(select_keyed --dtype fp32) / $(select_keyed)"
fi

# Pure JSON on stdout wherever JSON is offered.
for cmd in "info --json" "cache info --json" "schedule show" "schedule show --arch sm_90" \
  "schedule select --ratio 4 --coff 2 --head-dim 512 --rows 1024 --arch sm_90 --json" \
  "prewarm --arch sm_90 --config 2,1,8 --json"; do
  # shellcheck disable=SC2086
  if "$csa" $cmd 2>/dev/null | python3 -m json.tool >/dev/null; then ok; else bad "not JSON: csa $cmd"; fi
done

# Read-only commands create nothing (the prewarm above compiled into memory? no: it wrote the
# cache, so use a fresh directory here).
export CSA_CACHE_DIR=$work/read-only-check
for cmd in "info" "info --json" "cache info" "cache info --json" "schedule show" \
  "schedule select --ratio 4 --coff 2 --head-dim 128 --rows 8 --arch sm_90"; do
  # shellcheck disable=SC2086
  "$csa" $cmd >/dev/null 2>&1
  if [ -e "$CSA_CACHE_DIR" ]; then bad "csa $cmd created $CSA_CACHE_DIR"; rm -rf "$CSA_CACHE_DIR"; else ok; fi
done

# clear refuses a directory others may write to, and deletes nothing there.
mkdir -p "$work/shared"
chmod 777 "$work/shared"
echo keep >"$work/shared/model.cubin"
out=$(CSA_CACHE_DIR=$work/shared "$csa" cache clear 2>&1)
if [ $? -eq 1 ] && [ -f "$work/shared/model.cubin" ] && grep -q "refusing" <<<"$out"; then ok; else bad "clear: $out"; fi

# Every option of every command has help text.
for sub in info prewarm "cache info" "cache clear" bench "schedule show" "schedule select" \
  "schedule validate" tune; do
  # shellcheck disable=SC2086
  bare=$("$csa" $sub --help | python3 -c '
import sys
lines = sys.stdin.read().splitlines()
for i, line in enumerate(lines):
    if not line.startswith("  -"):
        continue
    # CLI11 puts the description at column 30, or on the next line when the option is wider.
    described = line[30:].strip() if len(line) > 30 and line[29] == " " else ""
    following = lines[i + 1] if i + 1 < len(lines) else ""
    if not described and not (following.startswith(" " * 30) and following.strip()):
        print(line)
')
  if [ -z "$bare" ]; then ok; else bad "csa $sub: options without help: $bare"; fi
done

echo "cli: $passed passed, $failed failed"
[ "$failed" -eq 0 ]
