#!/usr/bin/env python3
"""Summarises kvroute-simulate --decision-log files: where the hits went.

    python3 sim/tools/decision_log.py [--sys-tokens 6000] RUN.jsonl [RUN2.jsonl …]

Each line of a decision log is one routing decision with, per endpoint, the
index's affinity, the filter's verdict, the scores, and the prefix the
modelled server really held at that moment (`server_cached_tokens`, in the
server's own blocks). From them, per file:

- branches: how many decisions each filter branch took;
- hit at decision: Σ cached tokens on the chosen server / Σ prompt tokens (close to the run's hit
  ratio; the cache can change between the decision and the server's admission);
  best: the same had every request gone to the server holding most of it;
- lost by branch: (best − chosen) cached tokens over all prompt tokens, by branch;
- no-affinity while warm: decisions in the no-affinity branch although some server really held
  the request's shared prefix (≥ sys-tokens rounded down to a 16-token block), with the match the
  index found on that server (index blocks), and how many of them went to a server without it;
- cold fills: decisions sent to a server without the shared prefix while another held it;
- holders: how many servers really held the request's shared prefix at decision time;
- index vs server: per endpoint and decision, the index's match against the server's (in index
  blocks): equal, index short (by < 8 or ≥ 8 blocks), index long (it believes blocks the server
  has evicted);
- clock: the blocks the index's eviction clock advanced (insert counters) against the blocks the
  servers computed at decision time (prompt − cached, in index blocks).
"""
import argparse
import collections
import json


def summarise(path, sys_tokens):
    rows = [json.loads(line) for line in open(path)]
    held_sys = sys_tokens // 16 * 16
    br = collections.Counter(r["branch"] for r in rows)
    prompt = sum(r["prompt_tokens"] for r in rows)
    got = best = 0
    lost = collections.Counter()
    noaff_warm = noaff_warm_cold = cold_fill = 0
    noaff_idx = collections.Counter()
    holders = collections.Counter()
    idx_vs = collections.Counter()
    computed = 0.0
    for r in rows:
        cs = r["candidates"]
        e = r["endpoint"]
        nb = r["router_blocks"] or 1
        bt = max(16, r["prompt_tokens"] // nb // 16 * 16)  # index block tokens
        t = [c["server_cached_tokens"] for c in cs]
        got += t[e]
        best += max(t)
        lost[r["branch"]] += max(t) - t[e]
        computed += (r["prompt_tokens"] - t[e]) / bt
        h = sum(1 for x in t if x >= held_sys)
        holders[h] += 1
        if h and t[e] < held_sys:
            cold_fill += 1
        if r["branch"] == "no-affinity" and h:
            noaff_warm += 1
            w = max(range(len(cs)), key=lambda i: t[i])
            noaff_idx[round(cs[w]["affinity"] * nb)] += 1
            noaff_warm_cold += t[e] < held_sys
        for c in cs:
            tb, ib = c["server_cached_tokens"] // bt, round(c["affinity"] * nb)
            if tb == 0 and ib == 0:
                continue
            if ib == tb:
                idx_vs["equal"] += 1
            elif ib < tb:
                idx_vs["index short <8" if tb - ib < 8 else "index short >=8"] += 1
            else:
                idx_vs["index long (evicted)"] += 1
    clock = sum(c["insert_counter"] or 0 for c in rows[-1]["candidates"]) if rows else 0
    return {
        "decisions": len(rows),
        "branches": dict(br),
        "hit_at_decision": round(got / prompt, 3),
        "hit_if_best": round(best / prompt, 3),
        "lost_by_branch": {k: round(v / prompt, 3) for k, v in lost.items()},
        "no_affinity_while_warm": noaff_warm,
        "no_affinity_while_warm_index_blocks": dict(sorted(noaff_idx.items())),
        "no_affinity_while_warm_sent_cold": noaff_warm_cold,
        "cold_fills_while_warm_elsewhere": cold_fill,
        "servers_holding_shared_prefix": dict(sorted(holders.items())),
        "index_vs_server": dict(idx_vs),
        "clock_blocks": clock,
        "server_computed_blocks": round(computed),
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sys-tokens", type=int, default=6000, help="the workload's shared prefix (tokens)")
    p.add_argument("logs", nargs="+")
    a = p.parse_args()
    for path in a.logs:
        print(path)
        for k, v in summarise(path, a.sys_tokens).items():
            print(f"  {k}: {v}")


if __name__ == "__main__":
    main()
