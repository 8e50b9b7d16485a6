#!/usr/bin/env python3
"""Routing quality through Envoy (issue 4): one command, one run, every arm.

    python3 sim/bench/quality.py --smoke            # CI: a few seconds per arm, exits 1 on any failure
    python3 sim/bench/quality.py                    # full run, one seed (~2 h on 2 cores); writes docs/
    python3 sim/bench/quality.py --seeds 1,2,3      # three seeds (~6 h)
    python3 sim/bench/quality.py --from-results a.json,b.json   # rewrite docs/ from runs of different workloads
    python3 sim/bench/quality.py --workloads shared-prefix --arms round-robin,kvroute

For each workload it starts one emulated vLLM fleet (kvroute-emulator, N
endpoints on 127.0.0.1), measures peakPrefillThroughput on it, then runs each
arm against that same fleet and the same Envoy binary:

  round-robin      Envoy without kvroute (envoy/render.py --baseline)
  kvroute          llm-d's matched configuration: affinity filter + token-load scorer
  kvroute-default  the shipped profile (envoy/kvroute-config.json, kvroute-default) with the
                   fleet's block size, the calibrated peak and --penalty-ms, as the other arms
  always-sticky    the same with maxTTFTPenaltyMs 0 (never releases stickiness)
  legacy-blend     prefix-cache x3, queue x2, kv-cache-utilization x2, no-hit-lru x2, no filter
  active-request   affinity filter + active-request scorer (the decode-bound profile)
  smg-cache-aware  the SGLang model gateway (PyPI smg==1.13.0), --policy cache_aware, its defaults

Before each arm every endpoint's cache and counters are cleared
(POST /emulator/reset, done by kvroute-loadgen). Each arm is a Poisson ramp of
kvroute-loadgen stages; the ramp stops after the first stage whose TTFT p90
exceeds --stop-factor x the SLO. The knee of an arm is the highest offered
rate whose TTFT p90 stays within the SLO with under 1 % errors; the headline
is the throughput at that stage, kvroute over round robin.

Only the Python standard library is used. Everything runs on 127.0.0.1 and
every process started here is stopped here (by PID), also on failure or Ctrl-C.
"""

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import plots  # noqa: E402  (sim/bench/plots.py)
from fleet import Procs, free_port, http_req, start_emulators, wait_fleet_idle, wait_until  # noqa: E402,F401  (sim/bench/fleet.py)
# The fleet, the workloads, the arms and the helpers other scripts share (sim/bench/kvbench.py);
# re-exported here, where those scripts found them first.
from kvbench import (  # noqa: E402,F401
    ALL_ARMS, ENVOY_VERSION, FLEET, WORKLOADS, add_wasm_target, find_envoy, git_commit, knee, log, plugin_config,
)

SMG_VERSION = "1.13.0"
SECTION = "## Routing quality through Envoy"
# Hand-written reading of the figures, appended to the generated section.
ANALYSIS = os.path.join(HERE, "analysis.md")

KVROUTE_ARMS = {"kvroute", "kvroute-default", "always-sticky", "legacy-blend", "active-request", "kvroute-18s", "kvroute-output-est"}

# Smoke: tiny prompts, one short stage per arm; proves every arm runs and
# answers, nothing about quality. Every arm is smoked on reasoning; the other
# workloads smoke their generators through round robin and the two kvroute
# profiles that matter (keeps CI's smoke step near 3 min).
SMOKE_ARMS = ["round-robin", "kvroute", "kvroute-default"]
SMOKE = {
    "shared-prefix": {"loadgen": ["--groups", "6", "--prompts-per-group", "3", "--system-tokens", "1024",
                                  "--question-tokens", "128", "--output-tokens", "16"],
                      "rates": [4], "stage_s": 40, "arms": SMOKE_ARMS},
    "code-generation": {"loadgen": ["--groups", "4", "--prompts-per-group", "3", "--system-tokens", "512",
                                    "--question-tokens", "128", "--output-tokens", "16"],
                        "rates": [3], "stage_s": 40, "arms": SMOKE_ARMS},
    "reasoning": {"loadgen": ["--system-tokens", "128", "--question-tokens", "256", "--output-tokens", "64"],
                  "rates": [3], "stage_s": 40, "time_scale": 10},
    "shared-prefix-skew": {"loadgen": ["--groups", "2", "--prompts-per-group", "20", "--system-tokens", "1024",
                                       "--question-tokens", "128", "--output-tokens", "16"],
                           "rates": [4], "stage_s": 40},
    "agent-session": {"loadgen": ["--groups", "4", "--prompts-per-group", "3", "--system-tokens", "256",
                                  "--persona-tokens", "512", "--question-tokens", "128", "--output-tokens", "16"],
                      "rates": [3], "stage_s": 40, "arms": SMOKE_ARMS},
    "bursty-cold-start": {"loadgen": ["--groups", "4", "--system-tokens", "512", "--question-tokens", "64",
                                      "--output-tokens", "16"],
                          "rates": [4], "stage_s": 40, "time_scale": 10, "arms": SMOKE_ARMS},
}


# ---------------------------------------------------------------------------
# Tools: binaries, Envoy, smg
# ---------------------------------------------------------------------------

def build(target_dir, bin_profile):
    add_wasm_target()
    env = dict(os.environ, CARGO_TARGET_DIR=target_dir)
    sim = ["cargo", "build", "-p", "kvroute-sim", "--bins"] + (["--release"] if bin_profile == "release" else [])
    for argv in (sim,
                 ["cargo", "build", "--release", "--target", "wasm32-wasip1", "-p", "kvroute-wasm"]):
        log("building: " + " ".join(argv))
        subprocess.run(argv, cwd=REPO, env=env, check=True)


def find_smg(venv):
    """smg==1.13.0 in its own virtualenv (it pins protobuf/grpcio versions)."""
    smg = os.path.join(venv, "bin", "smg")
    if os.path.exists(smg):
        v = subprocess.run([os.path.join(venv, "bin", "python"), "-c",
                            "import importlib.metadata as m; print(m.version('smg'))"],
                           capture_output=True, text=True).stdout.strip()
        if v == SMG_VERSION:
            return smg
    log(f"installing smg=={SMG_VERSION} from PyPI into {venv}")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([os.path.join(venv, "bin", "pip"), "install", "--quiet", "--disable-pip-version-check",
                    f"smg=={SMG_VERSION}"], check=True)
    return smg


# ---------------------------------------------------------------------------
# One run
# ---------------------------------------------------------------------------

class Bench:
    def __init__(self, args):
        self.args = args
        self.procs = Procs()
        self.work = args.work_dir or tempfile.mkdtemp(prefix="kvroute-quality.")
        os.makedirs(self.work, exist_ok=True)
        td = args.target_dir
        self.emulator = os.path.join(td, args.bin_profile, "kvroute-emulator")
        self.loadgen = os.path.join(td, args.bin_profile, "kvroute-loadgen")
        self.wasm = os.path.join(td, "wasm32-wasip1", "release", "kvroute_wasm.wasm")
        self.envoy = None
        self.smg = None

    # -- fleet ---------------------------------------------------------------
    def start_fleet(self, name, time_scale):
        logp = os.path.join(self.work, f"{name}.emulator.log")
        p, endpoints = start_emulators(self.procs, self.emulator, FLEET, logp, time_scale,
                                       FLEET["stream_interval"])
        log(f"fleet for {name}: {','.join(endpoints)} (time scale {time_scale})")
        return p, endpoints

    # -- calibration ---------------------------------------------------------
    def calibrate(self, name, endpoints, time_scale):
        """peakPrefillThroughput = B / median TTFT of cold B-token requests, max_tokens 1."""
        b = FLEET["max_num_batched_tokens"]
        out = os.path.join(self.work, f"{name}.calibration.json")
        seconds = 8 if self.args.smoke else 30
        argv = [self.loadgen, "--target", f"http://{endpoints[0]}", "--endpoints", endpoints[0],
                "--workload", "reasoning", "--api", "completions", "--system-tokens", "0",
                "--question-tokens", str(b - 1), "--output-tokens", "1",
                "--stages", f"concurrency:1@{seconds}s", "--time-scale", str(time_scale), "--json", out]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"calibration failed: {r.stderr[-2000:]}")
        st = json.load(open(out))["stages"][0]
        p50 = st["ttft_s"]["p50"]
        if not p50 or st["ok"] < 3:
            raise RuntimeError(f"calibration produced no TTFT: {st}")
        peak = b / p50
        log(f"calibration ({name}): {st['ok']} cold {b}-token requests, TTFT p50 {p50 * 1000:.0f} ms "
            f"(model) -> peakPrefillThroughput {peak:.0f} tok/s (emulator configured {FLEET['prefill_tps']})")
        return {"B": b, "requests": st["ok"], "ttft_p50_s": p50, "ttft_p90_s": st["ttft_s"]["p90"],
                "peak": round(peak)}

    # -- routers -------------------------------------------------------------
    def start_envoy(self, tag, arm, endpoints, peak):
        listen, admin = free_port(), free_port()
        argv = ["bash", os.path.join(REPO, "envoy", "run.sh"), "--endpoints", ",".join(endpoints),
                "--listen-port", str(listen), "--admin-port", str(admin), "--wasm", self.wasm,
                "--log-level", "warning", "--concurrency", str(self.args.envoy_concurrency),
                "--config-out", os.path.join(self.work, f"{tag}.envoy.yaml")]
        if arm == "round-robin":
            argv.append("--baseline")
        else:
            cfg = plugin_config(arm, peak, self.args.penalty_ms, self.args.metrics_poll_ms)
            cfg_path = os.path.join(self.work, f"{tag}.plugin.json")
            with open(cfg_path, "w") as f:
                json.dump(cfg, f, indent=1)
            argv += ["--plugin-config", cfg_path]
        env = dict(os.environ, PATH=os.path.dirname(self.envoy) + os.pathsep + os.environ.get("PATH", ""))
        p = self.procs.start(f"envoy {arm}", argv, os.path.join(self.work, f"{tag}.envoy.log"), env=env)

        def ready():
            st, body = http_req("GET", admin, "/ready")
            if st != 200 or body.strip() != b"LIVE":
                return False
            if arm == "round-robin":
                return True
            st, body = http_req("GET", listen, "/kvroute/state")
            eps = json.loads(body).get("endpoints", [])
            # every endpoint known, and polled once: capacity (autoTune) and the
            # legacy blend's queue / KV-usage scorers come from /metrics
            return len(eps) == len(endpoints) and all((e.get("metrics") or {}).get("fresh") for e in eps)

        wait_until(f"envoy ({arm})", ready, 60, p)
        return p, listen, admin

    def start_smg(self, tag, endpoints):
        port, prom = free_port(), free_port()
        argv = [self.smg, "launch", "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *[f"http://{e}" for e in endpoints],
                "--policy", "cache_aware", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prom),
                "--log-level", "warn", "--shutdown-grace-period-secs", "2"]
        p = self.procs.start("smg", argv, os.path.join(self.work, f"{tag}.smg.log"))

        def ready():
            st, body = http_req("GET", port, "/workers")
            if st != 200:
                return False
            data = json.loads(body)
            workers = data.get("workers", data) if isinstance(data, dict) else data
            return isinstance(workers, list) and len(workers) >= len(endpoints)

        wait_until("smg", ready, 90, p)
        return p, port

    def envoy_stats(self, admin):
        try:
            st, body = http_req("GET", admin, "/stats?filter=kvroute_")
        except OSError:
            return {}
        out = {}
        for line in body.decode().splitlines():
            k, _, v = line.partition(": ")
            if "kvroute_" in k and v.strip().isdigit():
                out[k.split("kvroute_", 1)[1]] = int(v)
        return out

    # -- arms ----------------------------------------------------------------
    def run_arm(self, wname, w, arm, endpoints, peak, seed, extra=(), tag_suffix=""):
        tag = f"{wname}.{arm}" + (f".seed{seed}" if len(self.args.seeds) > 1 else "") + tag_suffix
        out = os.path.join(self.work, f"{tag}.json")
        admin = None
        if arm == "smg-cache-aware":
            router, port = self.start_smg(tag, endpoints)
        else:
            router, port, admin = self.start_envoy(tag, arm, endpoints, peak)
        try:
            wait_fleet_idle(endpoints)
            rates = ",".join(f"{r:g}" for r in w["rates"])
            argv = [self.loadgen, "--target", f"http://127.0.0.1:{port}", "--endpoints", ",".join(endpoints),
                    "--workload", w.get("workload", wname), "--stages", f"rate:{rates}@{w['stage_s']}s",
                    "--time-scale", str(w["time_scale"]), "--seed", str(seed), "--json", out,
                    "--ceiling-block-size", str(FLEET["block_size"]),
                    "--request-timeout-s", str(self.args.request_timeout_s),
                    "--stop-after-ttft-p90", str(self.args.slo_s * self.args.stop_factor), *w["loadgen"], *extra]
            if admin:
                # the filter's counters (branches, fail-open) per stage
                argv += ["--router-stats", f"http://127.0.0.1:{admin}/stats?filter=kvroute_&type=Counters"]
            t0 = time.time()
            with open(os.path.join(self.work, f"{tag}.loadgen.log"), "w") as lf:
                r = subprocess.run(argv, stdout=lf, stderr=subprocess.STDOUT)
            wall = time.time() - t0
            stats = self.envoy_stats(admin) if admin else {}
            if router.poll() is not None:
                raise RuntimeError(f"{arm}: the router exited during the run; see {router._kv_log}")
        finally:
            self.procs.stop(router)
        if r.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{arm}: kvroute-loadgen failed (exit {r.returncode}); see {self.work}/{tag}.loadgen.log")
        report = json.load(open(out))
        return summarize_arm(report, w, stats, wall)

    def run(self):
        a = self.args
        results = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git_commit(), "smoke": a.smoke,
                   "fleet": FLEET,
                   "slo_s": a.slo_s, "penalty_ms": a.penalty_ms, "metrics_poll_ms": a.metrics_poll_ms,
                   "envoy_concurrency": a.envoy_concurrency, "seed": a.seeds[0], "seeds": a.seeds,
                   "workloads": {},
                   "command": "python3 sim/bench/quality.py " + " ".join(sys.argv[1:])}
        failures = []
        try:
            for wname in a.workloads:
                w = dict(WORKLOADS[wname])
                if a.smoke:
                    w.update(SMOKE[wname])
                arms = a.arms or w["arms"]
                fleet, endpoints = self.start_fleet(wname, w["time_scale"])
                wres = {"what": w["what"], "bound": w["bound"], "time_scale": w["time_scale"],
                        "stage_s": w["stage_s"], "rates": w["rates"], "loadgen_extra": w["loadgen"],
                        "target": w.get("target"), "report_ceiling": bool(w.get("report_ceiling")),
                        # "arms": the first seed's runs (tables, plots); "seeds": every seed's
                        "arms": {}, "seeds": {str(seed): {} for seed in a.seeds}}
                results["workloads"][wname] = wres
                try:
                    cal = self.calibrate(wname, endpoints, w["time_scale"])
                    wres["calibration"] = cal
                    for seed in a.seeds:
                        runs = wres["seeds"][str(seed)]
                        if seed == a.seeds[0]:
                            wres["arms"] = runs
                        for arm in arms:
                            name = f"{wname}/{arm}" + (f" seed {seed}" if len(a.seeds) > 1 else "")
                            log(f"{name}: start")
                            try:
                                if arm == "smg-cache-aware" and self.smg is None:
                                    self.smg = find_smg(a.smg_venv)
                                res = self.run_arm(wname, w, arm, endpoints, cal["peak"], seed)
                                runs[arm] = res
                                res["knee"] = knee(res["stages"], a.slo_s, w["bound"])
                                problems = check_arm(res)
                                if problems:
                                    failures.append(f"{name}: {problems}")
                                k = res.get("knee")
                                log(f"{name}: {len(res['stages'])} stage(s) in {res['wall_s']:.0f} s; "
                                    f"knee {k['rate'] if k else 'none'} req/s; hit / ceiling by stage "
                                    + ", ".join(fmt(st["hit_over_ceiling"], ".3f") for st in res["stages"])
                                    + (f"; problems: {problems}" if problems else ""))
                            except Exception as e:  # noqa: BLE001 -- one arm's failure is reported, the rest run
                                failures.append(f"{name}: {e}")
                                runs[arm] = {"error": str(e)}
                                log(f"{name}: FAILED: {e}")
                finally:
                    self.procs.stop(fleet)
                add_headlines(wres, a.slo_s)
                self.save(results)
        finally:
            self.procs.stop_all()
        results["failures"] = failures
        self.save(results)
        return results, failures

    def run_reject_ab(self):
        """--reject-ab RATE: per seed, each arm runs the workload twice on the same fleet (caches and
        counters reset before each run, a new Envoy each time): alone, then with kvroute-loadgen's
        --reject-stream (a second client's over-length requests, answered 400 by the servers)."""
        a = self.args
        results = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": git_commit(), "fleet": FLEET,
                   "slo_s": a.slo_s, "penalty_ms": a.penalty_ms, "metrics_poll_ms": a.metrics_poll_ms,
                   "envoy_concurrency": a.envoy_concurrency, "seeds": a.seeds,
                   "reject_stream": {"rate": a.reject_ab, "tokens": a.reject_tokens}, "workloads": {},
                   "command": "python3 sim/bench/quality.py " + " ".join(sys.argv[1:])}
        failures = []
        stream = ["--reject-stream", f"{a.reject_ab:g}", "--reject-tokens", str(a.reject_tokens)]
        try:
            for wname in a.workloads:
                w = dict(WORKLOADS[wname])
                if a.smoke:
                    w.update(SMOKE[wname])
                arms = a.arms or ["kvroute-default"]
                fleet, endpoints = self.start_fleet(wname, w["time_scale"])
                wres = {"what": w["what"], "time_scale": w["time_scale"], "stage_s": w["stage_s"],
                        "rates": w["rates"], "loadgen_extra": w["loadgen"], "runs": []}
                results["workloads"][wname] = wres
                try:
                    cal = self.calibrate(wname, endpoints, w["time_scale"])
                    wres["calibration"] = cal
                    for seed in a.seeds:
                        for arm in arms:
                            row = {"seed": seed, "arm": arm}
                            for key, extra in (("without", ()), ("with", stream)):
                                name = f"{wname}/{arm} seed {seed} {key} the reject stream"
                                log(f"{name}: start")
                                try:
                                    res = self.run_arm(wname, w, arm, endpoints, cal["peak"], seed, extra=extra,
                                                       tag_suffix=f".seed{seed}.{key}-rejects")
                                except Exception as e:  # noqa: BLE001 -- reported, the rest run
                                    failures.append(f"{name}: {e}")
                                    res = {"error": str(e), "stages": []}
                                row[key] = res
                                problems = check_arm(res) if "error" not in res else res["error"]
                                if key == "with":
                                    for st in res["stages"]:
                                        r = st.get("reject_stream") or {}
                                        if not r.get("sent") or r.get("rejected") != r.get("sent"):
                                            problems = (problems + "; " if problems else "") + (
                                                f"stage {st['label']}: reject stream {r or 'missing'} "
                                                "(every request must be rejected)")
                                if problems:
                                    failures.append(f"{name}: {problems}")
                                log(f"{name}: hit ratio by stage "
                                    + ", ".join(fmt(st["hit_ratio"], ".3f") for st in res["stages"])
                                    + (f"; problems: {problems}" if problems else ""))
                            wres["runs"].append(row)
                            self.save(results)
                finally:
                    self.procs.stop(fleet)
        finally:
            self.procs.stop_all()
        results["failures"] = failures
        self.save(results)
        return results, failures

    def save(self, results):
        with open(os.path.join(self.work, "results.json"), "w") as f:
            json.dump(results, f, indent=1)


# ---------------------------------------------------------------------------
# Analysis
# ---------------------------------------------------------------------------

def rate_of(label):
    # loadgen labels stages "rate 3/s" style; read the number.
    digits = "".join(ch if (ch.isdigit() or ch == ".") else " " for ch in label).split()
    return float(digits[0]) if digits else float("nan")


def summarize_arm(report, w, stats, wall):
    stages = []
    for st, rate in zip(report["stages"], w["rates"]):
        shares = [e.get("prefix_cache_queries") for e in st.get("endpoints", [])]
        shares = [s for s in shares if isinstance(s, (int, float)) and not math.isnan(s)]
        tot = sum(shares)
        stages.append({
            "rate": rate,
            "label": st["stage"],
            "requests": st["requests"],
            "ok": st["ok"],
            "error_rate": st["error_rate"],
            "errors": st.get("error_kinds", {}),
            "ttft_p50_s": st["ttft_s"]["p50"],
            "ttft_p90_s": st["ttft_s"]["p90"],
            "tpot_p90_s": st["tpot_s"]["p90"],
            "input_tps": st["input_tokens_per_s"],
            "output_tps": st["output_tokens_per_s"],
            "hit_ratio": st["hit_ratio"],
            # the stream's hit-ratio ceiling (one infinite cache, whole blocks; kvroute-loadgen
            # --ceiling-block-size) and how much of it the arm reached
            "hit_ratio_ceiling": st.get("hit_ratio_ceiling"),
            "hit_over_ceiling": (st["hit_ratio"] / st["hit_ratio_ceiling"]
                                 if st["hit_ratio"] is not None and st.get("hit_ratio_ceiling") else None),
            "client_cached_ratio": st["client_cached_ratio"],
            "host_lag_s": st["emulator_host_lag_s"],
            "span_s": st["span_s"],
            # share of the fleet's prompt tokens each endpoint served (counter-based, router-agnostic)
            "token_shares": [s / tot for s in shares] if tot > 0 else [],
            "max_token_share": (max(shares) / tot) if tot > 0 else None,
            # how much each of the filter's counters rose over the stage, without the kvroute_ prefix
            # (kvroute-loadgen --router-stats; None for smg, {} for Envoy without kvroute)
            "router": ({k.split("kvroute_", 1)[-1]: v for k, v in st["router_counters"].items()}
                       if st.get("router_counters") is not None else None),
            # kvroute-loadgen --reject-stream: what the second client's over-length requests got
            "reject_stream": st.get("reject_stream"),
        })
    return {"stages": stages, "envoy_stats": stats, "wall_s": wall}


def knee_interpolated(stages, slo_s, bound):
    """The offered rate where TTFT p90 crosses the SLO, interpolated (log TTFT) between the
    last stage within it and the next stage of the ramp; throughput interpolated at that rate."""
    key = "output_tps" if bound == "decode" else "input_tps"
    for a, b in zip(stages, stages[1:]):
        pa, pb = a["ttft_p90_s"], b["ttft_p90_s"]
        if pa is None or pa > slo_s or a["error_rate"] >= 0.01:
            continue
        if pb is not None and pb <= slo_s and b["error_rate"] < 0.01:
            continue
        if pb is None or pb <= 0 or pa <= 0:
            f = 0.0
        else:
            f = (math.log(slo_s) - math.log(pa)) / (math.log(pb) - math.log(pa))
            f = min(max(f, 0.0), 1.0)
        return {"rate": a["rate"] + f * (b["rate"] - a["rate"]),
                "throughput": a[key] + f * (b[key] - a[key])}
    return None


def rr_of(runs, arm):
    """The round robin an arm of one seed is measured against: its own run's (`round_robin`, when the arm was
    added from another run by `merge_results`), else the seed's."""
    return runs.get(arm, {}).get("round_robin") or runs.get("round-robin", {})


def seed_ratios(runs, slo_s, bound):
    """Knees of one seed's arms, and (knee, interpolated, 5 s) ratios over that seed's round robin."""
    for res in list(runs.values()) + [r["round_robin"] for r in runs.values() if "round_robin" in r]:
        if "stages" in res:
            res["knee"] = knee(res["stages"], slo_s, bound)
            res["knee_5s"] = knee(res["stages"], max(slo_s, 5.0), bound)
            res["knee_interp"] = knee_interpolated(res["stages"], slo_s, bound)
    heads, heads_i, heads_5 = {}, {}, {}
    for arm, res in runs.items():
        if arm == "round-robin":
            continue
        for key, out in (("knee", heads), ("knee_interp", heads_i), ("knee_5s", heads_5)):
            k, rr = res.get(key), rr_of(runs, arm).get(key)
            if k and rr and rr["throughput"] > 0:
                out[arm] = k["throughput"] / rr["throughput"]
    return heads, heads_i, heads_5


def add_headlines(wres, slo_s):
    # results of an earlier run (one seed, no "seeds") read the same way
    seeds = wres.get("seeds") or {"1": wres["arms"]}
    per_seed = {}
    for seed, runs in seeds.items():
        per_seed[seed] = seed_ratios(runs, slo_s, wres["bound"])
    first = next(iter(seeds))
    wres["ratios_vs_rr"], wres["ratios_vs_rr_interp"], wres["ratios_vs_rr_5s"] = per_seed[first]
    # Over seeds: knee / round robin (same seed), median and worst; a seed where the arm
    # had no knee but round robin did counts as 0.
    stats = {}
    arms = {arm for runs in seeds.values() for arm in runs if arm != "round-robin"}
    for arm in sorted(arms):
        vals = {}
        for seed, runs in seeds.items():
            rr = rr_of(runs, arm).get("knee")
            res = runs.get(arm) or {}
            if rr and rr["throughput"] > 0 and "stages" in res:
                vals[seed] = per_seed[seed][0].get(arm, 0.0)
        if vals:
            worst = min(vals, key=vals.get)
            stats[arm] = {"by_seed": vals, "median": median(list(vals.values())), "worst": vals[worst],
                          "worst_seed": worst,
                          "host_limited": sorted(x for x in vals if host_limited(seeds[x][arm], slo_s))}
    wres["ratios_over_seeds"] = stats
    # Knee rates seed by seed (the target's own measure: the highest offered rate within the SLO). At
    # equal knee rates two arms were offered the same requests of the same seed; their knee throughputs
    # then differ only by errors (< 1 %) and the stage's span (its drain after the last arrival).
    rates = {}
    for arm in sorted(arms | {"round-robin"}):
        by_seed = {seed: ((runs.get(arm) or {}).get("knee") or {}).get("rate", 0.0)
                   for seed, runs in seeds.items() if "stages" in (runs.get(arm) or {})}
        if by_seed:
            rates[arm] = {"by_seed": by_seed, "median": median(list(by_seed.values()))}
    wres["knee_rates"] = rates


def host_limited(res, slo_s):
    """Whether the stage that ended an arm's ramp (the first past its knee) ran on a lagging host: the
    emulator's event loop fell behind by at least the SLO (model time), which alone can break the SLO, so
    the machine, not only the routing, may have set the knee."""
    k = res.get("knee")
    past = [s for s in res.get("stages", []) if k is None or s["rate"] > k["rate"]]
    return bool(past) and (past[0].get("host_lag_s") or 0) >= slo_s


def median(v):
    v = sorted(v)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def ceiling_rows(wres):
    """(seed, arm, stage rate, hit ratio, ceiling, hit / ceiling) of every stage of every run."""
    rows = []
    for seed, runs in (wres.get("seeds") or {"1": wres["arms"]}).items():
        for arm, res in runs.items():
            for st in res.get("stages", []):
                rows.append((seed, arm, st["rate"], st["hit_ratio"], st.get("hit_ratio_ceiling"),
                             st.get("hit_over_ceiling")))
    return rows


def check_arm(res):
    """Smoke/full sanity: every arm must produce data."""
    problems = []
    st = res.get("stages") or []
    if not st:
        problems.append("no stage")
    for s in st:
        if s["ok"] == 0:
            problems.append(f"stage {s['label']}: no successful request")
        if s["error_rate"] > 0.05:
            problems.append(f"stage {s['label']}: {s['error_rate'] * 100:.0f} % errors {s['errors']}")
        if s["hit_ratio"] is None:
            problems.append(f"stage {s['label']}: endpoint counters unreadable")
        problems += router_count_problems(s)
    return "; ".join(problems)


def router_count_problems(s):
    """Through the kvroute filter, a stage's counters must account for every request: each one
    routed, failed open or rejected, and each routed one on exactly one branch."""
    c = s.get("router")
    if not c:  # not read (smg, older results) or no filter (round robin's plain Envoy)
        return []
    decided = c.get("routed", 0) + c.get("fail_open", 0) + c.get("rejected", 0)
    branches = sum(v for k, v in c.items() if k.startswith("branch_"))
    out = []
    # the --reject-stream client's requests go through the filter too
    requests = s["requests"] + ((s.get("reject_stream") or {}).get("sent") or 0)
    if decided != requests:
        out.append(f"stage {s['label']}: the filter decided {decided} of {requests} requests")
    if branches != c.get("routed", 0):
        out.append(f"stage {s['label']}: {branches} branch counts for {c.get('routed', 0)} routed")
    return out


# ---------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------

def fmt(v, spec, dash="–"):
    return dash if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def markdown(results, img_rel, stages=False):
    """The docs section: what and why, command, headline, one knee table per workload.
    Every stage's row only with `stages` (`--stages`); the raw data is in the results JSON."""
    a = results
    f = a["fleet"]
    L = [SECTION, ""]
    L.append("What it measures: throughput at the TTFT knee of each router arm over Envoy round robin's, on the "
             "same emulated vLLM fleet behind the same Envoy, in one run. Why: it is the method's claim (llm-d's "
             "\"sticky until saturated\" gains) checked end to end, through the real module.")
    L.append("")
    L.append("```sh")
    L.append("python3 sim/bench/quality.py --seeds 1,2,3   # every arm on every workload, ~6 h; rewrites this section, the plots, results/quality.json")
    L.append("python3 sim/bench/quality.py --workloads W --arms A,B --seeds 1,2,3 --results w.json --out /tmp/w.md")
    L.append("python3 sim/bench/quality.py --from-results w.json,x.json   # this section from runs of different workloads, seeds or arms")
    L.append("python3 sim/bench/quality.py --smoke         # CI: every arm serves (~3 min after the builds)")
    L.append("```")
    L.append("")
    runs = a.get("runs") or [run_of(a)]
    if len(runs) == 1:
        where = f"run of {describe_run(runs[0])}."
    else:
        where = (f"{len(runs)} runs, merged per workload (`--from-results`); each workload's run is named under "
                 "its heading.")
    L.append(f"Current figures: {where} Envoy 1.40.0 `--concurrency {a['envoy_concurrency']}`. "
             f"Fleet: {f['endpoints']} `kvroute-emulator` endpoints modelling Qwen3-32B on 2×H100 "
             f"(B = {f['max_num_batched_tokens']} tokens per step, {f['prefill_tps']} prefill tok/s, "
             f"{f['num_gpu_blocks']} KV blocks × {f['block_size']} tokens). Knee: the highest offered rate "
             f"(Poisson, model time) with TTFT p90 ≤ {a['slo_s']:g} s and < 1 % errors. kvroute: "
             f"`maxTTFTPenaltyMs` {a['penalty_ms']:g}, `affinityThreshold` 0.8, `peakPrefillThroughput` "
             f"calibrated per workload on the fleet, metrics polled every {a['metrics_poll_ms']} ms (wall). "
             "Definitions and arms: `sim/bench/README.md`; per-stage data: `sim/bench/results/quality.json`.")
    L.append("")
    seeds = sorted({int(x) for w in a["workloads"].values() for x in (w.get("seeds") or {"1": None})})
    # One seed: the seed's table is the headline. Several seeds: the median [worst] table below is, and
    # each workload's first-seed figures stay in its own table under its heading.
    if len(seeds) < 2:
        L.append(f"Knee throughput ÷ round robin's, same run, interpolated crossing in brackets; "
                 "\"(not run)\": the arm was left out of that workload's run:")
        L.append("")
        L.append("| workload | llm-d target | kvroute (llm-d matched) | kvroute-default | always-sticky | legacy blend | "
                 "active-request | smg cache_aware |")
        L.append("|---|---|---|---|---|---|---|---|")
        for wname, w in a["workloads"].items():
            r = w.get("ratios_vs_rr", {})
            tgt = w.get("target")
            tgt_s = "–" if tgt is None else (f"≥ {tgt:g}×" if tgt > 1 else "≥ parity")

            def cell(arm):
                if arm not in w["arms"]:
                    return "(not run)"
                if "error" in w["arms"][arm]:
                    return "failed"
                if arm in r:
                    ri = w.get("ratios_vs_rr_interp", {}).get(arm)
                    return f"**{r[arm]:.2f}×**" + (f" ({ri:.2f}×)" if ri is not None else "")
                return "no knee" if w["arms"][arm].get("knee") is None else "–"
            L.append(f"| {wname} | {tgt_s} | {cell('kvroute')} | {cell('kvroute-default')} | {cell('always-sticky')} | "
                     f"{cell('legacy-blend')} | {cell('active-request')} | {cell('smg-cache-aware')} |")
        L.append("")
    if len(seeds) > 1:
        per_w = {name: ", ".join(sorted(w.get("seeds") or {"1": None}, key=int))
                 for name, w in a["workloads"].items()}
        over = (f"seeds {next(iter(per_w.values()))}" if len(set(per_w.values())) == 1 else
                "each workload's seeds (" + "; ".join(f"{name} {s}" for name, s in per_w.items()) + ")")
        L.append(f"Over {over} (each arm's knee ÷ round robin's of the same seed): median [worst, its seed]:")
        L.append("")
        L.append("| workload | llm-d target | " + " | ".join("kvroute (llm-d matched)" if x == "kvroute" else x
                                                       for x in ALL_ARMS if x != "round-robin") + " |")
        L.append("|---|---|" + "---|" * (len(ALL_ARMS) - 1))
        for wname, w in a["workloads"].items():
            st = w.get("ratios_over_seeds", {})
            tgt = w.get("target")
            tgt_s = "–" if tgt is None else (f"≥ {tgt:g}×" if tgt > 1 else "≥ parity")
            cells = [f"{st[x]['median']:.2f}× [{st[x]['worst']:.2f}×, {st[x]['worst_seed']}]"
                     + (f" ‡{','.join(st[x]['host_limited'])}" if st[x].get("host_limited") else "")
                     if x in st else "–" for x in ALL_ARMS if x != "round-robin"]
            L.append(f"| {wname} | {tgt_s} | " + " | ".join(cells) + " |")
        L.append("")
        L.append("Knee rates (req/s, seed by seed as above; median in bold): the highest offered rate within "
                 "the SLO. Where two arms share a seed's knee rate they were offered the same requests of that seed, "
                 "and their knee throughputs differ only by errors (< 1 %) and the stage's span (the drain after its "
                 "last arrival):")
        L.append("")
        L.append("| workload | " + " | ".join(ALL_ARMS) + " |")
        L.append("|---|" + "---|" * len(ALL_ARMS))
        for wname, w in a["workloads"].items():
            kr = w.get("knee_rates", {})
            cells = [", ".join(f"{kr[x]['by_seed'][s]:g}" for s in sorted(kr[x]["by_seed"], key=int))
                     + f" · **{kr[x]['median']:g}**" if x in kr else "–" for x in ALL_ARMS]
            L.append(f"| {wname} | " + " | ".join(cells) + " |")
        L.append("")
        if any(st.get("host_limited") for w in a["workloads"].values()
               for st in w.get("ratios_over_seeds", {}).values()):
            L.append(f"‡ seeds whose ramp ended at a stage where the emulator's host lagged ≥ {a['slo_s']:g} s "
                     "(model time): the shared machine, not only the routing, may have set that knee.")
            L.append("")
    for wname, w in a["workloads"].items():
        if not w.get("report_ceiling"):
            continue
        # One row per arm: each seed's lowest hit / ceiling over the stages up to its knee (the target's
        # reading: the whole ramp a router would serve within the SLO), and the stage that set it.
        # Every stage's value is in the results JSON (`hit_over_ceiling`).
        kr = w.get("knee_rates", {})
        wseeds = sorted({seed for seed, *_ in ceiling_rows(w)}, key=int)
        L.append(f"{wname}: hit ratio ÷ the stream's ceiling (the fraction of prompt tokens one infinite cache "
                 "could serve: blocks an earlier request already had), the lowest over the stages up to the "
                 "seed's knee, and that stage's rate; by seed:")
        L.append("")
        L.append("| arm | " + " | ".join(f"seed {s}" for s in wseeds) + " |")
        L.append("|---|" + "---|" * len(wseeds))
        by = {}
        for seed, arm, rate, _h, _c, hc in ceiling_rows(w):
            by.setdefault(arm, {}).setdefault(seed, []).append((rate, hc))
        for arm, per_seed in by.items():
            cells = []
            for s in wseeds:
                knee = (kr.get(arm, {}).get("by_seed") or {}).get(s)
                vals = [(hc, rate) for rate, hc in per_seed.get(s, [])
                        if hc is not None and knee is not None and rate <= knee]
                cells.append(f"{min(vals)[0]:.3f} ({min(vals)[1]:g}/s)" if vals else "–")
            L.append(f"| {arm} | " + " | ".join(cells) + " |")
        L.append("")
    for wname, w in a["workloads"].items():
        L.append(f"### {wname}")
        L.append("")
        wseeds = list(w.get("seeds") or {})
        L.append(f"{w['what']}. Time scale {w['time_scale']}×, {w['stage_s']:g} s (model) per stage; "
                 f"rates {', '.join(f'{x:g}' for x in w['rates'])} req/s. "
                 + (describe_parts(wname, w["parts"]) if w.get("parts")
                    else f"Run of {describe_run(w['run'])}. " if len(runs) > 1 and w.get("run") else "")
                 + (f"The table and plot are seed {wseeds[0]}'s. " if len(wseeds) > 1 else "")
                 + f"![{wname}]({img_rel}/quality-{wname}.svg)")
        L.append("")
        L.append("| arm | knee req/s | throughput at knee | hit % | prefill busy | busiest server's share | TTFT p90 s | "
                 "branches sticky / release / no-affinity: knee stage (whole run\\*) |")
        L.append("|---|---|---|---|---|---|---|---|")
        for arm, res in w["arms"].items():
            if "error" in res:
                L.append(f"| {arm} | failed: {res['error'][:80]} | | | | | | |")
                continue
            k = res.get("knee")
            br = branches_cell(arm, res, k)
            if k:
                L.append(f"| {arm} | {k['rate']:g} | {k['throughput']:,.0f} {k['metric']} | "
                         f"{fmt(k['hit_ratio'] and k['hit_ratio'] * 100, '.0f')} | {prefill_busy(k, f)} | "
                         f"{fmt(k['max_token_share'] and k['max_token_share'] * 100, '.0f')} % | "
                         f"{k['ttft_p90_s']:.2f} | {br} |")
            else:
                L.append(f"| {arm} | none (first stage over the SLO) | | | | | | {br} |")
        L.append("")
        if stages:
            L.append("| arm | rate | req | err % | TTFT p50 | TTFT p90 | TPOT p90 (ms) | in tok/s | out tok/s | hit % | "
                     "server shares of prompt tokens % | host lag (s) | branches sticky / release / no-affinity |")
            L.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
            for arm, res in w["arms"].items():
                for s in res.get("stages", []):
                    shares = "/".join(f"{x * 100:.0f}" for x in s["token_shares"]) or "–"
                    L.append(f"| {arm} | {s['rate']:g} | {s['requests']} | {s['error_rate'] * 100:.1f} | "
                             f"{fmt(s['ttft_p50_s'], '.2f')} | {fmt(s['ttft_p90_s'], '.2f')} | "
                             f"{fmt(s['tpot_p90_s'] and s['tpot_p90_s'] * 1000, '.0f')} | {s['input_tps']:,.0f} | "
                             f"{s['output_tps']:,.0f} | {fmt(s['hit_ratio'] and s['hit_ratio'] * 100, '.0f')} | "
                             f"{shares} | {fmt(s['host_lag_s'], '.1f')} | {branch_triple(s.get('router')) or '–'} |")
            L.append("")
    return "\n".join(L) + "\n"


def branch_triple(c):
    """`sticky / release / no-affinity` of the filter's branch counters, or None without them."""
    if not c:
        return None
    return (f"{c.get('branch_sticky', 0)} / {c.get('branch_saturation_release', 0)} / "
            f"{c.get('branch_no_affinity', 0)}")


def branches_cell(arm, res, k):
    """The knee stage's branch counts; runs from before per-stage counters give the whole run's (marked *)."""
    if arm == "legacy-blend":  # no affinity filter: every decision is the unfiltered branch
        return "–"
    if k:
        for s in res.get("stages", []):
            if s["rate"] == k["rate"] and s.get("router") is not None:
                return branch_triple(s["router"]) or "–"
    whole = branch_triple(res.get("envoy_stats"))
    return f"{whole}\\*" if whole else "–"


def run_of(results):
    """The provenance of one quality.py run."""
    return {k: results.get(k) for k in ("started", "commit", "command", "wall_min")}


def describe_part(part):
    seeds = f"seed{'s' if len(part['seeds']) > 1 else ''} {', '.join(part['seeds'])}"
    if not part.get("arms"):
        return seeds
    said = f"{', '.join(part['arms'])} on {seeds}, over that run's round robin"
    if part.get("replaced"):
        said += f"; its {', '.join(part['replaced'])} replace{'s' if len(part['replaced']) == 1 else ''} the earlier runs'"
    return said


def describe_parts(wname, parts):
    """A merged workload's provenance in one sentence; which arms and seeds each run gave, and its command,
    stay in the results JSON (`workloads.W.parts`), not in benchmarks.md."""
    days = sorted(x["run"].get("started", "")[:10] for x in parts)
    commits = [x["run"].get("commit") or "not recorded" for x in parts]
    span = days[0] if days[0] == days[-1] else f"{days[0]} to {days[-1]}"
    return (f"{len(parts)} runs, {span} (commits {commits[0]} to {commits[-1]}); each run's command, commit and "
            f"the arms and seeds it gave: `workloads.{wname}.parts` in the results JSON. ")


def describe_run(run):
    return (f"{run.get('started')} (commit {run.get('commit') or 'not recorded'}), `{run.get('command')}`, "
            f"{run.get('wall_min') or 0:.0f} min")


# What two runs of one workload must share for their seeds to be pooled.
SAME_SCENARIO = ("what", "bound", "time_scale", "stage_s", "rates", "loadgen_extra")


def arms_of(runs):
    return {arm for arm in runs if arm != "round-robin"}


def covers(new, old):
    """Whether run `new` of a workload holds every seed and every arm that `old` holds: a re-run, which
    replaces `old` whole. Otherwise `new` is merged into it (`merge_workload`)."""
    old_seeds, new_seeds = old.get("seeds") or {}, new.get("seeds")
    if not new_seeds:
        return True
    return all(seed in new_seeds and set(runs) <= set(new_seeds[seed]) for seed, runs in old_seeds.items())


def merge_workload(path, old, new):
    """Add run `new` of one workload to `old` (same scenario): seeds it alone holds are pooled; its arms in a
    seed `old` holds join that seed, or replace the same arm there (an arm re-run side by side with
    another), each keeping `new`'s round robin (`round_robin`), which its ratios divide by. The tables and
    plot stay on `old`'s first seed; `parts` names each run's seeds and arms, and the arms it replaced."""
    for key in SAME_SCENARIO:
        if old.get(key) != new.get(key):
            raise ValueError(f"{path}: workload {key} {new.get(key)!r} differs from the earlier run's {old.get(key)!r}")
    old.setdefault("parts", [{"run": old["run"], "seeds": list(old["seeds"]), "arms": None}])
    added, replaced = set(), set()
    for seed, runs in new["seeds"].items():
        if seed not in old["seeds"]:
            old["seeds"][seed] = runs
            continue
        rr = runs.get("round-robin")
        if rr is None:
            raise ValueError(f"{path}: seed {seed} adds arms to an earlier run without a round robin to divide by")
        for arm in arms_of(runs):
            if arm in old["seeds"][seed]:
                replaced.add(arm)
            old["seeds"][seed][arm] = dict(runs[arm], round_robin=rr)
            added.add(arm)
    old["parts"].append({"run": new["run"], "seeds": list(new["seeds"]), "arms": sorted(added) or None,
                         "replaced": sorted(replaced) or None})
    old["arms"] = old["seeds"][next(iter(old["seeds"]))]


def merge_results(paths):
    """Several results.json of one fleet and SLO as one: each workload keeps its run's provenance (`run`); a
    workload found in more than one run comes from the last when that run holds all of the earlier one's
    seeds and arms; otherwise the later run's seeds and arms of the same scenario are added, and its arms
    replace the same arms of the seeds both hold (`merge_workload`)."""
    merged = None
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        for run in (r.get("runs") or [run_of(r)]):
            for w in r["workloads"].values():
                w.setdefault("run", run)
        if merged is None:
            merged = r
            merged["runs"] = list(r.get("runs") or [run_of(r)])
            continue
        for key in ("fleet", "slo_s", "penalty_ms", "metrics_poll_ms", "envoy_concurrency", "smoke"):
            if r.get(key) != merged.get(key):
                raise ValueError(f"{path}: {key} {r.get(key)!r} differs from {paths[0]}'s {merged.get(key)!r}")
        for name, w in r["workloads"].items():
            old = merged["workloads"].get(name)
            if old is not None and w["run"] in [old["run"]] + [x["run"] for x in old.get("parts", [])]:
                continue  # this run is in it already (re-rendering a merged file with one of its parts)
            if old is not None and not covers(w, old):
                merge_workload(path, old, w)
            else:
                merged["workloads"][name] = w
        merged["runs"] += r.get("runs") or [run_of(r)]
    if merged is not None:
        order = {name: i for i, name in enumerate(WORKLOADS)}
        merged["workloads"] = dict(sorted(merged["workloads"].items(), key=lambda kv: order.get(kv[0], len(order))))
    return merged


def prefill_busy(k, fleet):
    """Share of the fleet's prefill capacity the knee stage used: uncached input tok/s / (N x prefill tok/s)."""
    if k.get("metric") != "input tok/s" or k.get("hit_ratio") is None:
        return "–"
    return f"{k['throughput'] * (1 - k['hit_ratio']) / (fleet['endpoints'] * fleet['prefill_tps']) * 100:.0f} %"


def write_section(path, text):
    """Replace (or append) our own section of docs/benchmarks.md; leave the others alone."""
    old = open(path).read() if os.path.exists(path) else "# kvroute benchmarks\n\n"
    lines = old.splitlines(keepends=True)
    start = next((i for i, l in enumerate(lines) if l.rstrip("\n") == SECTION), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + text
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        new = "".join(lines[:start]) + text + ("\n" if end < len(lines) else "") + "".join(lines[end:])
    with open(path, "w") as f:
        f.write(new)


def publish(args, results):
    if not args.out:
        return
    os.makedirs(args.img_dir, exist_ok=True)
    for wname, w in results["workloads"].items():
        plots.write_workload_svg(os.path.join(args.img_dir, f"quality-{wname}.svg"), wname, w, results["slo_s"])
    img_rel = os.path.relpath(args.img_dir, os.path.dirname(os.path.abspath(args.out)))
    text = markdown(results, img_rel, stages=args.stages)
    if not results.get("smoke") and os.path.exists(ANALYSIS):
        text += "\n" + open(ANALYSIS).read().strip() + "\n"
    write_section(args.out, text)
    log(f"wrote {args.out} and plots in {args.img_dir}")


def print_headlines(results):
    print("\nHeadline: throughput at the TTFT knee (TTFT p90 <= %g s), versus Envoy round robin, same run:" % results["slo_s"])
    for wname, w in results["workloads"].items():
        rr = w["arms"].get("round-robin", {}).get("knee")
        tgt = w.get("target")
        for arm, res in w["arms"].items():
            k = res.get("knee")
            ratio = w.get("ratios_vs_rr", {}).get(arm)
            if "error" in res:
                desc = "FAILED"
            elif k is None:
                desc = "no stage within the SLO"
            else:
                desc = f"knee {k['rate']:g} req/s, {k['throughput']:,.0f} {k['metric']}"
                if ratio is not None:
                    desc += f"  => {ratio:.2f}x round robin"
                    ri = w.get("ratios_vs_rr_interp", {}).get(arm)
                    if ri is not None:
                        desc += f" (interpolated {ri:.2f}x)"
            if arm in ("kvroute", "active-request") and tgt is not None and ratio is not None and not results["smoke"]:
                desc += f"  (llm-d target {tgt:g}x: {'met' if ratio >= tgt else 'MISSED'})"
            print(f"  {wname:<20} {arm:<16} {desc}")
        if rr is None and "round-robin" in w["arms"]:
            print(f"  {wname:<20} (round robin has no stage within the SLO; ratios undefined)")
        if len(results.get("seeds") or [1]) > 1:
            for arm, st in w.get("ratios_over_seeds", {}).items():
                print(f"  {wname:<20} {arm:<16} over seeds: median {st['median']:.2f}x, worst {st['worst']:.2f}x "
                      f"(seed {st['worst_seed']})")
        if w.get("report_ceiling"):
            for seed, arm, rate, h, c, hc in ceiling_rows(w):
                print(f"  {wname:<20} {arm:<16} seed {seed} rate {rate:g}: hit {fmt(h, '.3f')} / ceiling "
                      f"{fmt(c, '.3f')} = {fmt(hc, '.3f')}")


def reject_ab_rows(results):
    """(workload, seed, arm, stage label, hit without, hit with, with - without, hit/ceiling without,
    hit/ceiling with, rejected/sent) per stage of each --reject-ab pair."""
    rows = []
    for wname, w in results["workloads"].items():
        for run in w["runs"]:
            a, b = run["without"].get("stages") or [], run["with"].get("stages") or []
            for sa, sb in zip(a, b):
                ha, hb = sa["hit_ratio"], sb["hit_ratio"]
                r = sb.get("reject_stream") or {}
                rows.append((wname, run["seed"], run["arm"], sa["label"], ha, hb,
                             hb - ha if ha is not None and hb is not None else None,
                             sa.get("hit_over_ceiling"), sb.get("hit_over_ceiling"),
                             f"{r.get('rejected', 0)}/{r.get('sent', 0)}"))
    return rows


def print_reject_ab(results):
    rs = results["reject_stream"]
    print(f"\nHit ratio with and without a stream of rejected (over-length, HTTP 400) requests: "
          f"{rs['rate']:g} req/s (model time) of {rs['tokens']} tokens; target: the stream costs <= 0.02")
    print("| workload | seed | arm | stage | hit without | hit with | with − without | ÷ ceiling without "
          "| ÷ ceiling with | rejected / sent |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for wname, seed, arm, label, ha, hb, d, ca, cb, rej in reject_ab_rows(results):
        print(f"| {wname} | {seed} | {arm} | {label} | {fmt(ha, '.3f')} | {fmt(hb, '.3f')} | {fmt(d, '+.3f')} "
              f"| {fmt(ca, '.3f')} | {fmt(cb, '.3f')} | {rej} |")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CI smoke: tiny workloads, one short stage per arm")
    p.add_argument("--workloads", default=None, help="comma list (default: all: " + ",".join(WORKLOADS) + ")")
    p.add_argument("--arms", default=None, help="comma list overriding each workload's arms (" + ",".join(ALL_ARMS) + ",kvroute-18s,kvroute-output-est)")
    p.add_argument("--out", default=None, help="Markdown file whose '" + SECTION + "' section is (re)written "
                   "(default docs/benchmarks.md for a full run, nothing for --smoke)")
    p.add_argument("--img-dir", default=None,
                   help="where the SVG plots go (default: docs/img when --out is the default, else img/ beside --out)")
    p.add_argument("--results", default=None, help="copy results.json here (default: sim/bench/results/quality.json when --out is the default, "
                        "docs/benchmarks.md; none with another --out)")
    p.add_argument("--work-dir", default=None, help="logs, configs and raw JSON (default: a new temp dir)")
    p.add_argument("--target-dir", default=os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target"))
    p.add_argument("--no-build", action="store_true", help="use the binaries already in --target-dir")
    p.add_argument("--bin-profile", choices=["release", "debug"], default="release",
                   help="cargo profile of the emulator and load generator (the module is always release); "
                   "scripts/test.sh runs the smoke with debug binaries it already built [release]")
    p.add_argument("--smg-venv", default=os.path.join(os.path.expanduser("~"), ".cache", "kvroute-bench", f"smg-{SMG_VERSION}"))
    p.add_argument("--slo-s", type=float, default=2.0, help="TTFT p90 objective that defines the knee (model s) [2]")
    p.add_argument("--stop-factor", type=float, default=4.0, help="stop a ramp after TTFT p90 > this x SLO [4]")
    p.add_argument("--penalty-ms", type=float, default=2000.0, help="maxTTFTPenaltyMs of the kvroute arms [2000]")
    p.add_argument("--metrics-poll-ms", type=int, default=100, help="kvroute collector /metrics poll period, wall ms [100]")
    p.add_argument("--envoy-concurrency", type=int, default=2)
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="wall-clock limit per request [300]")
    p.add_argument("--seed", type=int, default=1, help="kvroute-loadgen --seed (prompts and arrivals) [1]")
    p.add_argument("--seeds", default=None,
                   help="comma list: run every (workload, arm) once per seed and report, per workload, the median "
                   "and the worst seed of knee / round robin (same seed) [--seed]")
    p.add_argument("--kv-blocks", type=int, default=None, help=f"override KV blocks per server [{FLEET['num_gpu_blocks']}]")
    p.add_argument("--rates", default=None, help="override the offered rates of every selected workload (comma list)")
    p.add_argument("--time-scale", type=int, default=None,
                   help="override every selected workload's time scale (model s per wall s); lower it when the "
                        "emulator's host lags at the top stages")
    p.add_argument("--loadgen-extra", default=None, help="extra kvroute-loadgen flags for every selected workload, "
                   "e.g. '--output-tokens 250' (what-if runs)")
    p.add_argument("--stages", action="store_true", help="also write every stage's row into the Markdown section (long)")
    p.add_argument("--reject-ab", type=float, default=None, metavar="RATE",
                   help="A/B of issue 40 point 1: per seed and arm, run the workload alone and then with a second "
                   "client sending RATE over-length requests per model second (kvroute-loadgen --reject-stream), "
                   "and print both hit ratios side by side (default workload agent-session, arm kvroute-default, "
                   "--rates 6,6: a warm-up stage and a measured one, --time-scale 2); writes no docs")
    p.add_argument("--reject-tokens", type=int, default=49152,
                   help="--reject-ab: the rejected prompts' length in tokens, above the emulator's --max-model-len "
                   "(40960) [49152]")
    p.add_argument("--from-results", default=None, metavar="JSON[,JSON...]",
                   help="run nothing: rewrite the Markdown section and plots from the results.json of earlier runs "
                   "(a comma list: one fleet and SLO, a workload in several files comes from the last; --results "
                   "then gets the merged file)")
    args = p.parse_args(argv)
    if args.reject_ab is not None:
        if not args.reject_ab > 0:
            p.error("--reject-ab: a positive rate")
        args.workloads = args.workloads or "agent-session"
        args.rates = args.rates or "6,6"
        # A refused request is in flight for wall time (Envoy buffering its body, the server tokenizing it
        # before the 400); a time scale multiplies that into model time. At agent-session's 10 the stream's
        # cost is 4-6x what it is at 2 (docs/lab/2026-12-06-rejected-stream-residual.md).
        args.time_scale = args.time_scale or 2
    args.workloads = args.workloads.split(",") if args.workloads else list(WORKLOADS)
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r}")
    args.arms = args.arms.split(",") if args.arms else None
    try:
        args.seeds = [int(x) for x in args.seeds.split(",")] if args.seeds else [args.seed]
    except ValueError:
        p.error(f"--seeds {args.seeds!r}: a comma list of integers")
    if len(set(args.seeds)) != len(args.seeds):
        p.error("--seeds: a seed is listed twice")
    if args.smoke:
        args.request_timeout_s = min(args.request_timeout_s, 60.0)
    if args.kv_blocks:
        FLEET["num_gpu_blocks"] = args.kv_blocks
    if args.loadgen_extra:
        for w in WORKLOADS.values():
            w["loadgen"] = w["loadgen"] + args.loadgen_extra.split()
            w["what"] += f"; what-if: `{args.loadgen_extra}`"
    if args.rates:
        for w in WORKLOADS.values():
            w["rates"] = [float(x) for x in args.rates.split(",")]
    if args.time_scale:
        for w in WORKLOADS.values():
            w["time_scale"] = args.time_scale
    # The committed results file goes with the docs: a run or re-render sent elsewhere (--out) leaves it alone
    # unless --results names it.
    if args.out is None and not args.smoke and args.reject_ab is None:
        args.out = os.path.join(REPO, "docs", "benchmarks.md")
        if args.results is None:
            args.results = os.path.join(HERE, "results", "quality.json")
        if args.img_dir is None:
            args.img_dir = os.path.join(REPO, "docs", "img")
    if args.img_dir is None and args.out:
        args.img_dir = os.path.join(os.path.dirname(os.path.abspath(args.out)), "img")

    if args.from_results:
        try:
            results = merge_results(args.from_results.split(","))
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"quality.py: --from-results: {e}")
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            with open(args.results, "w") as f:
                json.dump(results, f, indent=1)
        for w in results["workloads"].values():
            add_headlines(w, results["slo_s"])
        publish(args, results)
        print_headlines(results)
        return 0

    t0 = time.time()
    if not args.no_build:
        build(args.target_dir, args.bin_profile)
    bench = Bench(args)
    for path in (bench.emulator, bench.loadgen, bench.wasm):
        if not os.path.exists(path):
            sys.exit(f"quality.py: {path} is missing; build without --no-build or set --target-dir")
    bench.envoy = find_envoy()
    log(f"work dir {bench.work}")

    def on_signal(signum, _frame):
        bench.procs.stop_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    if args.reject_ab is not None:
        results, failures = bench.run_reject_ab()
        results["wall_min"] = (time.time() - t0) / 60
        bench.save(results)
        if args.results:
            os.makedirs(os.path.dirname(os.path.abspath(args.results)), exist_ok=True)
            shutil.copy(os.path.join(bench.work, "results.json"), args.results)
        print_reject_ab(results)
        print(f"\n(total {results['wall_min']:.1f} min; logs and raw JSON in {bench.work})")
        if failures:
            print("\nFAILED runs:\n  " + "\n  ".join(failures), file=sys.stderr)
            return 1
        return 0
    results, failures = bench.run()
    results["wall_min"] = (time.time() - t0) / 60
    results["stop_factor"] = args.stop_factor
    bench.save(results)
    if args.results:
        os.makedirs(os.path.dirname(args.results), exist_ok=True)
        shutil.copy(os.path.join(bench.work, "results.json"), args.results)
    publish(args, results)
    print_headlines(results)
    print(f"\n(total {results['wall_min']:.1f} min; logs and raw JSON in {bench.work})")
    if failures:
        print("\nFAILED arms:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
