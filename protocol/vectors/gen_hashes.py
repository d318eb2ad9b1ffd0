"""Generate the hash and namespace vectors in protocol/vectors/hashes/ (SPEC.md §2-§3).

Deterministic: fixed inputs, no clocks, no randomness; running it twice writes identical files.
Usage: ``python protocol/vectors/gen_hashes.py`` (from anywhere).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import cbor2

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from kvtier_protocol import keys  # noqa: E402
from kvtier_protocol.keys import ExtraKeys, MMItem  # noqa: E402
from kvtier_protocol.namespace import Namespace  # noqa: E402

OUT = HERE / "hashes"
VOCAB = 128256  # Llama-3 vocabulary: realistic token ids


def pseudo_tokens(n: int, seed: int) -> list[int]:
    """Token ids from a fixed multiplicative sequence (no RNG, so stable across Pythons)."""
    return [(seed + i * 2654435761) % VOCAB for i in range(n)]


def json_extra(extra: Any) -> Any:
    """A JSON form of extra keys: tuples become lists, bytes become {"hex": ...}."""
    if isinstance(extra, tuple):
        return [json_extra(e) for e in extra]
    if isinstance(extra, bytes):
        return {"hex": extra.hex()}
    return extra


def extras_spec(e: ExtraKeys | None) -> dict[str, Any] | None:
    if e is None:
        return None
    return {
        "lora_name": e.lora_name,
        "lora_path": e.lora_path,
        "mm_items": [[m.identifier, m.offset, m.length] for m in e.mm_items],
        "cache_salt": e.cache_salt,
        "prompt_embeds_hex": [d.hex() for d in e.prompt_embeds],
    }


def chain_case(name: str, what: str, tokens: list[int], hash_tokens: int, units_per_block: int, *,
               scheme: str = keys.VLLM_SCHEME, extras: ExtraKeys | None = None,
               parent: bytes | None = None, start: int = 0) -> dict[str, Any]:
    hasher = keys.get_scheme(scheme)
    hashes = keys.chain_hashes(tokens, hash_tokens, scheme=scheme, extras=extras,
                               parent=parent, start=start)
    units = []
    seed = None if start else hasher.first_parent(extras)
    prev = parent if start else seed
    for i, h in enumerate(hashes):
        pos = start + i * hash_tokens
        extra = hasher.unit_extra(extras, pos, pos + hash_tokens)
        pre = hasher.preimage(prev, tokens[i * hash_tokens:(i + 1) * hash_tokens], extra)
        assert hashlib.sha256(pre).digest() == h, "chain_hashes and preimage disagree"
        units.append({"extra": json_extra(extra), "preimage_hex": pre.hex(), "hash_hex": h.hex(),
                      "event_u64": keys.event_hash(h)})
        prev = h
    return {
        "name": name, "what": what, "scheme": scheme, "hash_tokens": hash_tokens,
        "units_per_block": units_per_block, "start": start,
        "parent_hex": parent.hex() if parent else None, "extras": extras_spec(extras),
        "seed_hex": seed.hex() if seed else None,
        "tokens": tokens, "units": units,
        "block_keys_hex": [k.hex() for k in keys.block_keys(hashes, units_per_block,
                                                              start // hash_tokens)],
    }


def vllm_reference() -> dict[str, Any]:
    seed_cbor = cbor2.dumps(keys.VLLM_SEED, canonical=True)
    pre = keys.SCHEMES[keys.VLLM_SCHEME].preimage(None, range(16))
    h = hashlib.sha256(pre).digest()
    return {
        "what": "vLLM 0.33 sha256_cbor reference (engine-interfaces.md §3): NONE_HASH and tokens 0..15",
        "seed": keys.VLLM_SEED, "seed_cbor_hex": seed_cbor.hex(), "none_hash_hex": keys.NONE_HASH.hex(),
        "tokens": list(range(16)), "preimage_hex": pre.hex(), "hash_hex": h.hex(),
        "event_u64": keys.event_hash(h),
    }


def vllm_chains() -> list[dict[str, Any]]:
    t64 = pseudo_tokens(64, 7)
    two = keys.chain_hashes(t64, 16)
    embeds = tuple(hashlib.sha256(b"embeds-unit-%d" % i).digest() for i in range(4))
    big = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 1, 2, 3, 4, 5]
    all_extras = ExtraKeys(lora_name="l", lora_path="", cache_salt="s",
                           mm_items=(MMItem("m", 10, 8), MMItem("v", 40, 20)), prompt_embeds=embeds)
    all_extras_tokens = pseudo_tokens(64, 5)
    all_extras_chain = keys.chain_hashes(all_extras_tokens, 16, extras=all_extras)
    return [
        chain_case("two-units", "tokens 0..31, no extras", list(range(32)), 16, 1),
        chain_case("blocks-of-2-units", "64+6 tokens; hash unit 16, block 32: keys are units 1, 3;"
                   " the partial unit is ignored", pseudo_tokens(70, 7), 16, 2),
        chain_case("unit-4-block-16", "hash unit 4 tokens, block 16 tokens", pseudo_tokens(32, 11), 4, 4),
        chain_case("continuation", "the second half of blocks-of-2-units hashed on its own:"
                   " same digests as units 2 and 3 there", t64[32:], 16, 2, parent=two[1], start=32),
        chain_case("lora", "LoRA on every unit", list(range(32)), 16, 1,
                   extras=ExtraKeys(lora_name="sql-adapter", lora_path="/adapters/sql")),
        chain_case("cache-salt", "cache_salt on unit 0 only", list(range(48)), 16, 1,
                   extras=ExtraKeys(cache_salt="tenant-a")),
        chain_case("multimodal", "two images: offsets relative to each unit's start (may be < 0)",
                   pseudo_tokens(64, 3), 16, 1,
                   extras=ExtraKeys(mm_items=(MMItem("img-0f3a", 5, 20), MMItem("img-77b1", 40, 4)))),
        chain_case("all-extras", "lora, mm, salt, prompt embeds in vLLM's order", pseudo_tokens(64, 5), 16, 2,
                   extras=ExtraKeys(lora_name="l", lora_path="", cache_salt="s",
                                    mm_items=(MMItem("m", 10, 8),), prompt_embeds=embeds)),
        chain_case("spec-example", "the worked example of SPEC.md §3.2: lora, mm, salt on 4-token units",
                   [1, 2, 3, 4, 5, 6, 7, 8], 4, 1,
                   extras=ExtraKeys(lora_name="sql", lora_path="/a", cache_salt="t",
                                    mm_items=(MMItem("img", 2, 30),))),
        chain_case("wide-token-ids", "CBOR integer widths 1, 2, 3, 5 and 9 bytes", big, 16, 1),
        chain_case("lora-without-path", "a LoRA name with no path: the key's path is the empty "
                   "text, never nil or left out", list(range(32)), 16, 1,
                   extras=ExtraKeys(lora_name="sql-adapter")),
        chain_case("extras-two-images", "lora with an empty path, salt, prompt embeds and two "
                   "images, the second spanning units 2 and 3: the whole request of "
                   "continuation-with-extras", all_extras_tokens, 16, 2, extras=all_extras),
        chain_case("continuation-with-extras", "the second half of extras-two-images hashed on its own "
                   "from start 32 with the request's whole extras: unit_start is absolute (mm "
                   "offsets relative to it, no salt past unit 0), prompt_embeds[i] belongs to "
                   "absolute unit i; same digests as units 2 and 3 there",
                   all_extras_tokens[32:], 16, 2, extras=all_extras, parent=all_extras_chain[1],
                   start=32),
        chain_case("continuation-mid-block", "blocks-of-2-units continued from unit 1 (start 16, "
                   "in the middle of block 0): block keys are counted from the request's first "
                   "token, so they are absolute units 1 and 3 (this case's units 0 and 2)",
                   t64[16:], 16, 2, parent=two[0], start=16),
    ]


def sglang_chains() -> list[dict[str, Any]]:
    s = keys.SGLANG_SCHEME
    return [
        chain_case("no-seed", "two pages, no prior digest on page 1", list(range(32)), 16, 1, scheme=s),
        chain_case("seed-extra-key-and-salt", "seeded by storage_namespace_seed(extra_key, cache_salt)",
                   list(range(32)), 16, 1, scheme=s, extras=ExtraKeys(lora_name="lora-1", cache_salt="salt")),
        chain_case("seed-empty-salt", "cache_salt '' is present (01 + u64 0), unlike None",
                   list(range(16)), 16, 1, scheme=s, extras=ExtraKeys(cache_salt="")),
        chain_case("wide-page", "page 2 holds an id >= 2^32: 0xFF tag then u64le ids",
                   list(range(4)) + [2**32, 5, 6, 2**63 - 1], 4, 2, scheme=s),
        chain_case("spec-seeded-page", "SPEC.md §3.3 example: tokens 0..3 after seed(lora-1, salt)",
                   [0, 1, 2, 3], 4, 1, scheme=s, extras=ExtraKeys(lora_name="lora-1", cache_salt="salt")),
        chain_case("spec-wide", "SPEC.md §3.3 example: tokens 1, 2^32", [1, 2**32], 2, 1, scheme=s),
    ]


LLAMA_8B_REV = "0e9e39f249a16976918f6564b8830bc894c89659"
LLAMA_70B_REV = "945c8663693130f8be2ee66210e062158b2a9693"
NAMESPACES: list[tuple[str, Namespace]] = [
    ("llama-8b", Namespace("meta-llama/Llama-3.1-8B-Instruct", LLAMA_8B_REV, "mha", 32, 8, 128)),
    ("llama-70b-tp3of8-int4", Namespace("meta-llama/Llama-3.1-70B-Instruct", LLAMA_70B_REV, "mha",
                                        80, 1, 128, kv_codec="int4", block_tokens=64,
                                        tp_rank=3, tp_size=8)),
    ("deepseek-v3-mla", Namespace("deepseek-ai/DeepSeek-V3", "sha256:9f1c", "mla", 61, 1, 512,
                                  mla_rope_dim=64, block_tokens=64, pp_rank=1, pp_size=2)),
    ("tenant-salted", Namespace("Qwen/Qwen3-8B", "main@b968826", "mha", 36, 8, 128,
                                tenant_salt="tenant-a")),
    ("sglang-fp8", Namespace("Qwen/Qwen3-8B", "main@b968826", "mha", 36, 8, 128,
                             kv_dtype="float8_e4m3fn", block_tokens=64, hash_tokens=64,
                             hash_scheme=keys.SGLANG_SCHEME)),
    ("tiny-f32-dv", Namespace("tiny", "r1", "mha", 2, 2, 8, head_dim_v=4, kv_dtype="float32",
                              block_tokens=4, hash_tokens=2)),
]


def namespaces() -> list[dict[str, Any]]:
    return [{"name": name, "wire": ns.to_wire(), "canonical_hex": ns.canonical_bytes().hex(),
             "ns_id_hex": ns.ns_id.hex(), "bytes_per_token": ns.bytes_per_token(),
             "block_payload_bytes": ns.block_payload_bytes()} for name, ns in NAMESPACES]


def build() -> dict[str, Any]:
    """Every vector file: name -> JSON document."""
    return {
        "vllm_reference.json": vllm_reference(),
        "vllm_chains.json": {"what": "vllm-sha256-cbor chains (SPEC.md §3)", "cases": vllm_chains()},
        "sglang_chains.json": {"what": "sglang-sha256-u32le chains (SPEC.md §3)", "cases": sglang_chains()},
        "namespaces.json": {"what": "namespace canonical CBOR and ns_id (SPEC.md §2)", "cases": namespaces()},
    }


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON with one key per line but lists of scalars on one line, so token lists stay short."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, doc in build().items():
        (OUT / name).write_text(dumps(doc) + "\n", encoding="utf-8")
        print(f"wrote {OUT / name}")


if __name__ == "__main__":
    main()
