"""Writes testdata/vllm/block-hash-sha256-cbor-vectors.json with vLLM's own code.

It calls vLLM 0.32's functions directly, in the real-engine tier's venv:
`vllm.utils.hashing.sha256_cbor`, `kv_cache_utils.init_none_hash` (the seed
rule: PYTHONHASHSEED when set, else vLLM's fixed default for sha256 and
sha256_cbor), `generate_block_hash_extra_keys` (the LoRA key
`("lora", name, path)` on every block of a request carrying a
`vllm.lora.request.LoRARequest`, then the `cache_salt` key on block 0),
`hash_block_tokens` and `maybe_convert_block_hash` (the 64-bit
form KV events carry). Nothing here restates vLLM's definitions, so the
vectors check kvroute_core::precise against vLLM itself.

Run (the seed is set per case, before vLLM resolves it):
    ~/.cache/kvroute/vllm-0.32/venv/bin/python sim/tools/gen_vllm_hash_vectors.py
"""
import json
import os
import pathlib
from types import SimpleNamespace

from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils as k


def block_hashes(tokens, block_size, salt, lora):
    # The request fields generate_block_hash_extra_keys reads; a LoRA
    # request as vLLM's OpenAI server builds it for `--lora-modules name=path`.
    lora_request = None
    if lora is not None:
        lora_request = LoRARequest(lora_name=lora[0], lora_int_id=1, lora_path=lora[1])
    req = SimpleNamespace(mm_features=[], lora_request=lora_request, cache_salt=salt, prompt_embeds=None)
    parent = None
    out = []
    for i in range(len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        extra, _ = k.generate_block_hash_extra_keys(req, start, end, 0)
        parent = k.hash_block_tokens(sha256_cbor, parent, tokens[start:end], extra)
        out.append(parent)
    return out


def case(name, seed, tokens, block_size, salt=None, lora=None):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    k.init_none_hash(sha256_cbor)
    hs = block_hashes(tokens, block_size, salt, lora)
    return {
        "name": name,
        "python_hash_seed": seed,
        "resolved_seed": k.get_none_hash_seed(),
        "block_size": block_size,
        "cache_salt": salt,
        "lora_name": lora and lora[0],
        "lora_path": lora and lora[1],
        "token_ids": tokens,
        "none_hash_hex": k.NONE_HASH.hex(),
        "block_hashes_hex": [h.hex() for h in hs],
        "block_hashes_u64": [k.maybe_convert_block_hash(h) for h in hs],
    }


def main():
    assert os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1") == "1"
    small = list(range(10))
    # Token ids spanning every CBOR integer head: 1 byte (<24), +1, +2, +4 bytes.
    wide = [0, 23, 24, 255, 256, 65535, 65536, 151935, 2**32 - 1, 7] * 7
    cases = [
        case("seed0-bs4-small", "0", small, 4),
        case("seed0-bs16-wide", "0", wide, 16),
        case("seed42-bs16-wide", "42", wide, 16),
        case("seed-empty-bs16-wide", "", wide, 16),
        case("unset-seed-bs16-wide", None, wide, 16),
        case("seed0-bs16-wide-salted", "0", wide, 16, "tenant-a"),
        case("seed0-bs64-long", "0", [(i * 7919) % 151936 for i in range(300)], 64),
        case("seed0-bs32-partial-only", "0", list(range(31)), 32),
        case("seed0-bs16-wide-lora", "0", wide, 16, lora=("sql", "/tmp/kvr-lora/sql")),
        case("seed0-bs16-wide-lora-salted", "0", wide, 16, "tenant-a", ("sql", "/tmp/kvr-lora/sql")),
        case("unset-seed-bs4-lora-other-path", None, small, 4, lora=("sql", "/srv/adapters/sql-v2")),
        # Non-ASCII name, a path over 255 bytes (a 2-byte CBOR length head).
        case("seed42-bs16-lora-long-path-salted", "42", wide, 16, "s" * 30,
             ("ünïcode-lora", "/adapters/" + "p" * 300)),
    ]
    out = pathlib.Path(__file__).resolve().parents[2] / "testdata/vllm/block-hash-sha256-cbor-vectors.json"
    out.write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
