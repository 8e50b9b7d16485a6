"""Writes testdata/vllm/block-hash-sha256-cbor-vectors.json.

An independent reference for sim/src/vllm_hash.rs: it hashes with the
Python `cbor2` package (the encoder vLLM itself uses, `canonical=True`) and
hashlib, following vLLM's definitions:

    NONE_HASH = sha256(cbor2.dumps(PYTHONHASHSEED))
    h[i] = sha256(cbor2.dumps((h[i-1] or NONE_HASH, tuple(block_tokens), extra_keys)))
    extra_keys = None, or (cache_salt,) on block 0
    event hash = int.from_bytes(h, "big") & (2**64 - 1)

Run: python3 -m pip install cbor2 && python3 sim/tools/gen_vllm_hash_vectors.py
"""
import hashlib
import json
import pathlib

import cbor2


def sha256_cbor(obj):
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def block_hashes(seed, tokens, block_size, salt):
    parent = sha256_cbor(seed)
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(tokens[i * block_size:(i + 1) * block_size])
        extra = (salt,) if (i == 0 and salt) else None
        parent = sha256_cbor((parent, block, extra))
        out.append(parent)
    return out


def case(name, seed, tokens, block_size, salt=None):
    hs = block_hashes(seed, tokens, block_size, salt)
    return {
        "name": name,
        "python_hash_seed": seed,
        "block_size": block_size,
        "cache_salt": salt,
        "token_ids": tokens,
        "none_hash_hex": sha256_cbor(seed).hex(),
        "block_hashes_hex": [h.hex() for h in hs],
        "block_hashes_u64": [int.from_bytes(h, "big") & (2**64 - 1) for h in hs],
    }


def main():
    small = list(range(10))
    # Token ids spanning every CBOR integer width up to u32.
    wide = [0, 23, 24, 255, 256, 65535, 65536, 151935, 2**32 - 1, 7] * 7
    cases = [
        case("seed0-bs4-small", "0", small, 4),
        case("seed0-bs16-wide", "0", wide, 16),
        case("seed42-bs16-wide", "42", wide, 16),
        case("seed0-bs16-wide-salted", "0", wide, 16, "tenant-a"),
        case("seed0-bs64-long", "0", [(i * 7919) % 151936 for i in range(300)], 64),
    ]
    out = pathlib.Path(__file__).resolve().parents[2] / "testdata/vllm/block-hash-sha256-cbor-vectors.json"
    out.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
