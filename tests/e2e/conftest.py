"""Fixtures for the real-Envoy end-to-end tests.

Every process a test needs is started here and stopped in a finalizer, by
PID: the emulated vLLM fleet (`kvroute-emulator` from sim/) and Envoy with the
built kvroute module (started through envoy/run.sh, which execs Envoy, so the
PID is Envoy's). Everything listens on 127.0.0.1. Ports come from the kernel
(bind to port 0), and every Envoy runs with --use-dynamic-base-id, so tests and
other Envoys on the machine never collide.

Only the standard library and pytest are used.

Environment:
  KVROUTE_E2E_NO_BUILD=1   do not run cargo before the tests (use what is built)
  CARGO_TARGET_DIR         where cargo puts binaries (default: <repo>/target)
  KVROUTE_WASM             path of kvroute_wasm.wasm (default: the release build)
  KVROUTE_WASM_NO_TOKENIZER  the module built without the `tokenizer` feature (default: the
                           release build with --no-default-features in <target>/no-tokenizer)
  KVROUTE_EMULATOR         path of kvroute-emulator (default: the debug build)
"""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "envoy"))
import render  # noqa: E402  (envoy/render.py: the same generator users run)

TARGET_DIR = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
if not os.path.isabs(TARGET_DIR):
    TARGET_DIR = os.path.join(REPO, TARGET_DIR)
WASM = os.environ.get("KVROUTE_WASM") or os.path.join(TARGET_DIR, "wasm32-wasip1", "release", "kvroute_wasm.wasm")
# The smaller module (--no-default-features), in a target dir of its own so that it
# never replaces the default module's file.
WASM_NO_TOKENIZER = os.environ.get("KVROUTE_WASM_NO_TOKENIZER") or os.path.join(
    TARGET_DIR, "no-tokenizer", "wasm32-wasip1", "release", "kvroute_wasm.wasm")
EMULATOR = os.environ.get("KVROUTE_EMULATOR") or os.path.join(TARGET_DIR, "debug", "kvroute-emulator")

DEST_HEADER = "x-gateway-destination-endpoint"
SERVED_BY = "x-kvroute-served-by"
DECISION = "x-kvroute-decision"
STATE_PATH = "/kvroute/state"
MODEL = "kvroute-e2e"

# The shipped plugin config (what render.py uses when given none). It serves
# no state and adds no decision header on the client listener.
with open(os.path.join(REPO, "envoy", "kvroute-config.json")) as _f:
    SHIPPED_PLUGIN_CONFIG = json.load(_f)
# The tests read the decision header and the state on the client listener, so
# their base config turns both on explicitly.
BASE_PLUGIN_CONFIG = json.loads(json.dumps(SHIPPED_PLUGIN_CONFIG))
BASE_PLUGIN_CONFIG.setdefault("routing", {}).update({"debugHeader": True, "statePath": STATE_PATH})


# --------------------------------------------------------------------------
# build


def _run_cargo(args):
    cmd = ["cargo"] + args
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"`{' '.join(cmd)}` failed:\n{proc.stderr[-4000:]}", pytrace=False)


@pytest.fixture(scope="session")
def artifacts():
    """The built module and emulator. Builds them unless KVROUTE_E2E_NO_BUILD=1."""
    if os.environ.get("KVROUTE_E2E_NO_BUILD") != "1":
        if "KVROUTE_WASM" not in os.environ:
            _run_cargo(["build", "--release", "--target", "wasm32-wasip1", "-p", "kvroute-wasm"])
        if "KVROUTE_WASM_NO_TOKENIZER" not in os.environ:
            _run_cargo(["build", "--release", "--target", "wasm32-wasip1", "-p", "kvroute-wasm",
                        "--no-default-features", "--target-dir", os.path.join(TARGET_DIR, "no-tokenizer")])
        if "KVROUTE_EMULATOR" not in os.environ:
            _run_cargo(["build", "--bin", "kvroute-emulator"])
    for path in (WASM, EMULATOR):
        if not os.path.exists(path):
            pytest.fail(f"{path} is missing; build it first (see scripts/test.sh)", pytrace=False)
    return {"wasm": WASM, "wasm_no_tokenizer": WASM_NO_TOKENIZER, "emulator": EMULATOR}


def no_tokenizer_wasm(artifacts):
    """The module built without the `tokenizer` feature; fails the test when it is missing."""
    path = artifacts["wasm_no_tokenizer"]
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing; build it with cargo build --release --target wasm32-wasip1 "
                    "-p kvroute-wasm --no-default-features --target-dir target/no-tokenizer", pytrace=False)
    return path


# --------------------------------------------------------------------------
# processes


def free_ports(n):
    """n distinct free TCP ports on 127.0.0.1 (held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class Process:
    """A child process with its output in a log file; stopped by PID."""

    def __init__(self, name, cmd, log_path, env=None):
        self.name = name
        self.cmd = cmd
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=REPO
        )
        self.pid = self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def log_text(self, tail=6000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-tail:]
        except OSError:
            return ""

    def wait_for_log(self, needle, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.log_text(tail=10**7)
            if needle in text:
                return text
            if not self.alive():
                break
            time.sleep(0.05)
        raise AssertionError(
            f"{self.name} did not print {needle!r} within {timeout}s "
            f"(exit code {self.proc.poll()}); log tail:\n{self.log_text()}"
        )

    def stop(self):
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, signal.SIGTERM)
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        self._log.close()


# --------------------------------------------------------------------------
# HTTP (stdlib only)


class Response:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers  # lower-cased names
        self.body = body

    @property
    def served_by(self):
        return self.headers.get(SERVED_BY)

    @property
    def decision(self):
        """The x-kvroute-decision header as a dict (branch=..., endpoint=...)."""
        raw = self.headers.get(DECISION)
        if raw is None:
            return None
        out = {}
        for part in raw.split(";"):
            k, _, v = part.strip().partition("=")
            if k:
                out[k] = v
        return out

    def json(self):
        return json.loads(self.body)

    def __repr__(self):
        return f"<Response {self.status} served_by={self.served_by} decision={self.headers.get(DECISION)} body={self.body[:200]!r}>"


def request(port, method, path, body=None, headers=None, timeout=30):
    """One request on a fresh connection; returns the whole response."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        hdrs = dict(headers or {})
        if isinstance(body, (dict, list)):
            body = json.dumps(body).encode()
            hdrs.setdefault("content-type", "application/json")
        elif isinstance(body, str):
            body = body.encode()
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, data)
    finally:
        conn.close()


def post(port, path, body, headers=None, timeout=30):
    return request(port, "POST", path, body, headers, timeout)


def completion(port, prompt, max_tokens=4, stream=False, headers=None, timeout=30, model=MODEL):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    return post(port, "/v1/completions", body, headers, timeout)


def chat(port, messages, max_tokens=4, stream=False, headers=None, timeout=30, model=MODEL):
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": stream}
    return post(port, "/v1/chat/completions", body, headers, timeout)


def in_background(fn, *args, **kwargs):
    """Run fn in a thread; returns (thread, result-list). Exceptions are kept."""
    result = []

    def run():
        try:
            result.append(fn(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - handed back to the test
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def wait_until(predicate, timeout, interval=0.1, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


# --------------------------------------------------------------------------
# prompts

_VOCAB = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega router cache block "
    "token prefix endpoint envoy filter request stream model server fleet tenant agent code "
    "review function return value error handle parse config deploy cluster policy score"
).split()


def text(seed, n_chars):
    """Deterministic pseudo-random words, exactly n_chars bytes long."""
    rng = random.Random(seed)
    out = []
    size = 0
    while size < n_chars:
        w = rng.choice(_VOCAB)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


# --------------------------------------------------------------------------
# the emulated fleet


class Fleet:
    def __init__(self, process, ports):
        self.process = process
        self.ports = ports
        self.addresses = [f"127.0.0.1:{p}" for p in ports]

    def port_of(self, address):
        return int(address.rsplit(":", 1)[1])

    def reset(self):
        for p in self.ports:
            r = post(p, "/emulator/reset", b"")
            assert r.status < 300, r

    def metrics_mode(self, address, mode):
        r = post(self.port_of(address), "/emulator/metrics-mode", mode.encode(), {"content-type": "text/plain"})
        assert r.status < 300, r

    def stats(self, address):
        r = request(self.port_of(address), "GET", "/emulator/stats")
        assert r.status == 200, r
        return r.json()

    def metrics_text(self, address):
        r = request(self.port_of(address), "GET", "/metrics", timeout=5)
        assert r.status == 200, r
        return r.body.decode()


@pytest.fixture
def fleet(artifacts, tmp_path, request):
    """Factory: fleet(n, *extra_args) -> Fleet, stopped after the test."""
    started = []

    def start(n=2, *extra):
        ports = free_ports(n)
        cmd = [artifacts["emulator"], "--ports", ",".join(map(str, ports)), "--model", MODEL]
        cmd += [str(a) for a in extra]
        proc = Process(f"kvroute-emulator#{len(started)}", cmd, str(tmp_path / f"emulator{len(started)}.log"))
        started.append(proc)
        proc.wait_for_log("READY", timeout=30)
        return Fleet(proc, ports)

    yield start
    for proc in reversed(started):
        proc.stop()


# --------------------------------------------------------------------------
# Envoy with kvroute


def plugin_config(**overrides):
    """The tests' plugin config (the shipped one with routing.debugHeader and
    routing.statePath on) with section-level overrides.

    overrides: affinity={...} merges into the prefix-cache-affinity-filter's
    parameters; routing={...} / collector={...} merge into those sections;
    endpoints={...} replaces the endpoints section.
    """
    cfg = json.loads(json.dumps(BASE_PLUGIN_CONFIG))
    for plugin in cfg["plugins"]:
        if plugin["type"] == "prefix-cache-affinity-filter" and "affinity" in overrides:
            plugin.setdefault("parameters", {}).update(overrides["affinity"])
    for section in ("routing", "collector"):
        if section in overrides:
            cfg.setdefault(section, {}).update(overrides[section])
    if "endpoints" in overrides:
        cfg["endpoints"] = overrides["endpoints"]
    return cfg


class Envoy:
    def __init__(self, process, port, admin_port, config_path, eds_file=None, state_port=None, debug_port=None):
        self.process = process
        self.port = port
        self.admin_port = admin_port
        # The internal state listener (render.py --state-listener), if any.
        self.state_port = state_port
        # The internal debug listener (render.py --debug-listener), if any.
        self.debug_port = debug_port
        self.config_path = config_path
        self.eds_file = eds_file
        self.eds_version = 1

    def state(self):
        """The shared state: from the internal state listener when there is
        one, else from the client listener (routing.statePath)."""
        r = request(self.state_port or self.port, "GET", STATE_PATH, timeout=5)
        assert r.status == 200, f"GET {STATE_PATH}: {r}"
        return r.json()

    def state_by_address(self):
        return {e["address"]: e for e in self.state()["endpoints"]}

    def admin(self, path):
        return request(self.admin_port, "GET", path, timeout=5)

    def set_members(self, addresses):
        """Rewrite the EDS file (atomically) with these members."""
        assert self.eds_file, "this Envoy was started with a static endpoint list"
        self.eds_version += 1
        render.write_eds_file(self.eds_file, addresses, self.eds_version)

    def assert_alive(self):
        assert self.process.alive(), f"Envoy exited; log tail:\n{self.process.log_text()}"
        r = self.admin("/ready")
        assert r.status == 200 and r.body.strip() == b"LIVE", r

    def wasm_failures(self):
        """Non-zero VM reload counters. The filter runs with FAIL_RELOAD, so a
        VM that died (panic, trap) shows up here; the dict must stay empty."""
        r = self.admin("/stats?filter=wasm")
        assert r.status == 200, r
        bad = {}
        for line in r.body.decode().splitlines():
            name, _, value = line.partition(": ")
            if "vm_reload" in name and value.strip().isdigit() and int(value) != 0:
                bad[name] = int(value)
        return bad


@pytest.fixture
def envoy(artifacts, tmp_path):
    """Factory: envoy(config, endpoints=[...] | eds=[...], concurrency=2,
    state_listener=False, debug_listener=False, wasm=None) -> Envoy.

    state_listener=True adds render.py's internal state listener on a free
    port (Envoy.state_port), and Envoy.state() reads from it. debug_listener=True
    adds render.py's internal debug listener (Envoy.debug_port). With eds=[...], the vllm cluster takes its members from an EDS file and the
    plugin config gets endpoints.fromCluster (unless the config sets endpoints).
    Waits until Envoy is LIVE and the filter's state lists the expected members.
    """
    started = []

    def start(config=None, endpoints=None, eds=None, concurrency=2, wait_endpoints=True, state_listener=False,
              debug_listener=False, wasm=None):
        config = plugin_config() if config is None else config
        port, admin_port, state_port, debug_port = free_ports(4)
        if not debug_listener:
            debug_port = None
        if not state_listener:
            state_port = None
        n = len(started)
        config_path = str(tmp_path / f"envoy{n}.yaml")
        plugin_path = str(tmp_path / f"plugin{n}.json")
        with open(plugin_path, "w") as f:
            json.dump(config, f)
        args = [
            os.path.join(REPO, "envoy", "run.sh"),
            "--concurrency", str(concurrency),
            "--log-level", os.environ.get("KVROUTE_E2E_ENVOY_LOG", "warning"),
            "--config-out", config_path,
            "--listen-port", str(port),
            "--admin-port", str(admin_port),
            "--plugin-config", plugin_path,
            "--wasm", artifacts["wasm"] if wasm is None else wasm,
        ]
        if state_port:
            args += ["--state-listener", f"127.0.0.1:{state_port}"]
        if debug_port:
            args += ["--debug-listener", f"127.0.0.1:{debug_port}"]
        eds_file = None
        if eds is not None:
            eds_file = str(tmp_path / f"eds{n}" / "vllm.json")
            render.write_eds_file(eds_file, eds, 1)
            args += ["--eds-file", eds_file]
        else:
            args += ["--endpoints", ",".join(endpoints)]
        proc = Process(f"envoy#{n}", args, str(tmp_path / f"envoy{n}.log"))
        started.append(proc)
        e = Envoy(proc, port, admin_port, config_path, eds_file, state_port, debug_port)

        def live():
            if not proc.alive():
                raise AssertionError(f"Envoy exited (code {proc.proc.poll()}); log:\n{proc.log_text()}")
            try:
                r = e.admin("/ready")
                return r.status == 200 and r.body.strip() == b"LIVE"
            except OSError:
                return False

        wait_until(live, timeout=30, what="Envoy /ready == LIVE")
        expected = eds if eds is not None else endpoints
        if wait_endpoints and expected:
            wait_until(
                lambda: _state_addresses(e) == set(expected),
                timeout=15,
                what=f"filter state listing {sorted(expected)}",
            )
        return e

    yield start
    for proc in reversed(started):
        proc.stop()


def _state_addresses(e):
    try:
        return {x["address"] for x in e.state()["endpoints"]}
    except (AssertionError, OSError, ValueError, KeyError):
        return None
