#!/usr/bin/env bash
# CPU per request of each routing step, native and under V8 (node's WASI),
# over the overhead benchmark's bodies (8, 64 and 400 KiB). Prints a markdown
# table. Needs node (Debian: apt-get install nodejs) for the V8 column.
#
#   bash sim/bench/overhead/steps/run.sh [ROUNDS]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rounds="${1:-9}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/../../../../target}/overhead-steps"
cd "$here"
cargo build -q --release
source "$here/../../../../scripts/setup.sh"
kvroute_setup_wasm_target
cargo build -q --release --target wasm32-wasip1
native="$CARGO_TARGET_DIR/release/kvroute-overhead-steps"
wasm="$CARGO_TARGET_DIR/wasm32-wasip1/release/kvroute-overhead-steps.wasm"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-steps.XXXXXX")"
trap 'rm -rf "$work"' EXIT
for spec in 8192:256 65536:128 409600:64; do
  size="${spec%%:*}"; count="${spec##*:}"
  python3 "$here/../bodies.py" --size "$size" --count "$count" --out "$work/b$size.jsonl"
  "$native" "$work/b$size.jsonl" "$rounds" > "$work/native-$size.json"
  if command -v node >/dev/null 2>&1; then
    # node 20.20.2 segfaulted on the 400 KiB set at 61a152b once in two runs:
    # the V8 column of a size whose run fails is left empty, the rest still prints.
    if node --no-warnings "$here/run-v8.mjs" "$wasm" "$work/b$size.jsonl" "$rounds" > "$work/v8-$size.part"; then
      mv "$work/v8-$size.part" "$work/v8-$size.json"
    else
      echo "steps: node failed on the $size-byte bodies (exit $?); no V8 figures for them" >&2
    fi
  fi
done
python3 - "$work" <<'EOF'
import json, os, sys
work = sys.argv[1]
steps = ["copy", "parse", "hash", "lookup", "insert", "after_hash", "route"]
print("| body | step | native µs | V8 µs | allocations | bytes allocated |")
print("|---|---|---|---|---|---|")
for size in (8192, 65536, 409600):
    n = json.load(open(f"{work}/native-{size}.json"))
    v = json.load(open(f"{work}/v8-{size}.json")) if os.path.exists(f"{work}/v8-{size}.json") else None
    for s in steps:
        a = n["steps"][s]
        b = v["steps"][s]["ns"] / 1000 if v else float("nan")
        print(f"| {size // 1024} KiB ({n['blocks']} blocks) | {s} | {a['ns'] / 1000:.1f} | {b:.1f} | "
              f"{a['allocs']:.0f} | {a['alloc_bytes'] / 1024:.0f} KiB |")
EOF
