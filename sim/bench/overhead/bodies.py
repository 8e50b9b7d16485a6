#!/usr/bin/env python3
"""Request bodies for the overhead benchmark: OpenAI chat completions of a
fixed size in bytes, with shared prefixes.

Each body is `{"model", "messages": [system, user], "max_tokens", "stream"}`.
There are 8 system prompts per size (3/4 of the body each), and every body has
its own user turn (the last 1/4): body i uses system prompt i mod 8. So 1/8 of
the bodies share each system prompt, as in a multi-tenant service, and no two
bodies are the same. The text is English-like words, sentences and code-ish
lines from a seeded generator, JSON-escaped as a client would send it.

With `marker="turn"` each user turn starts with `MARKER`, 16 characters that
a sender replaces with 16 others of its own (`fresh`) so that every request is
a prompt no router has seen: it shares its system prompt with 1/8 of the
others and parts from them right after it (bench.py --fresh, callgrind.py
--fresh). With `marker="tail"` the MARKER ends the user turn instead (before
any padding): a body sent again matches its earlier sends up to its last
block, as a conversation's next turn matches its history, so the router's
lookup finds the prompt warm and its insert writes one new block
(--fresh tail).

Only the Python standard library is used. Same arguments, same bytes.

    python3 bodies.py --size 8192 --count 512 --out bodies-8k.jsonl
"""

import argparse
import json
import random
import sys

MODEL = "bench-model"
SYSTEM_PROMPTS = 8
SYSTEM_SHARE = 0.75
# Stands where a fresh body's unique 16 characters go (see `fresh`); no
# generated text contains "@".
MARKER = "@" * 16

_SYLLABLES = [
    "ka", "lo", "mi", "ten", "ra", "vo", "sel", "an", "tor", "pi", "que", "dur", "en", "sa", "bri", "ol",
    "ex", "ment", "ing", "ver", "co", "de", "na", "tri", "um", "pro", "gra", "lin", "ux", "fer", "al", "is",
]
_COMMON = (
    "the of and to in is that for it as with was on be by this are from or have an they which one you "
    "were all we when your can said there use each she how their if will up other about out many then "
    "them these so some her would make like him into time has look two more write go see number no way "
    "could people my than first water been call who its now find long down day did get come made may part "
    "function return value request server cache token prompt model user system context file module error"
).split()


def _vocabulary(rng):
    words = list(_COMMON)
    while len(words) < 4096:
        words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))))
    return words


def _text(rng, words, n_chars):
    """About n_chars of prose with the odd code line, then cut to n_chars."""
    out = []
    size = 0
    while size < n_chars:
        if rng.random() < 0.1:
            name = rng.choice(words)
            line = f"    def {name}_{rng.randint(0, 999)}(self, {rng.choice(words)}): return {rng.choice(words)}\n"
        else:
            sentence = " ".join(rng.choice(words) for _ in range(rng.randint(6, 18)))
            line = sentence[0].upper() + sentence[1:] + rng.choice([". ", ". ", "? ", ".\n"])
        out.append(line)
        size += len(line)
    return "".join(out)[:n_chars]


def _body(system, user, max_tokens=16, api="chat"):
    if api == "messages":
        # Anthropic's Messages API: the same text, system as a text block.
        return json.dumps(
            {
                "model": MODEL,
                "max_tokens": max_tokens,
                "system": [{"type": "text", "text": system}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": user}]}],
                "stream": False,
            },
            separators=(",", ":"),
        )
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "max_tokens": max_tokens,
            "stream": False,
        },
        separators=(",", ":"),
    )


MARKER_PLACES = ("turn", "tail")


def generate(size, count, seed=1, marker=None, api="chat"):
    """`count` bodies of exactly `size` bytes (as sent), as strings; with
    `marker` "turn" each user turn starts with MARKER, with "tail" it ends
    with it. `api="messages"`: Anthropic Messages bodies of the same text
    (system and user turn as text blocks)."""
    if marker not in (None,) + MARKER_PLACES:
        raise ValueError(f"marker: {marker!r} is not one of {MARKER_PLACES}")
    rng = random.Random(f"kvroute-overhead-{seed}-{size}")
    words = _vocabulary(random.Random(f"kvroute-overhead-vocab-{seed}"))
    def body_of(system, user):
        return _body(system, user, api=api)

    overhead = len(body_of("", ""))
    content = max(16, size - overhead)
    system_chars = int(content * SYSTEM_SHARE)
    systems = [
        f"You are assistant #{k} of a coding service. Follow the house rules below.\n"
        + _text(rng, words, system_chars)
        for k in range(SYSTEM_PROMPTS)
    ]
    systems = [s[:system_chars] for s in systems]
    corpus = _text(rng, words, max(4 * size, 1 << 20))
    bodies = []
    for i in range(count):
        system = systems[i % SYSTEM_PROMPTS]
        head = f"{MARKER} Ticket {i}: " if marker == "turn" else f"Ticket {i}: "
        tail = MARKER if marker == "tail" else ""
        start = rng.randrange(0, len(corpus) - content)
        user = head + corpus[start : start + content]

        def turn(n):
            return user[: max(len(head), n - len(tail))] + tail

        # Fit to the exact size: JSON escapes (\n) make the text longer on the wire.
        user_len = content - system_chars
        body = body_of(system, turn(user_len))
        while len(body) > size and user_len > len(head) + len(tail):
            user_len -= max(1, len(body) - size)
            body = body_of(system, turn(user_len))
        pad = size - len(body)
        if pad > 0:
            body = body_of(system, turn(user_len) + "." * pad)
        bodies.append(body)
    return bodies


def fresh(body, n):
    """A marked body (bytes or str) with MARKER replaced by n in 16 hex digits:
    the same size, a prompt of its own for each n."""
    if isinstance(body, bytes):
        return body.replace(MARKER.encode(), b"%016x" % n, 1)
    return body.replace(MARKER, f"{n:016x}", 1)


def _ids_body(ids, max_tokens=16):
    return json.dumps({"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "stream": False},
                      separators=(",", ":"))


def generate_ids(size, count, seed=1):
    """`count` /v1/completions bodies of exactly `size` bytes whose prompt is
    token IDs (vocabulary 4096): 8 shared prefixes (3/4 of the IDs) and a
    distinct rest, as `generate` does for text. Padded with JSON whitespace."""
    rng = random.Random(f"kvroute-overhead-ids-{seed}-{size}")
    per_id = 5  # "1234," on average, about
    n = max(8, (size - len(_ids_body([]))) // per_id)
    shared = int(n * SYSTEM_SHARE)
    prefixes = [[rng.randrange(3, 4096) for _ in range(shared)] for _ in range(SYSTEM_PROMPTS)]
    bodies = []
    for i in range(count):
        ids = prefixes[i % SYSTEM_PROMPTS] + [rng.randrange(3, 4096) for _ in range(n - shared)]
        body = _ids_body(ids)
        while len(body) > size:
            ids.pop()
            body = _ids_body(ids)
        body = body[:-1] + " " * (size - len(body)) + "}"
        bodies.append(body)
    return bodies


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, required=True, help="bytes per body")
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    with open(args.out, "w") as f:
        for b in generate(args.size, args.count, args.seed):
            f.write(b)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
