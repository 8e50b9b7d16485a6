#!/usr/bin/env bash
# kvroute's real-engine tier: real vLLM 0.32 (CPU build, tiny random-weight
# model) on 127.0.0.1, with real prefix caching, /metrics and ZMQ KV events.
#
#   bash scripts/real-vllm.sh setup                  # venv + tiny model + tokenizer (cached)
#   bash scripts/real-vllm.sh start N BASEPORT [--blocks 256] [--event-baseport P] [--no-events]
#                                    [--model tiny|qwen3]   # qwen3: Qwen3's tokenizer + template
#                                                    # N servers on BASEPORT.., healthy on return;
#                                                    # prints addresses, writes a pidfile
#   bash scripts/real-vllm.sh status | stop          # the servers `start` started (pidfile)
#   bash scripts/real-vllm.sh test [PYTEST ARGS]     # the whole tier: setup, build the module and
#                                                    # the emulator, pytest tests/real, stop everything
#
# Cache: ${KVROUTE_VLLM_CACHE:-$HOME/.cache/kvroute/vllm-0.32} holds the venv
# (created once, ~2 min and ~6.5 GB; a marker file says it is complete), the
# model dir and the logs of `start`. Only package registries are used.
# Each server needs 2-3 GiB of RAM and about a minute to start. Server i
# computes on core i (VLLM_CPU_OMP_THREADS_BIND). KV events (`start`): server
# i's PUB socket connects to tcp://127.0.0.1:EVENT_BASEPORT+i (bind a SUB
# there); the pytest fleet instead has each server bind ipc://FILE, which the
# tests' sink and a kvroute-relay connect to. Nothing listens beyond loopback. See tests/real/README.md.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
helper=tests/real/vllm_tier.py
cache="${KVROUTE_VLLM_CACHE:-$HOME/.cache/kvroute/vllm-0.32}"
export KVROUTE_VLLM_CACHE="$cache"

cmd="${1:-}"
[[ -n "$cmd" ]] || { sed -n '2,20p' "$0"; exit 2; }
shift

case "$cmd" in
  setup|start|stop|status|paths)
    exec python3 "$helper" "$cmd" "$@"
    ;;
  test)
    started=$(date +%s)
    python3 "$helper" setup
    echo "==> build: the release module, the emulator, kvroute-calibrate and the KV-event relay"
    unset CARGO_TARGET_DIR
    cargo build --release --target wasm32-wasip1 -p kvroute-wasm
    cargo build --bin kvroute-emulator --bin kvroute-calibrate --bin kvroute-relay
    if ! command -v envoy >/dev/null 2>&1; then
      # shellcheck source=scripts/setup.sh
      source scripts/setup.sh
      kvroute_setup
    fi
    echo "==> pytest tests/real (real vLLM 0.32 x2 + Envoy + kvroute)"
    # The fixtures stop every server they start (also on failure and on
    # SIGTERM/SIGINT); their pidfile is the safety net for a killed pytest.
    export KVROUTE_REAL_PIDFILE="${KVROUTE_REAL_PIDFILE:-$(mktemp -d)/servers.json}"
    # test_qwen3.py's fleet lists its servers in servers-qwen3.json beside it.
    qwen3_pidfile="$(dirname "$KVROUTE_REAL_PIDFILE")/servers-qwen3.json"
    trap 'python3 "$helper" stop --pidfile "$KVROUTE_REAL_PIDFILE" >/dev/null 2>&1 || true
          python3 "$helper" stop --pidfile "$qwen3_pidfile" >/dev/null 2>&1 || true' EXIT
    rc=0
    KVROUTE_E2E_NO_BUILD=1 "$cache/venv/bin/python" -m pytest tests/real -v -rs "$@" || rc=$?
    echo "real-vllm test: exit $rc in $(( $(date +%s) - started ))s"
    exit $rc
    ;;
  *)
    echo "real-vllm.sh: unknown command '$cmd' (setup, start, stop, status, test)" >&2
    exit 2
    ;;
esac
