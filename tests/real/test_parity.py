"""Parser parity: the real vLLM server's /metrics text and KV-event frames,
and the emulator's for the same token-ID prompts, go through the same
parsers with no special case. In Python: metric families, their types and
label names; event frames, the msgpack layout and each event's keys. In
Rust (sim/tests/real_vllm_parity.rs, run here with cargo): kvroute's own
/metrics parser and KV-event decoder on both captures, which must agree.
A difference is a bug in the emulator."""

import os
import re
import subprocess
import time

import msgpack
import pytest

from conftest import BLOCK_SIZE, NUM_BLOCKS, REPO, EventSink, e2e, write_frames_jsonl

# Token-ID prompts (vocab 4096): three sharing a 10-block prefix, one distinct.
# Lengths keep prompt + 1 output token inside the last full block.
_PREFIX = [(i * 37 + 11) % 4000 + 3 for i in range(10 * BLOCK_SIZE)]
PROMPTS = [_PREFIX + [(i * 53 + 7 * k) % 4000 + 3 for i in range(40)] for k in (1, 2, 3)]
PROMPTS.append([(i * 91 + 5) % 4000 + 3 for i in range(200)])


def _send(port, model, prompt):
    r = e2e.post(port, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0},
                 timeout=120)
    assert r.status == 200, r
    return r.json()


def _quiet(messages_fn, settle=2.0, timeout=60):
    """Waits until no new message came for `settle` seconds."""
    deadline = time.monotonic() + timeout
    n, since = len(messages_fn()), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        m = len(messages_fn())
        if m != n:
            n, since = m, time.monotonic()
        elif time.monotonic() - since >= settle:
            break
    return messages_fn()


def _families(text):
    """{family: (type, frozenset of label names over its samples)} for vllm: metrics."""
    types = {}
    labels = {}
    for line in text.splitlines():
        m = re.match(r"^# TYPE (\S+) (\S+)", line)
        if m:
            types[m.group(1)] = m.group(2)
            continue
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+\S+", line)
        if not m:
            continue
        name = m.group(1)
        names = frozenset(re.findall(r'(\w+)="', m.group(2) or ""))
        labels.setdefault(name, set()).add(names)
    out = {}
    for fam, typ in types.items():
        if not fam.startswith("vllm:"):
            continue
        samples = {n: v for n, v in labels.items() if n == fam or n.startswith(fam + "_")}
        out[fam] = (typ, {n: frozenset().union(*v) for n, v in samples.items()})
    return out


def _layout(messages):
    """Per event type: the key order seen; and the frame formats."""
    keys = {}
    for topic, seq, payload in messages:
        assert topic and len(seq) == 8
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        assert isinstance(batch, list) and len(batch) == 3, batch
        assert isinstance(batch[0], float) and isinstance(batch[1], list), batch
        for ev in batch[1]:
            assert isinstance(ev, dict), f"event not in map form: {ev!r}"
            keys.setdefault(ev["type"], set()).add(tuple(ev.keys()))
    return keys


# What kvroute's parsers read (filter/core/src/reports/vllm_metrics.rs).
KVROUTE_READS = {
    "vllm:num_requests_running": {"engine", "model_name"},
    "vllm:num_requests_waiting": {"engine", "model_name"},
    "vllm:kv_cache_usage_perc": {"engine", "model_name"},
    "vllm:prefix_cache_queries_total": {"engine", "model_name"},
    "vllm:prefix_cache_hits_total": {"engine", "model_name"},
    "vllm:cache_config_info": {"engine", "block_size", "num_gpu_blocks"},
}
# Histogram samples the online prefill-rate estimate reads
# (filter/core/src/learners/prefill_rate.rs): family → samples.
KVROUTE_READS_HISTOGRAMS = {
    "vllm:request_prefill_time_seconds": ("_sum", "_count"),
    "vllm:request_prefill_kv_computed_tokens": ("_sum",),
}


@pytest.fixture(scope="module")
def captures(real_fleet, artifacts, tmp_path_factory):
    """The same prompts to real server #0 and to one emulated endpoint; their
    /metrics and KV-event frames saved to a tmp dir."""
    out = tmp_path_factory.mktemp("parity")
    server = real_fleet.servers[0]
    sink = real_fleet.sinks[0]

    # --- the real server: the prompts straight to it, its events from its sink
    start = len(sink.snapshot())
    real_usage = [_send(server.port, "tiny", p)["usage"] for p in PROMPTS]
    real_msgs = _quiet(sink.snapshot)[start:]
    real_metrics = server.metrics_text()

    # --- the emulator: same geometry, same hash seed, same prompts
    (port,) = e2e.free_ports(1)
    cmd = [artifacts["emulator"], "--ports", str(port), "--model", e2e.MODEL, "--block-size", str(BLOCK_SIZE),
           "--num-gpu-blocks", str(NUM_BLOCKS), "--kv-events-port-base", "0", "--python-hash-seed", "0",
           "--max-model-len", "4096"]
    proc = e2e.Process("kvroute-emulator", cmd, str(out / "emulator.log"))
    try:
        text = proc.wait_for_log("READY", timeout=60)
        m = re.search(r"KV_EVENTS (\S+)", text)
        assert m, text
        sub = EventSink(connect=m.group(1).split(",")[0])
        try:
            time.sleep(1.0)  # PUB drops messages until the subscription has reached it
            emu_usage = [_send(port, e2e.MODEL, p)["usage"] for p in PROMPTS]
            emu_msgs = _quiet(sub.snapshot)
        finally:
            sub.stop()
        r = e2e.request(port, "GET", "/metrics", timeout=10)
        assert r.status == 200, r
        emu_metrics = r.body.decode()
    finally:
        proc.stop()

    (out / "metrics-real.txt").write_text(real_metrics)
    (out / "metrics-emu.txt").write_text(emu_metrics)
    write_frames_jsonl(out / "events-real.jsonl", real_msgs)
    write_frames_jsonl(out / "events-emu.jsonl", emu_msgs)
    print(f"\ncaptures in {out}: {len(real_msgs)} real and {len(emu_msgs)} emulated messages")
    return {"dir": out, "real_usage": real_usage, "emu_usage": emu_usage, "real_msgs": real_msgs,
            "emu_msgs": emu_msgs, "real_metrics": real_metrics, "emu_metrics": emu_metrics}


def test_both_engines_cache_the_shared_prefix(captures):
    for side in ("real", "emu"):
        usage = captures[f"{side}_usage"]
        cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0 for u in usage]
        assert cached[1] == cached[2] == 10 * BLOCK_SIZE, (side, usage)
        assert [u["prompt_tokens"] for u in usage] == [len(p) for p in PROMPTS], (side, usage)


def test_metric_names_types_and_labels_alike(captures):
    """Every vllm: family the emulator serves is served by vLLM 0.32 with the
    same type and the same sample names; no label exists only in the
    emulator; what kvroute reads is there on both sides, labels included."""
    real_f, emu_f = _families(captures["real_metrics"]), _families(captures["emu_metrics"])
    problems = []
    for fam, (typ, samples) in sorted(emu_f.items()):
        if fam not in real_f:
            problems.append(f"{fam}: served by the emulator, not by vLLM 0.32")
            continue
        rtyp, rsamples = real_f[fam]
        if typ != rtyp:
            problems.append(f"{fam}: type {typ} (emulator) vs {rtyp} (vLLM)")
        for name, labs in samples.items():
            if name not in rsamples:
                problems.append(f"{name}: sample only in the emulator")
            elif labs - rsamples[name]:
                problems.append(f"{name}: labels only in the emulator: {sorted(labs - rsamples[name])}")
    for fam, needed in KVROUTE_READS.items():
        for side, fams in (("emulator", emu_f), ("vLLM", real_f)):
            if fam not in fams:
                problems.append(f"{fam}: read by kvroute, not served by the {side}")
            elif needed - fams[fam][1].get(fam, frozenset()):
                problems.append(f"{fam}: the {side} lacks labels {sorted(needed - fams[fam][1][fam])}")
    for fam, suffixes in KVROUTE_READS_HISTOGRAMS.items():
        for side, fams in (("emulator", emu_f), ("vLLM", real_f)):
            if fams.get(fam, ("",))[0] != "histogram":
                problems.append(f"{fam}: read by kvroute, not a histogram on the {side}")
                continue
            for suffix in suffixes:
                if "engine" not in fams[fam][1].get(fam + suffix, frozenset()):
                    problems.append(f"{fam}{suffix}: read by kvroute, missing (or no engine label) on the {side}")
    assert not problems, "\n".join(problems)


def _config_info(text):
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    return {}


def test_cache_config_info_labels_alike(captures):
    real, emu = _config_info(captures["real_metrics"]), _config_info(captures["emu_metrics"])
    assert real and emu
    # Values agree (same geometry, same hash algorithm), except the KV
    # memory, which depends on the deployment (VLLM_CPU_KVCACHE_SPACE) and
    # which the emulator reports as 0.
    deployment = {"kv_cache_memory_bytes"}
    differ = {k: (emu[k], real[k]) for k in (set(emu) & set(real)) - deployment if emu[k] != real[k]}
    assert not differ, f"label values (emulator, vLLM) differ: {differ}"
    assert sorted(emu) == sorted(real), f"labels only in vLLM: {sorted(set(real) - set(emu))}"


def test_kv_event_frames_alike(captures):
    real_keys, emu_keys = _layout(captures["real_msgs"]), _layout(captures["emu_msgs"])
    assert "BlockStored" in real_keys and "BlockStored" in emu_keys, (real_keys, emu_keys)
    for typ in set(real_keys) & set(emu_keys):
        assert real_keys[typ] == emu_keys[typ], (typ, real_keys[typ], emu_keys[typ])
    for side in ("real", "emu"):
        topics = {bytes(t) for t, _, _ in captures[f"{side}_msgs"]}
        assert len(topics) == 1, (side, topics)


def test_kvroute_parsers_agree_on_real_and_emulated(captures):
    """kvroute's own /metrics parser and KV-event decoder, in Rust."""
    env = dict(os.environ, KVROUTE_REAL_PARITY_DIR=str(captures["dir"]))
    env.pop("CARGO_TARGET_DIR", None)
    proc = subprocess.run(
        ["cargo", "test", "-p", "kvroute-sim", "--test", "real_vllm_parity", "--", "--ignored", "--nocapture"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, f"cargo test real_vllm_parity failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-4000:]}"
    assert "2 passed" in proc.stdout, proc.stdout[-2000:]


def test_text_and_chat_prompts_count_the_same_tokens_as_vllm(real_fleet, artifacts, tmp_path):
    """The emulator tokenizes text and chat prompts as the real server does
    (the same tokenizer.json and chat template, sim/model/src/vllm_server/tokenize.rs):
    equal prompt_tokens, and equal cached_tokens on a repeat, so a router
    that guesses tokens from bytes is judged against real token counts."""
    server = real_fleet.servers[-1]
    nonce = os.urandom(4).hex()  # the real server may hold earlier runs' blocks
    words = "the prefix cache keeps each block of a prompt so that a later request can skip it".split()
    body = " ".join(words[(i * 7) % len(words)] for i in range(260))
    requests = [
        ("/v1/completions", {"prompt": f"{nonce} {body}\nWhat is kept?"}),
        ("/v1/completions", {"prompt": f"{nonce} {body}\nWhat is kept?"}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": f"{nonce} {body}"},
                                               {"role": "user", "content": "Say which block."}]}),
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": f"{nonce} {body}"},
                                               {"role": "user", "content": "Say which block again."}]}),
    ]

    def usage(port, model):
        out = []
        for path, extra in requests:
            r = e2e.post(port, path, {"model": model, "max_tokens": 1, "temperature": 0, **extra}, timeout=120)
            assert r.status == 200, r
            u = r.json()["usage"]
            out.append((u["prompt_tokens"], (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        return out

    real = usage(server.port, "tiny")
    (port,) = e2e.free_ports(1)
    cmd = [artifacts["emulator"], "--ports", str(port), "--model", e2e.MODEL, "--block-size", str(BLOCK_SIZE),
           "--num-gpu-blocks", str(NUM_BLOCKS), "--max-model-len", "4096"]
    proc = e2e.Process("kvroute-emulator", cmd, str(tmp_path / "emulator.log"))
    try:
        proc.wait_for_log("READY", timeout=60)
        emu = usage(port, e2e.MODEL)
    finally:
        proc.stop()
    print("\n(prompt_tokens, cached_tokens) real:", real, "emulated:", emu)
    assert emu == real
    # Real tokens, not kvroute's default estimate of bytes / 4.
    assert real[0][0] > len(body) / 3.5, real
    assert real[1][1] > 0 and real[3][1] > 0, real
