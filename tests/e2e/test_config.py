"""A plugin config the module refuses, in real Envoy.

docs/configuration.md promises strict validation: a bad value rejects the
whole document at configure time, Envoy refuses the filter, and the log names
the field. The bootstraps here are static, so a refused filter config stops
Envoy at start-up (it never reports LIVE) with the module's reason in its log.

The smaller module (built with `--no-default-features`, no `tokenizer`
feature) must refuse a config that gives a `tokenizerJson`, with its reason,
where the default module serves the same config.
"""

import json
import os

import pytest

from conftest import REPO, no_tokenizer_wasm, plugin_config

UPSTREAM = ["127.0.0.1:9"]  # never contacted: these Envoys only start (or not)


def with_tokenizer():
    """The shipped profile plus llm-d's precise producer, with the model's tokenizer inline."""
    path = os.path.join(REPO, "testdata", "tokenizer", "tiny-bpe-4096", "tokenizer.json")
    with open(path) as f:
        tokenizer_json = json.load(f)
    cfg = plugin_config()
    cfg["plugins"][:0] = [
        {"type": "token-producer", "parameters": {"modelName": "m", "tokenizerJson": tokenizer_json}},
        {"type": "precise-prefix-cache-producer",
         "parameters": {"tokenProcessorConfig": {"blockSizeTokens": 16, "hashSeed": "0"}}},
    ]
    cfg["kvEvents"] = {"enabled": True}
    return cfg


def refused(envoy, config, wasm):
    """Start Envoy with `config` on module `wasm`; return its log, failing if it went LIVE."""
    with pytest.raises(AssertionError) as err:
        envoy(config, endpoints=UPSTREAM, wasm=wasm)
    return str(err.value)


def test_an_out_of_range_value_stops_envoy_and_the_log_names_the_field(envoy, artifacts):
    e = envoy(plugin_config(affinity={"affinityThreshold": 0.9}), endpoints=UPSTREAM)  # control: an in-range value serves
    e.assert_alive()
    log = refused(envoy, plugin_config(affinity={"affinityThreshold": 1.5}), artifacts["wasm"])
    assert "Envoy exited" in log, log
    assert "invalid kvroute config at `plugins[" in log and "].parameters.affinityThreshold`" in log, log
    assert "out of range" in log, log


def test_the_module_without_the_tokenizer_feature_refuses_a_tokenizer_config(envoy, artifacts):
    lean = no_tokenizer_wasm(artifacts)
    e = envoy(with_tokenizer(), endpoints=UPSTREAM)  # the default module serves it
    e.assert_alive()
    log = refused(envoy, with_tokenizer(), lean)
    assert "Envoy exited" in log, log
    assert "built without the `tokenizer` feature" in log, log
    # and the same module serves the shipped config
    envoy(plugin_config(), endpoints=UPSTREAM, wasm=lean).assert_alive()
