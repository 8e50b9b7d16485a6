"""The bootstraps envoy/render.py writes are accepted by Envoy 1.40 as they
are (envoy --mode validate compiles the module too)."""

import json
import os
import subprocess

from conftest import REPO, render


def _validate(tmp_path, text):
    path = tmp_path / "bootstrap.yaml"
    path.write_text(text)
    p = subprocess.run(["envoy", "--mode", "validate", "-c", str(path), "-l", "error"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]


def test_static_bootstrap_validates(artifacts, tmp_path):
    text = render.render(endpoints=["127.0.0.1:18001", "127.0.0.1:18002"], wasm=artifacts["wasm"])
    assert "allow_on_headers_stop_iteration: true" in text
    assert "envoy.load_balancing_policies.override_host" in text
    assert text.count("per_connection_buffer_limit_bytes: 8388608") == 2
    _validate(tmp_path, text)


def test_eds_bootstrap_validates(artifacts, tmp_path):
    eds = tmp_path / "eds" / "vllm.json"
    render.write_eds_file(str(eds), ["127.0.0.1:18001"], 1)
    text = render.render(eds_file=str(eds), wasm=artifacts["wasm"])
    assert '"fromCluster"' in text
    _validate(tmp_path, text)


def test_state_listener_bootstrap_validates(artifacts, tmp_path):
    text = render.render(endpoints=["127.0.0.1:18001"], wasm=artifacts["wasm"], state_listener="127.0.0.1:9902")
    # The client listener's filter keeps the shipped config (no state path); the
    # internal one gets routing.statePath, and no route to the model servers.
    assert text.count('"statePath": "/kvroute/state"') == 1
    assert '"debugHeader"' not in text
    listener = text[text.index("- name: kvroute_state"):text.index("  clusters:")]
    assert "cluster: vllm" not in listener and "port_value: 9902" in listener
    _validate(tmp_path, text)


def test_default_plugin_config_is_valid_json_with_llm_d_sections():
    with open(os.path.join(REPO, "envoy", "kvroute-config.json")) as f:
        cfg = json.load(f)
    assert {p["type"] for p in cfg["plugins"]} >= {"prefix-cache-affinity-filter", "kvroute-load-scorer",
                                                  "cache-balance-scorer"}
    assert cfg["schedulingProfiles"][0]["name"] == "kvroute-default"
    assert cfg["schedulingProfiles"][0]["plugins"]


def test_baseline_bootstrap_has_no_wasm_and_validates(tmp_path):
    text = render.render(endpoints=["127.0.0.1:18001"], baseline=True)
    assert "wasm" not in text
    _validate(tmp_path, text)
