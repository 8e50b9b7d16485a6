#!/usr/bin/env bash
# One relay's cost per event and per poll, on loopback (issue 17, "at scale").
# Bounded: about 1-2 minutes; starts its own relays and stops them by PID.
#
#   relay/bench/cost.sh            # from the repository root
#   WRK_SECS=5 RUNS=3 relay/bench/cost.sh
#
# Needs wrk. CPU is the relay process's own (sum of
# /proc/PID/task/*/schedstat), so wrk's share of the machine is not counted.
set -euo pipefail
cd "$(dirname "$0")/../.."
WRK_SECS=${WRK_SECS:-5}
RUNS=${RUNS:-2}
PUB_PORT=${PUB_PORT:-39557}
HTTP_PORT=${HTTP_PORT:-39157}
BATCHES=${BATCHES:-20000}
command -v wrk >/dev/null || { echo "needs wrk (apt-get install -y wrk)"; exit 1; }

cargo build --release -q -p kvroute-relay --bin kvroute-relay --example relay_cost
RELAY=target/release/kvroute-relay
COST=target/release/examples/relay_cost
BASE=http://127.0.0.1:$HTTP_PORT
PIDS=()
cleanup() { for p in "${PIDS[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

cpu_ns() { # total CPU ns of PID's threads
  local t=0 v
  for f in /proc/"$1"/task/*/schedstat; do read -r v _ <"$f" && t=$((t + v)); done
  echo "$t"
}
metric() { curl -s "$BASE/metrics" | awk -v n="$1" '$1==n {print $2}'; }

start_relay() { # $1 = --max-blocks
  "$RELAY" --sub "tcp://127.0.0.1:$PUB_PORT" --topic kv@bench --listen "127.0.0.1:$HTTP_PORT" \
    --max-blocks "$1" 2>/dev/null &
  RPID=$!
  PIDS+=("$RPID")
  # /metrics, not /healthz: /healthz is 503 until the publisher (started next) is connected.
  for _ in $(seq 50); do curl -sf "$BASE/metrics" >/dev/null && return; sleep 0.1; done
  echo "relay did not start"; exit 1
}
stop_relay() { kill "$RPID"; wait "$RPID" 2>/dev/null || true; }

echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD) $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
"$COST" state --batches "$BATCHES"
echo

# --- ZMQ path: a PUB as fast as it can, the relay applies what it keeps up with.
echo "# ZMQ loopback: relay CPU per applied batch (64 stored + 64 removed, 256 held)"
echo -e "run\tpublished\tapplied\tgap_batches\trelay_cpu_ms\tcpu_us_per_batch\tcpu_ns_per_hash"
for r in $(seq "$RUNS"); do
  start_relay 65536
  c0=$(cpu_ns "$RPID")
  "$COST" pub --endpoint "tcp://127.0.0.1:$PUB_PORT" --batches "$BATCHES" --hashes 64 --held 256 2>/dev/null
  c1=$(cpu_ns "$RPID")
  applied=$(metric kvroute_relay_batches_total); gaps=$(metric kvroute_relay_gap_batches_total)
  hashes=$(curl -s "$BASE/metrics" | awk '/^kvroute_relay_hashes_total/ {s+=$2} END {print s}')
  awk -v r="$r" -v n="$BATCHES" -v a="$applied" -v g="$gaps" -v c="$((c1 - c0))" -v h="$hashes" \
    'BEGIN {printf "%s\t%d\t%d\t%d\t%.0f\t%.2f\t%.1f\n", r, n, a, g, c/1e6, c/1e3/a, c/h}'
  [ "$r" = "$RUNS" ] || stop_relay
done

# --- Polls, on the relay just loaded (ring of 4096 batches, 256 blocks held).
tip=$(metric kvroute_relay_seq); tip=${tip%.*}
poll() { # name path [wrk flags]
  local name=$1 path=$2 bytes c0 c1 out req
  shift 2
  bytes=$(curl -s "$BASE$path" | wc -c)
  for r in $(seq "$RUNS"); do
    c0=$(cpu_ns "$RPID")
    out=$(wrk -t1 -c8 -d"${WRK_SECS}s" "$@" "$BASE$path")
    c1=$(cpu_ns "$RPID")
    req=$(awk '/requests in/ {print $1}' <<<"$out")
    awk -v n="$name" -v b="$bytes" -v q="$req" -v s="$WRK_SECS" -v c="$((c1 - c0))" \
      'BEGIN {printf "%s\t%d\t%.0f\t%.1f\t%.0f\n", n, b, q/s, c/1e3/q, q/(c/1e9)}'
  done
}
echo
echo "# HTTP polls (wrk -t1 -c8 -d${WRK_SECS}s; relay is one tokio thread)"
echo -e "answer\tbytes\treq_per_s\trelay_cpu_us_per_req\treq_per_relay_cpu_s"
poll "events tip" "/kv/events?after=$tip"
poll "events tip, new connection each" "/kv/events?after=$tip" -H "Connection: close"
poll "events backlog 20 batches" "/kv/events?after=$((tip - 20))"
poll "snapshot 256 blocks" "/kv/snapshot"
poll "metrics" "/metrics"
stop_relay

# --- A full 65536-block snapshot.
start_relay 65536
"$COST" pub --endpoint "tcp://127.0.0.1:$PUB_PORT" --batches 1024 --hashes 64 --held 1000000 --rate 2000 2>/dev/null
blocks=$(metric kvroute_relay_snapshot_blocks)
echo
echo "# snapshot with $blocks blocks"
echo -e "answer\tbytes\treq_per_s\trelay_cpu_us_per_req\treq_per_relay_cpu_s"
poll "snapshot ${blocks} blocks" "/kv/snapshot"
stop_relay
echo
echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"
