#!/usr/bin/env python3
"""Writes testdata/traces/support-chat.jsonl, the what-if tool's sample trace.

A support-chat service: 16 tenants, each with its own 6000-token system
prompt, two of them big (35 % of the conversations each); 80 conversations, each up to 6 turns of a
300-token user message and a 200-token answer replayed into the next turn's
prompt; 200 output tokens per request; Poisson arrivals at 6 req/s for 240 s.
Deterministic (seeded); the prompt is given as segments (ids + token counts).

    python3 sim/tools/gen_sample_trace.py > testdata/traces/support-chat.jsonl
"""

import json
import random
import sys

rng = random.Random(16)
TENANTS, CONVS, TURNS = 16, 80, 6
SYSTEM, USER, ANSWER, OUTPUT = 6000, 300, 200, 200
RATE, SECONDS = 6.0, 240.0

# Skewed: tenants 0 and 1 own 35 % of the conversations each, the other 14 share the rest.
tenant_of = [(0 if c % 20 < 7 else 1) if c % 20 < 14 else 2 + rng.randrange(TENANTS - 2) for c in range(CONVS)]
turn = [0] * CONVS
generation = [0] * CONVS
t = 0.0
out = sys.stdout
out.write("# kvroute what-if sample trace (sim/tools/gen_sample_trace.py): 16 tenants x 6000-token system prompts (2 big),\n")
out.write("# 80 conversations of up to 6 turns (300-token user turns, 200-token replayed answers), 6 req/s for 240 s\n")
while True:
    t += rng.expovariate(RATE)
    if t >= SECONDS:
        break
    c = rng.randrange(CONVS)
    k = turn[c]
    conv = f"c{c}g{generation[c]}"
    segs = [{"id": f"sys-{tenant_of[c]}", "tokens": SYSTEM}]
    for i in range(k + 1):
        segs.append({"id": f"{conv}-u{i}", "tokens": USER})
        if i < k:
            segs.append({"id": f"{conv}-a{i}", "tokens": ANSWER})
    turn[c] = k + 1
    if turn[c] >= TURNS:
        turn[c] = 0
        generation[c] += 1
    out.write(json.dumps({"arrival_s": round(t, 3), "model": "tiny", "segments": segs,
                          "output_tokens": OUTPUT}, separators=(",", ":")) + "\n")
