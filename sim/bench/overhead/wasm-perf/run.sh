#!/usr/bin/env bash
# Where the module's own time goes, by function name: `perf` over the
# wasmtime harness routing N bench bodies (8 KiB chat requests by default)
# through the module, with wasmtime writing a perf map so that perf names
# the module's functions. A profile of the module's code only: Envoy and V8
# are not in it (wasmtime's Cranelift compiles the module, not V8's
# TurboFan, so shares are indicative).
#
#   bash sim/bench/overhead/wasm-perf/run.sh [WASM] [N] [BODY_BYTES]
#
# Builds the harness with its `perfmap` feature (wasmtime's `profiling`
# feature, the KVROUTE_PERFMAP switch and the ignored `profile_loop` test)
# into its own target directory, so the harness that CI builds stays
# without it. Needs perf.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../../.." && pwd)"
wasm="${1:-$repo/target/wasm32-wasip1/release/kvroute_wasm.wasm}"
n="${2:-30000}"
size="${3:-8192}"
command -v perf >/dev/null || { echo "wasm-perf: needs perf (apt-get install linux-perf)" >&2; exit 1; }
[[ -f "$wasm" ]] || { echo "wasm-perf: no module at $wasm (cargo build --release --target wasm32-wasip1 -p kvroute-wasm)" >&2; exit 1; }
wasm="$(cd "$(dirname "$wasm")" && pwd)/$(basename "$wasm")"

work="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-wasm-perf.XXXXXX")"
trap 'rm -rf "$work"' EXIT
python3 "$repo/sim/bench/overhead/bodies.py" --size "$size" --count 64 --out "$work/bodies.jsonl"

export CARGO_TARGET_DIR="$repo/target/wasm-perf"
exe=$(cd "$repo" && cargo test -q -p kvroute-harness --features perfmap --test kvroute --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "kvroute":
        print(m["executable"])' | tail -1)
[[ -x "$exe" ]] || { echo "wasm-perf: could not build the harness test binary" >&2; exit 1; }

cd "$work"
KVROUTE_WASM="$wasm" KVROUTE_PERFMAP=1 KVROUTE_PERF_BODIES="$work/bodies.jsonl" N="$n" \
  perf record -q -F 2000 -o "$work/perf.data" "$exe" --ignored profile_loop --test-threads 1 >/dev/null 2>&1
echo "module functions, % of all samples (the module's share: its .cwasm line):"
perf report -i "$work/perf.data" --no-children --sort dso 2>/dev/null | grep -E "cwasm" ||
  { echo "wasm-perf: no samples in the module's code (did the loop run? see $exe --ignored profile_loop)" >&2; exit 1; }
perf report -i "$work/perf.data" --no-children --sort dso,sym 2>/dev/null | grep cwasm |
  sed -E 's/ +[^ ]+\.cwasm +\[\.\] / /; s/wasm\[0\]::function\[[0-9]+\]:://; s/17h[0-9a-f]{16}E$//' | head -40 || true
