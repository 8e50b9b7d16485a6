#!/usr/bin/env bash
# Instructions per request (valgrind --tool=callgrind), for every stage and
# case of the route bench: noise-free figures for docs/benchmarks.md.
#
#   bash filter/core/benches/callgrind.sh          # all cases (~3 min on 2 cores)
#   bash filter/core/benches/callgrind.sh route    # only the stages named
#
# Each figure is (Ir with N requests − Ir with 0 requests) / N, counted only
# inside `measured_requests` (route_callgrind.rs), so setup and the one-off
# preparation cancel out. Needs valgrind (apt-get install valgrind).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."

command -v valgrind >/dev/null || { apt-get update -qq && apt-get install -y -qq valgrind >/dev/null; }
stages=("$@")
[[ ${#stages[@]} -gt 0 ]] || stages=(parse hash state decide route)

exe=$(cargo bench -p kvroute-core --bench route_callgrind --no-run 2>&1 |
  sed -n 's/.*Executable .*(\(.*route_callgrind-[0-9a-f]*\)).*/\1/p' | tail -1)
[[ -x "$exe" ]] || { echo "callgrind.sh: could not build the route_callgrind bench" >&2; exit 1; }

# Ir collected in measured_requests for: STAGE KIB ENDPOINTS N
ir() {
  valgrind --tool=callgrind --collect-atstart=no --toggle-collect='*measured_requests*' \
    --callgrind-out-file=/dev/null "$exe" "$@" 2>&1 >/dev/null |
    sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}

echo "| stage | body KiB | endpoints | instructions per request | per body byte |"
echo "|---|---:|---:|---:|---:|"
for stage in "${stages[@]}"; do
  endpoint_counts=(8 64)
  [[ $stage == parse || $stage == hash ]] && endpoint_counts=(8)
  n=10
  [[ $stage == decide || $stage == state ]] && n=100
  for kib in 8 64 400; do
    for eps in "${endpoint_counts[@]}"; do
      base=$(ir "$stage" "$kib" "$eps" 0)
      full=$(ir "$stage" "$kib" "$eps" "$n")
      per=$(( (full - base) / n ))
      printf '| %s | %s | %s | %s | %s |\n' "$stage" "$kib" "$eps" "$per" \
        "$(awk -v a="$per" -v b="$((kib * 1024))" 'BEGIN { printf "%.2f", a / b }')"
    done
  done
done
