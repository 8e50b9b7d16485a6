#!/usr/bin/env bash
# Validates istio/ (python3 istio/check.py): every manifest against Istio's CRD
# schemas, the names the manifests share with each other and with
# envoy/render.py, the OCI image builder, and, when Envoy and the release
# module are there, the equivalent bootstraps (envoy --mode validate, then a
# real start with the filter over ECDS). The routed end-to-end request is
# tests/e2e/test_istio_ecds.py (pytest), not this script.
#
#   bash scripts/istio-check.sh              # schemas from testdata/istio (a copy of ../shared/istio's)
#   KVROUTE_ISTIO_SCHEMAS=DIR bash scripts/istio-check.sh
#   bash scripts/istio-check.sh --no-envoy   # manifests only
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
if ! python3 -c 'import yaml, jsonschema' 2>/dev/null; then
  python3 -m pip install --quiet pyyaml jsonschema 2>/dev/null \
    || python3 -m pip install --quiet --user pyyaml jsonschema 2>/dev/null \
    || python3 -m pip install --quiet --break-system-packages pyyaml jsonschema
fi
exec python3 istio/check.py "$@"
