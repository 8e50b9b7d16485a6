#!/usr/bin/env bash
# Fuzz smoke: builds kvroute's fuzz targets and runs each briefly over its
# seeds. Exits non-zero if any target crashes (a panic, a failed invariant,
# over 512 MB RSS, or one input taking over 10 s). The one command CI calls:
#
#   bash fuzz/smoke.sh                          # 10 s per target
#   KVROUTE_FUZZ_SECONDS=600 bash fuzz/smoke.sh  # a real run (see docs/benchmarks.md)
#
# Builds with plain cargo and the exact flags `cargo fuzz build -s none`
# uses (coverage instrumentation, --cfg fuzzing, debug assertions), so a
# fresh machine needs no cargo-fuzz and no nightly toolchain: only a C++
# compiler for libFuzzer (installed with apt-get if missing).
#
# Seeds: testdata/requests/ (parse_request, without crash-* files),
# fuzz/seeds/config/, fuzz/seeds/engine/. New inputs go to a scratch
# folder; a crashing input is saved under fuzz/artifacts/TARGET/.
# testdata/requests/crash-* bodies reproduce open core bugs: they are left
# out of the seeds, replayed at the end and reported, but do not fail the
# smoke. Fixed bugs' reproductions live on as seeds (e.g.
# fuzz/seeds/engine/regression-nan-queue-score.bin).
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
echo "==> building fuzz targets ($host)"
cargo build --release --quiet --manifest-path "$fuzz_dir/Cargo.toml" --target "$host" --bins
bin=$CARGO_TARGET_DIR/$host/release
echo "    built in $(( $(date +%s) - started ))s"

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/seeds-parse_request"
for f in ../testdata/requests/*; do
  case "$(basename "$f")" in crash-*|*.py|*.md) ;; *) cp "$f" "$scratch/seeds-parse_request/" ;; esac
done

failed=()
run() { # TARGET SEEDS DICT MAX_LEN
  local target=$1 seeds=$2 dict=$3 max_len=$4
  mkdir -p "$scratch/$target" "$fuzz_dir/artifacts/$target"
  echo "==> $target: ${seconds}s"
  if "$bin/$target" "$scratch/$target" "$seeds" -max_total_time="$seconds" \
      -rss_limit_mb=512 -timeout=10 -max_len="$max_len" ${dict:+-dict="$dict"} \
      -artifact_prefix="$fuzz_dir/artifacts/$target/" -print_final_stats=1 \
      >"$scratch/$target.log" 2>&1; then
    grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb)' "$scratch/$target.log" | sed 's/^/    /'
  else
    echo "    CRASH in $target; libFuzzer's output:"
    grep -vE '^#[0-9]+' "$scratch/$target.log" | tail -40 | sed 's/^/    /'
    failed+=("$target")
  fi
}
run parse_request "$scratch/seeds-parse_request" "$fuzz_dir/dicts/request.dict" 65536
run config "$fuzz_dir/seeds/config" "$fuzz_dir/dicts/config.dict" 16384
run engine "$fuzz_dir/seeds/engine" "" 4096

shopt -s nullglob
known=(../testdata/requests/crash-*)
if [[ ${#known[@]} -gt 0 ]]; then
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
echo "fuzz-smoke: $(( 3 - ${#failed[@]} )) passed, ${#failed[@]} failed"
[[ ${#failed[@]} -eq 0 ]]
