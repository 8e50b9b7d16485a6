#!/usr/bin/env python3
"""Draws docs/grafana/kvroute.json's panels from real /stats/prometheus scrapes.

No Grafana package is available here (apt has none, the PyPI `grafana` is an
empty placeholder), so this stands in for one: it evaluates each panel's
PromQL (only the forms the dashboard uses: sum/max [by (label)] of a gauge,
sum(rate(counter)), histogram_quantile over rate(buckets), and a ratio of
two of these) over scrapes taken every --interval seconds, and draws the
panels in the dashboard's grid with matplotlib.

  # start an emulated fleet and Envoy+kvroute, drive a workload, scrape, draw
  python3 docs/grafana/render_dashboard.py --run --seconds 60 --out docs/img/grafana-kvroute.png
  # or scrape an Envoy that is already running (e.g. scripts/demo.sh's)
  python3 docs/grafana/render_dashboard.py --scrape http://127.0.0.1:9901/stats/prometheus --seconds 60
  # redraw from saved scrapes
  python3 docs/grafana/render_dashboard.py --load /tmp/scrapes.json

`$__rate_interval` is --rate-window (default 10 s: the run is short).
--run needs the release module and the emulator built (see envoy/README.md).
Drawing needs matplotlib (`python3 -m pip install matplotlib`); scraping does not.
"""

import argparse
import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NEEDS_MATPLOTLIB = ("render_dashboard: drawing needs matplotlib: python3 -m pip install matplotlib "
                    "(or pass --save FILE to keep the scrapes and draw them later with --load)")
LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")


def parse(text):
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m and m.group(1).startswith("kvroute_"):
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


# ---------------------------------------------------------------- evaluator

def _series(scrapes, name):
    """{labels: [values per scrape]} of one metric name."""
    keys = {k[1] for s in scrapes for k in s["samples"] if k[0] == name}
    return {lab: [s["samples"].get((name, lab)) for s in scrapes] for lab in keys}


def _rate(times, values, window):
    out = []
    for i, t in enumerate(times):
        j = i
        while j > 0 and t - times[j - 1] <= window:
            j -= 1
        if j == i or values[i] is None or values[j] is None:
            out.append(None)
        else:
            out.append(max(0.0, values[i] - values[j]) / (t - times[j]))
    return out


def _aggregate(series, op, by):
    groups = {}
    for lab, vals in series.items():
        key = tuple((k, v) for k, v in lab if k in by)
        groups.setdefault(key, []).append(vals)
    out = {}
    for key, rows in groups.items():
        col = []
        for vals in zip(*rows):
            vs = [v for v in vals if v is not None]
            col.append(None if not vs else (sum(vs) if op == "sum" else max(vs)))
        out[key] = col
    return out


def _quantile(q, buckets):
    """Prometheus' histogram_quantile over {le: rate}."""
    bs = sorted((float("inf") if le == "+Inf" else float(le), r) for le, r in buckets.items())
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    prev_le, prev_c = 0.0, 0.0
    for le, c in bs:
        if c >= rank:
            if le == float("inf"):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_le, prev_c = le, c
    return prev_le


def evaluate(expr, scrapes, window):
    """{legend key (label tuple): [value per scrape]} for the dashboard's forms."""
    expr = expr.replace("$__rate_interval", f"{window}s").strip()
    times = [s["t"] for s in scrapes]
    m = re.fullmatch(r"(.+?\))\s*/\s*(.+)", expr)
    if m and not expr.startswith("histogram_quantile"):
        a, b = evaluate(m.group(1), scrapes, window), evaluate(m.group(2), scrapes, window)
        (_, av), (_, bv) = next(iter(a.items())), next(iter(b.items()))
        return {(): [x / y if x is not None and y else None for x, y in zip(av, bv)]}
    m = re.fullmatch(r"histogram_quantile\(([0-9.]+),\s*sum by \(le\) \(rate\((\w+)\[\w+\]\)\)\)", expr)
    if m:
        q, name = float(m.group(1)), m.group(2)
        rates = {dict(lab)["le"]: _rate(times, vals, window) for lab, vals in _series(scrapes, name).items()}
        return {(): [_quantile(q, {le: r[i] or 0.0 for le, r in rates.items()}) for i in range(len(times))]}
    m = re.fullmatch(r"(sum|max)(?: by \((\w+)\))?\s*\((rate\()?(\w+)(?:\[\w+\]\))?\)", expr)
    if m:
        op, by, is_rate, name = m.group(1), m.group(2), m.group(3), m.group(4)
        series = _series(scrapes, name)
        if is_rate:
            series = {lab: _rate(times, vals, window) for lab, vals in series.items()}
        return _aggregate(series, op, {by} if by else set())
    raise ValueError(f"unsupported expression: {expr}")


# ---------------------------------------------------------------- drawing

def draw(dashboard, scrapes, out, window):
    try:
        import matplotlib
    except ImportError:
        sys.exit(NEEDS_MATPLOTLIB)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = scrapes[0]["t"]
    xs = [s["t"] - t0 for s in scrapes]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dashboard["panels"])
    fig = plt.figure(figsize=(18, rows * 0.55 + 1.0), facecolor="#111217")
    fig.suptitle(f"Grafana dashboard \"{dashboard['title']}\" (docs/grafana/kvroute.json), drawn from "
                 f"{len(scrapes)} /stats/prometheus scrapes over {xs[-1]:.0f} s; rate window {window} s",
                 color="#d8d9da", fontsize=12)
    grid = fig.add_gridspec(rows, 24, hspace=3.2, wspace=0.6, top=0.93, bottom=0.04, left=0.03, right=0.99)
    for p in dashboard["panels"]:
        g = p["gridPos"]
        ax = fig.add_subplot(grid[g["y"]:g["y"] + g["h"], g["x"]:g["x"] + g["w"]])
        ax.set_facecolor("#181b1f")
        for side in ax.spines.values():
            side.set_color("#2c3235")
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        unit = p["fieldConfig"]["defaults"].get("unit", "")
        ax.set_title(p["title"], color="#d8d9da", fontsize=10, loc="left")
        results = []
        for target in p["targets"]:
            for key, vals in sorted(evaluate(target["expr"], scrapes, window).items()):
                legend = target["legendFormat"]
                for k, v in key:
                    legend = legend.replace("{{" + k + "}}", v)
                results.append((legend, vals))
        if p["type"] == "timeseries":
            for legend, vals in results:
                ax.plot(xs, [float("nan") if v is None else v for v in vals], label=legend, linewidth=1.4)
            ax.set_xlabel("s", color="#9fa7b3", fontsize=8)
            ax.set_ylabel(unit, color="#9fa7b3", fontsize=8)
            ax.grid(color="#2c3235", linewidth=0.5)
            ax.legend(fontsize=7, facecolor="#181b1f", edgecolor="#2c3235", labelcolor="#d8d9da", loc="upper left")
        else:
            ax.set_xticks([])
            ax.set_yticks([])
            n = len(results)
            for i, (legend, vals) in enumerate(results):
                last = next((v for v in reversed(vals) if v is not None), None)
                text = "–" if last is None else (f"{last * 100:.1f} %" if unit == "percentunit" else f"{last:g}")
                x = (i + 0.5) / n
                ax.text(x, 0.55, text, color="#73bf69", fontsize=26, ha="center", va="center", transform=ax.transAxes)
                ax.text(x, 0.2, legend, color="#9fa7b3", fontsize=9, ha="center", transform=ax.transAxes)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=80, facecolor=fig.get_facecolor())
    print(f"wrote {out}")


# ---------------------------------------------------------------- workload

def _free_ports(n):
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _post(port, body, headers=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()
    except OSError:
        pass


def run_fleet(seconds, interval, tmp):
    """Emulated fleet (3 endpoints) + Envoy+kvroute on 127.0.0.1, a workload of
    4 tenants (8 KiB shared prefixes) on 6 threads, scraped every interval."""
    emulator = os.path.join(REPO, "target", "debug", "kvroute-emulator")
    wasm = os.path.join(REPO, "target", "wasm32-wasip1", "release", "kvroute_wasm.wasm")
    eports = _free_ports(3)
    port, admin = _free_ports(2)
    with open(os.path.join(REPO, "envoy", "kvroute-config.json")) as f:
        cfg = json.load(f)
    cfg["sharedState"] = {"indexBudgetBytes": 1 << 20}  # 256 shards: swept every second
    os.makedirs(tmp, exist_ok=True)
    cfg_path = os.path.join(tmp, "plugin.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    procs = []
    try:
        procs.append(subprocess.Popen([emulator, "--ports", ",".join(map(str, eports)), "--model", "tiny"],
                                      stdout=open(os.path.join(tmp, "emulator.log"), "wb"), stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen(
            [os.path.join(REPO, "envoy", "run.sh"), "--endpoints", ",".join(f"127.0.0.1:{p}" for p in eports),
             "--listen-port", str(port), "--admin-port", str(admin), "--plugin-config", cfg_path, "--wasm", wasm,
             "--log-level", "warning"],
            stdout=open(os.path.join(tmp, "envoy.log"), "wb"), stderr=subprocess.STDOUT))
        url = f"http://127.0.0.1:{admin}/stats/prometheus"
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if b"kvroute_endpoints" in urllib.request.urlopen(url, timeout=2).read():
                    break
            except OSError:
                pass
            time.sleep(0.3)
        stop = threading.Event()
        rng = random.Random(18)
        prefixes = [" ".join(f"tenant{t} w{i}" for i in range(900)) for t in range(4)]

        def worker(k):
            r = random.Random(k)
            while not stop.is_set():
                phase = (time.time() - start) / seconds
                tenant = r.randrange(4 if phase > 0.3 else 2)
                delay = r.choice([0, 0, 200, 800]) if phase > 0.5 else 0
                body = {"model": "tiny", "prompt": prefixes[tenant] + f" q{r.random()}", "max_tokens": 16}
                _post(port, body, {"x-emulator-delay-ms": str(delay)})

        start = time.time()
        threads = [threading.Thread(target=worker, args=(rng.random(),), daemon=True) for _ in range(6)]
        for t in threads:
            t.start()
        scrapes = scrape_loop(url, seconds, interval)
        stop.set()
        for t in threads:
            t.join(timeout=35)
        return scrapes
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                p.wait(timeout=10)


def scrape_loop(url, seconds, interval):
    scrapes = []
    end = time.time() + seconds
    while time.time() < end:
        t = time.time()
        try:
            scrapes.append({"t": t, "samples": parse(urllib.request.urlopen(url, timeout=5).read().decode())})
        except OSError as e:
            print(f"scrape failed: {e}", file=sys.stderr)
        time.sleep(max(0.0, interval - (time.time() - t)))
    return scrapes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", action="store_true", help="start a fleet and Envoy, drive a workload, scrape")
    src.add_argument("--scrape", metavar="URL", help="scrape this /stats/prometheus")
    src.add_argument("--load", metavar="FILE", help="saved scrapes (--save)")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--interval", type=float, default=2)
    ap.add_argument("--rate-window", type=int, default=10)
    ap.add_argument("--save", metavar="FILE", help="keep the scrapes here (JSON)")
    ap.add_argument("--dashboard", default=os.path.join(HERE, "kvroute.json"))
    ap.add_argument("--out", default=os.path.join(REPO, "docs", "img", "grafana-kvroute.png"))
    ap.add_argument("--tmp", default="/tmp/kvroute-dashboard")
    args = ap.parse_args()
    if not args.save and importlib.util.find_spec("matplotlib") is None:
        sys.exit(NEEDS_MATPLOTLIB)
    if args.load:
        with open(args.load) as f:
            scrapes = [{"t": s["t"], "samples": {(k[0], tuple(map(tuple, k[1]))): v for k, v in s["samples"]}}
                       for s in json.load(f)]
    elif args.run:
        scrapes = run_fleet(args.seconds, args.interval, args.tmp)
    else:
        scrapes = scrape_loop(args.scrape, args.seconds, args.interval)
    if args.save:
        with open(args.save, "w") as f:
            json.dump([{"t": s["t"], "samples": [[list(k), v] for k, v in s["samples"].items()]} for s in scrapes], f)
    if len(scrapes) < 3:
        sys.exit(f"only {len(scrapes)} scrapes; nothing to draw")
    with open(args.dashboard) as f:
        dashboard = json.load(f)
    draw(dashboard, scrapes, args.out, args.rate_window)


if __name__ == "__main__":
    main()
