"""Fixtures for the real-engine tier: two real vLLM 0.32 servers (CPU build,
tiny random-weight model; see tests/real/README.md), Envoy + kvroute in
front of them, and ZMQ subscribers to their KV events.

The servers are started once per session and stopped at its end, by their
process-group ids, also when a test fails and on SIGTERM/SIGINT. Envoy and
the emulator come from tests/e2e/conftest.py (loaded under another module
name), so they start exactly as in the e2e tests.

Environment:
  KVROUTE_VLLM_CACHE     the venv/model cache (default ~/.cache/kvroute/vllm-0.32)
  KVROUTE_REAL_PIDFILE   also list the started servers here (scripts/real-vllm.sh test
                         uses it to stop them even if pytest is killed)
  KVROUTE_E2E_NO_BUILD   as in tests/e2e: 1 = use the built module and emulator
"""

import atexit
import base64
import importlib.util
import json
import os
import shutil
import signal
import tempfile
import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
import vllm_tier  # noqa: E402

_spec = importlib.util.spec_from_file_location("kvroute_e2e_conftest", REPO / "tests" / "e2e" / "conftest.py")
e2e = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(e2e)

# The e2e fixtures, as they are: Envoy through envoy/run.sh, the emulator.
artifacts = e2e.artifacts
envoy = e2e.envoy
fleet = e2e.fleet

MODEL = vllm_tier.SERVED_MODEL
BLOCK_SIZE = vllm_tier.BLOCK_SIZE
NUM_BLOCKS = 256

# ---------------------------------------------------------------- cleanup on signals

_LIVE = []  # objects with .stop(), stopped on SIGTERM/SIGINT/exit


def _stop_all():
    while _LIVE:
        obj = _LIVE.pop()
        try:
            obj.stop()
        except Exception as ex:  # noqa: BLE001
            print(f"[real] stop failed: {ex}", file=sys.stderr)


def _on_signal(signum, frame):
    _stop_all()
    raise KeyboardInterrupt(f"signal {signum}")


atexit.register(_stop_all)
signal.signal(signal.SIGTERM, _on_signal)


# ---------------------------------------------------------------- ZMQ subscriber


class EventSink:
    """A SUB socket that keeps every message as its raw frames, in order.
    EventSink(port) binds on 127.0.0.1:port (vLLM's PUB, given a concrete
    address, connects to it); EventSink(connect="tcp://...") connects to a
    PUB that binds (the emulator's)."""

    def __init__(self, port=None, connect=None):
        import zmq

        self.port = port
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.setsockopt(zmq.RCVTIMEO, 200)
        self.sock.setsockopt(zmq.LINGER, 0)
        if connect:
            self.sock.connect(connect)
        else:
            self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.messages = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import zmq

        while not self._stop.is_set():
            try:
                frames = self.sock.recv_multipart()
            except zmq.Again:
                continue
            except zmq.ZMQError:
                break
            with self._lock:
                self.messages.append(frames)

    def snapshot(self):
        with self._lock:
            return list(self.messages)

    def wait_count(self, n, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.messages) >= n:
                return True
            time.sleep(0.05)
        return False

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close(0)
        self.ctx.term()


RELAY = Path(os.environ.get("CARGO_TARGET_DIR") or REPO / "target") / "debug" / "kvroute-relay"


class RelayProcess:
    """kvroute-relay (target/debug, built by scripts/real-vllm.sh test)
    subscribed to one server's events, serving HTTP on 127.0.0.1:port. Not
    started (proc None) when the binary is missing; test_kv_events.py then
    fails with that reason."""

    def __init__(self, endpoint, topic, port, log_path):
        import subprocess

        self.endpoint = endpoint
        self.address = f"127.0.0.1:{port}"
        self.log_path = log_path
        self.proc = None
        if not RELAY.exists():
            return
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [str(RELAY), "--sub", endpoint, "--topic", topic, "--listen", self.address,
             "--max-blocks", str(NUM_BLOCKS)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.proc is not None:
            self._log.close()


def write_frames_jsonl(path, messages):
    """The capture format of ../shared/vllm: one message per line,
    {"frames_b64": [topic, seq, payload]}."""
    with open(path, "w") as f:
        for frames in messages:
            f.write(json.dumps({"frames_b64": [base64.b64encode(x).decode() for x in frames]}) + "\n")


# ---------------------------------------------------------------- the real fleet


@pytest.fixture(scope="session")
def real_fleet(tmp_path_factory):
    """Two real vLLM servers (256 blocks of 32 tokens each, prefix caching,
    KV events to an EventSink per server). .sinks[i] holds server i's events."""
    try:
        vllm_tier.ensure_setup()
    except Exception as ex:  # noqa: BLE001
        pytest.skip(f"the real-vLLM venv cannot be built here ({ex}); see tests/real/README.md")
    log_dir = tmp_path_factory.mktemp("vllm")
    ports = vllm_tier.free_ports(4)
    # vLLM binds its PUB on a local socket file (nothing on the network);
    # the sink and the KV-event relay (test_kv_events.py) both connect, from
    # before the first event, so both see every batch from seq 0.
    ipc_dir = tempfile.mkdtemp(prefix="kvr-ev-")
    endpoints = [f"ipc://{ipc_dir}/vllm{i}.sock" for i in range(2)]
    sinks = []
    for ep in endpoints:
        s = EventSink(connect=ep)
        sinks.append(s)
        _LIVE.append(s)
    relays = []
    for i, ep in enumerate(endpoints):
        r = RelayProcess(ep, f"kv@real{i}", ports[2 + i], log_dir / f"relay{i}.log")
        if r.proc is not None:
            relays.append(r)
            _LIVE.append(r)
    f = vllm_tier.Fleet(2, log_dir=log_dir, blocks=NUM_BLOCKS, ports=ports[:2], event_ports=endpoints,
                        pidfile=os.environ.get("KVROUTE_REAL_PIDFILE"))
    _LIVE.append(f)
    t0 = time.monotonic()
    f.start(timeout=900)
    f.startup_seconds = time.monotonic() - t0
    print(f"\n[real] 2 vLLM servers healthy in {f.startup_seconds:.0f} s: {f.addresses}; logs in {log_dir}")
    f.sinks = sinks
    f.relays = relays
    f.event_endpoints = endpoints
    f.log_dir = log_dir
    try:
        yield f
    finally:
        f.stop()
        for s in sinks + relays:
            s.stop()
        shutil.rmtree(ipc_dir, ignore_errors=True)
        for obj in [f] + sinks + relays:
            if obj in _LIVE:
                _LIVE.remove(obj)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, attach the tails of the vLLM logs to the report."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and "real_fleet" in getattr(item, "fixturenames", ()):
        f = item.funcargs.get("real_fleet")
        if f is not None:
            for s in f.servers:
                rep.sections.append((f"vllm #{s.index} log tail ({s.log_path})", s.log_tail(6000)))


# ---------------------------------------------------------------- helpers


def real_plugin_config():
    """The e2e tests' config (state path and decision header on) with the
    collector polling the real servers through the vllm cluster. A loaded
    2-core machine can take a while to answer /metrics: generous timeout."""
    cfg = e2e.plugin_config(collector={"metricsCluster": "vllm", "metricsPollIntervalMs": 500,
                                       "metricsTimeoutMs": 3000, "metricsStaleAfterMs": 10000})
    for p in cfg["plugins"]:
        if p["type"] == "approx-prefix-cache-producer":
            p.setdefault("parameters", {})["blockSizeTokens"] = BLOCK_SIZE
    return cfg


def precise_plugins(real_fleet, tokenize_in=None):
    """A `token-producer` with this tier's tokenizer.json and
    tokenizer_config.json inline, and a `precise-prefix-cache-producer` with
    the servers' block size and PYTHONHASHSEED: precise mode as the servers
    hash."""
    md = vllm_tier.model_dir()
    seed = real_fleet.servers[0].env()["PYTHONHASHSEED"]
    return [
        {"type": "token-producer", "parameters": {
            "modelName": str(md), "servedModelNames": [MODEL],
            "tokenizerJson": json.loads((md / "tokenizer.json").read_text()),
            "tokenizerConfig": json.loads((md / "tokenizer_config.json").read_text()),
            **({"tokenizeIn": tokenize_in} if tokenize_in else {})}},
        {"type": "precise-prefix-cache-producer", "parameters": {
            "tokenProcessorConfig": {"blockSizeTokens": BLOCK_SIZE, "hashSeed": seed}}},
    ]


def scrape(address):
    """(wall time, {sample name: summed value}, cache_config_info labels) of one /metrics read."""
    t = time.time()
    r = e2e.request(int(address.rsplit(":", 1)[1]), "GET", "/metrics", timeout=20)
    assert r.status == 200, r
    values, labels = parse_prometheus(r.body.decode())
    return t, values, labels


def parse_prometheus(body):
    """{metric name: value summed over label sets} for samples, and the labels
    of vllm:cache_config_info. Stdlib only (the Rust parser is checked by
    the parity test)."""
    import re

    values = {}
    labels = {}
    for line in body.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)", line)
        if not m:
            continue
        name, lab, value = m.group(1), m.group(2) or "", m.group(3)
        values[name] = values.get(name, 0.0) + float(value)
        if name == "vllm:cache_config_info":
            labels.update(dict(re.findall(r'(\w+)="([^"]*)"', lab)))
    return values, labels


_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which "
          "but have an they you were her she there been one all we their has would when if so no will "
          "kv cache prefix block token route server request prompt engine envoy filter wasm vllm model "
          "decode prefill endpoint metric event hash score load queue running waiting usage shared").split()


def words(seed, n):
    """n deterministic pseudo-random words (about one token each with the tier's tokenizer)."""
    import random

    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def completion(port, prompt, max_tokens=2, timeout=120, **extra):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body.update(extra)
    r = e2e.post(port, "/v1/completions", body, timeout=timeout)
    assert r.status == 200, r
    return r
