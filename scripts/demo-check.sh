#!/usr/bin/env bash
# Runs scripts/demo.sh with short settings and checks what a user would see:
# both runs' routing tables with one line per endpoint, the side-by-side
# summary, the "everything stopped" line, and that no process the demo started
# is still alive afterwards (checked by the PIDs it wrote to DEMO_PID_FILE).
# scripts/test.sh runs this; it also runs alone:
#
#   bash scripts/demo-check.sh
#
# Knobs: DEMO_SECONDS (default 3 here), DEMO_PROFILE (default debug here: CI has
# built the debug emulator and load generator already); the ports are picked
# free on 127.0.0.1 unless DEMO_BASE_PORT is set.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
fail() {
  echo "demo-check: $*" >&2
  exit 1
}

work="$(mktemp -d "${TMPDIR:-/tmp}/kvroute-demo-check.XXXXXX")"
out="$work/demo.out"
pid_file="$work/pids"

export DEMO_SECONDS="${DEMO_SECONDS:-3}"
export DEMO_PROFILE="${DEMO_PROFILE:-debug}"
export DEMO_GROUPS="${DEMO_GROUPS:-8}"
export DEMO_PID_FILE="$pid_file"
if [[ -z "${DEMO_BASE_PORT:-}" ]]; then
  # Nine consecutive free ports: 4 servers, 2 listeners, 2 admins, 1 state listener.
  base="$(python3 - <<'PY'
import random, socket
for _ in range(200):
    b = random.randrange(20000, 60000 - 9)
    socks = []
    try:
        for p in range(b, b + 9):
            s = socket.socket(); socks.append(s); s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        for s in socks: s.close()
    print(b); break
else:
    raise SystemExit("demo-check: no 9 consecutive free ports found")
PY
)"
  export DEMO_BASE_PORT="$base" DEMO_LISTEN_PORT="$((base + 4))" DEMO_ADMIN_PORT="$((base + 6))" \
    DEMO_STATE_PORT="$((base + 8))"
fi

echo "demo-check: bash scripts/demo.sh with DEMO_SECONDS=$DEMO_SECONDS DEMO_PROFILE=$DEMO_PROFILE" \
  "DEMO_BASE_PORT=$DEMO_BASE_PORT (output in $out)"
set +e
bash scripts/demo.sh >"$out" 2>&1
rc=$?
set -e
cat "$out"
echo
[[ $rc -eq 0 ]] || fail "the demo exited with code $rc"

# Every PID it started must be gone.
[[ -s "$pid_file" ]] || fail "the demo wrote no PIDs to $pid_file"
alive=()
while read -r pid; do
  if [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null; then alive+=("$pid"); fi
done <"$pid_file"
if [[ ${#alive[@]} -gt 0 ]]; then
  ps -o pid,args -p "$(IFS=,; echo "${alive[*]}")" >&2 || true
  fail "processes the demo started are still alive: ${alive[*]}"
fi
n_pids="$(grep -c . "$pid_file")"
[[ "$n_pids" -eq 5 ]] || fail "expected 5 PIDs (emulator, two Envoys, two load generator runs), the demo wrote $n_pids"

# What it printed.
for run in kvroute round-robin; do
  grep -q "^==> $run: shared-prefix workload" "$out" || fail "no '$run' run in the output"
done
[[ "$(grep -cE '^stage +req +ok' "$out")" -eq 2 ]] || fail "expected 2 routing tables (one per run)"
per_endpoint="$(grep -cE '^ +127\.0\.0\.1:[0-9]+ +requests +[0-9]+ +\( *[0-9.]+%\) +hit% ' "$out" || true)"
[[ "$per_endpoint" -eq 8 ]] || fail "expected 8 per-endpoint lines (4 endpoints x 2 runs), found $per_endpoint"
grep -qE '^prefix-cache hit ratio +[0-9.]+ +[0-9.]+$' "$out" || fail "no prefix-cache hit ratio line with two figures"
grep -qE '^hit-ratio ceiling +[0-9.]+ +[0-9.]+$' "$out" || fail "no hit-ratio ceiling line with two figures"
grep -qE '^share of the ceiling +[0-9]+% +[0-9]+%$' "$out" || fail "no share-of-the-ceiling line"
grep -q '^kvroute / round robin input throughput: ' "$out" || fail "no throughput comparison line"
grep -q '^demo: everything stopped' "$out" || fail "no 'everything stopped' line"
# Both runs got answers: the "ok" column of each table's stage line (the stage
# name has spaces, so counted from the end: ok is the 9th field from the last).
oks="$(awk '/^stage +req +ok/ { getline; print $(NF - 8) }' "$out" | tr '\n' ' ')"
for ok in $oks; do
  [[ "$ok" =~ ^[0-9]+$ && "$ok" -gt 0 ]] || fail "a run answered no request (ok column: $oks)"
done
echo "demo-check: OK (2 routing tables with ok = $oks, 8 per-endpoint lines, summary, $n_pids PIDs all stopped)"
rm -rf "$work"
