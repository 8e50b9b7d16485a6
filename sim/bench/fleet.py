"""An emulated vLLM fleet for the benchmarks, and the process plumbing around it.

quality.py and replicas.py both start one `kvroute-emulator` process serving
N endpoints on 127.0.0.1 (ports the OS picks), wait for its `READY` line and
read the endpoints from it; this module is that start-up, once. Also here,
because the start-up needs them and both scripts use them for Envoy, relays
and routers too: `Procs` (every process a script starts, stopped by PID),
`free_port`, `http_req` and `wait_until`.

Only the Python standard library.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import time


class Procs:
    """Every process this script starts, stopped by PID (process group)."""

    def __init__(self):
        self.live = []

    def start(self, name, argv, log_path, env=None):
        log = open(log_path, "w")
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             start_new_session=True, env=env)
        p._kv_name, p._kv_log = name, log_path
        self.live.append(p)
        return p

    def stop(self, p, timeout=10):
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        if p in self.live:
            self.live.remove(p)

    def stop_all(self):
        for p in list(reversed(self.live)):
            self.stop(p)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def http_req(method, port, path, body=None, timeout=5):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=body)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def wait_until(what, check, timeout, proc=None):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}; see {proc._kv_log}")
        try:
            if check():
                return
        except (OSError, ValueError, KeyError, http.client.HTTPException) as e:
            last = e
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready within {timeout} s (last error: {last})")


def start_emulators(procs, emulator, fleet, log_path, time_scale, stream_interval, extra=()):
    """Starts `fleet["endpoints"]` emulated servers in one `kvroute-emulator` process.

    `fleet` gives each server's `num_gpu_blocks`, `block_size` (tokens),
    `max_num_batched_tokens` and `prefill_tps` (tokens/s); `extra` is the
    caller's own flags. Returns (process, ["127.0.0.1:PORT", ...]) once the
    emulator has printed `READY` (30 s at most).
    """
    n = fleet["endpoints"]
    argv = [emulator, "--ports", ",".join(["0"] * n),
            "--num-gpu-blocks", str(fleet["num_gpu_blocks"]), "--block-size", str(fleet["block_size"]),
            "--max-num-batched-tokens", str(fleet["max_num_batched_tokens"]),
            "--prefill-tps", str(fleet["prefill_tps"]), "--time-scale", str(time_scale),
            "--stream-interval", str(stream_interval)] + list(extra)
    p = procs.start("emulator", argv, log_path)
    endpoints = []

    def ready():
        nonlocal endpoints
        for line in open(log_path):
            if line.startswith("READY "):
                endpoints = line.split()[1].split(",")
                return True
        return False

    wait_until("emulator fleet", ready, 30, p)
    return p, endpoints


def wait_fleet_idle(endpoints, timeout=120):
    """Waits until no emulated server in `endpoints` has a request running or
    waiting (`/emulator/stats`), so the next arm starts on an idle fleet."""
    def idle():
        for e in endpoints:
            st, body = http_req("GET", int(e.rsplit(":", 1)[1]), "/emulator/stats")
            s = json.loads(body)
            if st != 200 or s.get("running", 0) or s.get("waiting", 0):
                return False
        return True

    wait_until("fleet idle before the next arm", idle, timeout)
