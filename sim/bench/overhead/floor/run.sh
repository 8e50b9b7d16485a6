#!/usr/bin/env bash
# The floor of kvroute's design on Envoy's V8, side by side with round robin,
# kvroute loaded but not routing (kv-skip) and kvroute itself: builds the
# floor module (src/lib.rs) and runs ../run.sh at 8 and 400 KiB with it as an
# extra arm, the reference of the req/s target (kvroute ÷ host-floor >= 0.9).
# Other options go to bench.py, e.g. --rounds 3 or --sizes 8k. The floor's values are
# 1 byte; FLOOR_LOAD_BYTES, FLOOR_SHARD_BYTES and FLOOR_SHARDS in the
# environment build it with other sizes and key counts (src/lib.rs).
#
#   bash sim/bench/overhead/floor/run.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../../.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
source "$repo/scripts/setup.sh"
kvroute_setup_wasm_target
cargo build -q --release --target wasm32-wasip1 --manifest-path "$here/Cargo.toml" \
  --target-dir "$target_dir/overhead-floor"
floor="$target_dir/overhead-floor/wasm32-wasip1/release/kvroute_overhead_floor.wasm"
exec bash "$here/../run.sh" --sizes 8k,400k --arms envoy-rr,kv-skip,host-floor,kvroute \
  --variant "host-floor=$floor" "$@"
