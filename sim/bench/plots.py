"""Hand-written SVG line plots for sim/bench/quality.py (standard library only).

One figure per workload, two panels side by side:
  left:  TTFT p90 (model s, log scale) against offered load, with the SLO line;
  right: throughput (input tok/s, or output tok/s for decode-bound) against offered load.
"""

import math
from xml.sax.saxutils import escape

COLORS = {
    "round-robin": "#666666",
    "kvroute": "#d62728",
    "always-sticky": "#ff7f0e",
    "legacy-blend": "#2ca02c",
    "active-request": "#9467bd",
    "smg-cache-aware": "#1f77b4",
    "kvroute-18s": "#8c564b",
    "kvroute-output-est": "#e377c2",
}
DASH = {"round-robin": "6,4", "smg-cache-aware": "2,3"}


def _nice_ticks(lo, hi, n=5):
    if hi <= lo:
        hi = lo + 1
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    start = math.floor(lo / step) * step
    ticks = []
    t = start
    while t <= hi + step * 1e-9:
        if t >= lo - step * 1e-9:
            ticks.append(round(t, 10))
        t += step
    return ticks, step


def _fmt_num(v):
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


def _panel(x0, y0, w, h, series, xlabel, ylabel, log_y=False, hline=None, title="", hline_label=None):
    """series: list of (name, [(x, y)]) ; returns SVG elements."""
    out = []
    xs = [x for _, pts in series for x, _ in pts]
    ys = [y for _, pts in series for _, y in pts if y is not None and y > 0 or (not log_y and y is not None)]
    if hline is not None:
        ys.append(hline)
    if not xs or not ys:
        out.append(f'<text x="{x0 + w / 2}" y="{y0 + h / 2}" text-anchor="middle">no data</text>')
        return out
    xmin, xmax = 0.0, max(xs) * 1.05
    if log_y:
        pos = [y for y in ys if y > 0]
        ymin = 10 ** math.floor(math.log10(min(pos)))
        ymax = 10 ** math.ceil(math.log10(max(pos)))
        if ymax <= ymin:
            ymax = ymin * 10

        def fy(v):
            v = max(v, ymin)
            return y0 + h - (math.log10(v) - math.log10(ymin)) / (math.log10(ymax) - math.log10(ymin)) * h
        yt = []
        e = math.log10(ymin)
        while e <= math.log10(ymax) + 1e-9:
            yt.append(10 ** e)
            e += 1
    else:
        ymin, ymax = 0.0, max(ys) * 1.1 or 1.0
        yt, _ = _nice_ticks(ymin, ymax)
        ymax = max(ymax, yt[-1])

        def fy(v):
            return y0 + h - (v - ymin) / (ymax - ymin) * h
    xt, _ = _nice_ticks(xmin, xmax)
    xmax = max(xmax, xt[-1])

    def fx(v):
        return x0 + (v - xmin) / (xmax - xmin) * w

    out.append(f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>')
    for t in xt:
        X = fx(t)
        out.append(f'<line x1="{X:.1f}" y1="{y0}" x2="{X:.1f}" y2="{y0 + h}" stroke="#eee"/>')
        out.append(f'<text x="{X:.1f}" y="{y0 + h + 16}" text-anchor="middle" font-size="11">{_fmt_num(t)}</text>')
    for t in yt:
        Y = fy(t)
        out.append(f'<line x1="{x0}" y1="{Y:.1f}" x2="{x0 + w}" y2="{Y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{Y + 4:.1f}" text-anchor="end" font-size="11">{_fmt_num(t)}</text>')
    if hline is not None:
        Y = fy(hline)
        out.append(f'<line x1="{x0}" y1="{Y:.1f}" x2="{x0 + w}" y2="{Y:.1f}" stroke="#000" stroke-dasharray="3,3"/>')
        out.append(f'<text x="{x0 + w - 4}" y="{Y - 4:.1f}" text-anchor="end" font-size="11">{escape(hline_label or f"SLO {hline:g} s")}</text>')
    out.append(f'<text x="{x0 + w / 2}" y="{y0 + h + 34}" text-anchor="middle" font-size="12">{escape(xlabel)}</text>')
    out.append(f'<text transform="translate({x0 - 46},{y0 + h / 2}) rotate(-90)" text-anchor="middle" '
               f'font-size="12">{escape(ylabel)}</text>')
    out.append(f'<text x="{x0 + w / 2}" y="{y0 - 8}" text-anchor="middle" font-size="13" font-weight="bold">'
               f'{escape(title)}</text>')
    for name, pts in series:
        pts = [(x, y) for x, y in pts if y is not None and (y > 0 or not log_y)]
        if not pts:
            continue
        c = COLORS.get(name, "#17becf")
        d = " ".join(f"{fx(x):.1f},{fy(y):.1f}" for x, y in pts)
        dash = f' stroke-dasharray="{DASH[name]}"' if name in DASH else ""
        out.append(f'<polyline points="{d}" fill="none" stroke="{c}" stroke-width="2"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{fx(x):.1f}" cy="{fy(y):.1f}" r="3" fill="{c}"/>')
    return out


def write_workload_svg(path, wname, w, slo_s):
    arms = [(a, r) for a, r in w["arms"].items() if r.get("stages")]
    decode = w.get("bound") == "decode"

    def series(f):
        return [(a, [(s["rate"], f(s)) for s in r["stages"]]) for a, r in arms]

    ttft = series(lambda s: s["ttft_p90_s"])
    tput = series(lambda s: s["output_tps"] if decode else s["input_tps"])
    hits = series(lambda s: None if s["hit_ratio"] is None else s["hit_ratio"] * 100)
    share = series(lambda s: None if s["max_token_share"] is None else s["max_token_share"] * 100)
    W, H = 1080, 780
    pw, ph = 360, 270
    x_label = "offered load (req/s, model time)"
    els = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
           f'font-family="sans-serif">', f'<rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="22" text-anchor="middle" font-size="15" font-weight="bold">'
           f'{escape(wname)}: {len(arms)} arms, same fleet, same run</text>']
    els += _panel(80, 60, pw, ph, ttft, x_label, "TTFT p90 (s, model time)", log_y=True, hline=slo_s,
                  title="TTFT p90 vs load")
    els += _panel(530, 60, pw, ph, tput, x_label, "output tok/s" if decode else "input tok/s",
                  title="throughput vs load")
    els += _panel(80, 430, pw, ph, hits, x_label, "prefix-cache hit % (servers' counters)",
                  title="hit ratio vs load")
    els += _panel(530, 430, pw, ph, share, x_label, "busiest server's % of prompt tokens",
                  hline=100.0 / max(1, len((arms[0][1]["stages"][0].get("token_shares") or [1] * 4)) if arms else 4),
                  title="hot-spotting: busiest server's share", hline_label="even share")
    # legend
    lx, ly = 915, 70
    for i, (a, _) in enumerate(arms):
        c = COLORS.get(a, "#17becf")
        dash = f' stroke-dasharray="{DASH[a]}"' if a in DASH else ""
        els.append(f'<line x1="{lx}" y1="{ly + i * 18}" x2="{lx + 22}" y2="{ly + i * 18}" stroke="{c}" '
                   f'stroke-width="2"{dash}/>')
        els.append(f'<text x="{lx + 28}" y="{ly + i * 18 + 4}" font-size="11">{escape(a)}</text>')
    els.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(els) + "\n")
