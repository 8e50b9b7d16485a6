#!/usr/bin/env bash
# Fuzz smoke: builds kvroute's fuzz targets and runs each briefly over its
# seeds. Exits non-zero if any target crashes (a panic, a failed invariant,
# over 512 MB RSS, or one input taking over 10 s). The one command CI calls:
#
#   bash fuzz/smoke.sh                               # every target, 10 s each
#   bash fuzz/smoke.sh config relay_frames           # only these targets
#   KVROUTE_FUZZ_SECONDS=600 bash fuzz/smoke.sh config  # a real run (see docs/benchmarks.md)
#
# Targets (what each checks: fuzz/src/lib.rs):
#   parse_request   request bodies        seeds: testdata/requests/ (without crash-*)
#   parse_differential  the same, against the frozen reference parser  seeds: as parse_request
#   config          plugin configs        seeds: fuzz/seeds/config/
#   engine          engine programs       seeds: fuzz/seeds/engine/
#   vllm_metrics    vLLM /metrics text    seeds: fuzz/seeds/vllm_metrics/ (real vLLM 0.32 captures)
#   kv_events       relay /kv/* answers   seeds: fuzz/seeds/kv_events/
#   envoy_clusters  admin /clusters JSON  seeds: fuzz/seeds/envoy_clusters/
#   relay_frames    vLLM ZMQ KV frames    seeds: fuzz/seeds/relay_frames/ (the real capture)
#   relay_mesh      relay /mesh/exchange bodies, against a model  seeds: fuzz/seeds/relay_mesh/
#   mesh_answer     relay answers to the collector's mesh posts    seeds: fuzz/seeds/mesh_answer/
#   offpath         precise off-path codecs, cutter, lookup, jobs  seeds: fuzz/seeds/offpath/
# The four before relay_mesh are what the collector and the relay parse from servers,
# relays and Envoy, each driven through the real path into shared data.
#
# Builds with plain cargo and the exact flags `cargo fuzz build -s none`
# uses (coverage instrumentation, --cfg fuzzing, debug assertions), so a
# fresh machine needs no cargo-fuzz and no nightly toolchain: only a C++
# compiler for libFuzzer (installed with apt-get if missing). Only the
# chosen targets are built. The seven targets before parse_differential,
# at 10 s each, took 81 s with a warm build on 2026-12-06 (2 cores,
# loaded); a cold build adds minutes.
#
# New inputs go to a scratch folder; a crashing input is saved under
# fuzz/artifacts/TARGET/. testdata/requests/crash-* bodies reproduce open
# core bugs: they are left out of the seeds, replayed at the end (when
# parse_request runs) and reported, but do not fail the smoke. Fixed bugs'
# reproductions live on as seeds (e.g. fuzz/seeds/engine/regression-nan-queue-score.bin,
# fuzz/seeds/config/regression-inline-tokenizer-alloc.json).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
fuzz_dir=$PWD
seconds=${KVROUTE_FUZZ_SECONDS:-10}
started=$(date +%s)

command -v cargo >/dev/null || { echo "smoke.sh: cargo not found: install Rust first" >&2; exit 1; }
if ! command -v c++ >/dev/null; then
  echo "smoke.sh: installing a C++ compiler for libFuzzer (apt-get install g++)"
  apt-get update -qq && apt-get install -y -qq g++ >/dev/null
fi

host=$(rustc -vV | sed -n 's/^host: //p')
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$fuzz_dir/target}
# What cargo-fuzz 0.13 passes for `-s none` (its default build also has debug
# assertions). --target keeps the flags off build scripts and proc macros.
export CARGO_PROFILE_RELEASE_DEBUG=line-tables-only
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions \
-Cllvm-args=-simplifycfg-branch-fold-threshold=0 -Cllvm-args=-sanitizer-coverage-stack-depth"
all=(parse_request parse_differential config engine vllm_metrics kv_events envoy_clusters relay_frames relay_mesh mesh_answer offpath)
targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=("${all[@]}")
bins=()
for t in "${targets[@]}"; do
  [[ " ${all[*]} " == *" $t "* ]] || { echo "smoke.sh: no target $t (targets: ${all[*]})" >&2; exit 2; }
  bins+=(--bin "$t")
done
echo "==> building fuzz targets ($host): ${targets[*]}"
cargo build --release --quiet --manifest-path "$fuzz_dir/Cargo.toml" --target "$host" "${bins[@]}"
bin=$CARGO_TARGET_DIR/$host/release
echo "    built in $(( $(date +%s) - started ))s"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/seeds-parse_request"
for f in ../testdata/requests/*; do
  case "$(basename "$f")" in crash-*|*.py|*.md) ;; *) cp "$f" "$scratch/seeds-parse_request/" ;; esac
done

failed=()
ran=0
run() { # TARGET SEEDS DICT MAX_LEN
  local target=$1 seeds=$2 dict=$3 max_len=$4
  [[ " ${targets[*]} " == *" $target "* ]] || return 0
  ran=$((ran + 1))
  mkdir -p "$scratch/$target" "$fuzz_dir/artifacts/$target"
  echo "==> $target: ${seconds}s"
  if "$bin/$target" "$scratch/$target" "$seeds" -max_total_time="$seconds" \
      -rss_limit_mb=512 -timeout=10 -max_len="$max_len" ${dict:+-dict="$dict"} \
      -artifact_prefix="$fuzz_dir/artifacts/$target/" -print_final_stats=1 \
      >"$scratch/$target.log" 2>&1; then
    grep -E '^stat::(number_of_executed_units|peak_rss_mb)' "$scratch/$target.log" | sed 's/^/    /'
  else
    echo "    CRASH in $target; libFuzzer's output:"
    grep -vE '^#[0-9]+' "$scratch/$target.log" | tail -40 | sed 's/^/    /'
    failed+=("$target")
  fi
}
run parse_request "$scratch/seeds-parse_request" "$fuzz_dir/dicts/request.dict" 65536
run parse_differential "$scratch/seeds-parse_request" "$fuzz_dir/dicts/request.dict" 65536
run config "$fuzz_dir/seeds/config" "$fuzz_dir/dicts/config.dict" 16384
run engine "$fuzz_dir/seeds/engine" "" 4096
# Real /metrics and the ZMQ capture are 40-52 KB; relay answers and admin
# JSON are small.
run vllm_metrics "$fuzz_dir/seeds/vllm_metrics" "$fuzz_dir/dicts/vllm_metrics.dict" 65536
run kv_events "$fuzz_dir/seeds/kv_events" "$fuzz_dir/dicts/kv_events.dict" 8192
run envoy_clusters "$fuzz_dir/seeds/envoy_clusters" "$fuzz_dir/dicts/envoy_clusters.dict" 16384
run relay_frames "$fuzz_dir/seeds/relay_frames" "$fuzz_dir/dicts/relay_frames.dict" 65536
run relay_mesh "$fuzz_dir/seeds/relay_mesh" "$fuzz_dir/dicts/relay_mesh.dict" 16384
run mesh_answer "$fuzz_dir/seeds/mesh_answer" "$fuzz_dir/dicts/mesh_answer.dict" 16384
# Shared data and the tokenize queue hold a turn's few KB.
run offpath "$fuzz_dir/seeds/offpath" "$fuzz_dir/dicts/offpath.dict" 4096

shopt -s nullglob
known=(../testdata/requests/crash-*)
if [[ ${#known[@]} -gt 0 && " ${targets[*]} " == *" parse_request "* ]]; then
  echo "==> open core bugs (testdata/requests/crash-*; reported, not failing the smoke)"
  for f in "${known[@]}"; do
    if "$bin/parse_request" -rss_limit_mb=512 -timeout=10 "$f" >"$scratch/known.log" 2>&1; then
      echo "    $f: no longer crashes (fixed? then rename it without crash-)"
    else
      echo "    $f: still crashes: $(grep -m1 -E 'panicked|ERROR' "$scratch/known.log" || true)"
    fi
  done
fi

echo "fuzz smoke took $(( $(date +%s) - started ))s"
echo "fuzz-smoke: $(( ran - ${#failed[@]} )) passed, ${#failed[@]} failed${failed[*]:+: ${failed[*]}}"
[[ ${#failed[@]} -eq 0 ]]
