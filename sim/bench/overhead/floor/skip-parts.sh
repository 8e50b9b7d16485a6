#!/usr/bin/env bash
# What each part of kvroute's request path costs in Envoy: builds of the
# module with one part skipped, side by side with round robin, host-floor
# and kvroute itself, at 8 KiB. The builds come from skip-parts.patch
# applied to a temporary git worktree of HEAD (the repository's own sources
# are not touched); the patch reads KVROUTE_EXP at compile time:
#   noparse    the body is hashed as it comes, not parsed and rendered
#   noindex    no index lookup or insert (no shard reads or writes)
#   norelease  no release writes (charges only; the load table fills up)
# These builds route worse or leak load on purpose: benchmark arms only.
# Other options go to bench.py, e.g. --rounds 3.
#
#   bash sim/bench/overhead/floor/skip-parts.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../../.." && pwd)"
target_dir="${CARGO_TARGET_DIR:-$repo/target}"
work="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-skip.XXXXXX")"
cleanup() { git -C "$repo" worktree remove --force "$work/src" >/dev/null 2>&1 || true; rm -rf "$work"; }
trap cleanup EXIT
git -C "$repo" worktree add -q --detach "$work/src" HEAD
git -C "$work/src" apply "$here/skip-parts.patch"
variants=()
for part in noparse noindex norelease; do
  (cd "$work/src" && KVROUTE_EXP=$part CARGO_TARGET_DIR="$target_dir/overhead-skip" \
    cargo build -q --release --target wasm32-wasip1 -p kvroute-wasm)
  cp "$target_dir/overhead-skip/wasm32-wasip1/release/kvroute_wasm.wasm" "$work/$part.wasm"
  variants+=(--variant "$part=$work/$part.wasm")
done
cargo build -q --release --target wasm32-wasip1 --manifest-path "$here/Cargo.toml" \
  --target-dir "$target_dir/overhead-floor"
floor="$target_dir/overhead-floor/wasm32-wasip1/release/kvroute_overhead_floor.wasm"
bash "$here/../run.sh" --sizes 8k --arms envoy-rr,host-floor,kvroute,noparse,noindex,norelease \
  --variant "host-floor=$floor" "${variants[@]}" "$@"
