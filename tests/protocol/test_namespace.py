"""Tests of kvtier_protocol.namespace: validation, canonical encoding, ns_id, untrusted maps."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_protocol import keys
from kvtier_protocol.errors import KVTierError, NamespaceError
from kvtier_protocol.namespace import NS_DOMAIN, Namespace

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "protocol" / "vectors" / "hashes" / "namespaces.json"
LLAMA = Namespace("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f2", "mha", 32, 8, 128)
MLA = Namespace("deepseek-ai/DeepSeek-V3", "sha256:9f1c", "mla", 61, 1, 512, mla_rope_dim=64, block_tokens=64)


def cbor_map(m: dict[str, Any]) -> bytes:
    """RFC 8949 §4.2.1 deterministic CBOR of a map of text keys to text / unsigned ints.

    Written from the RFC, not with cbor2: keys are ordered by the bytes of their encodings.
    """

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        width = next(w for w in (1, 2, 4, 8) if n < 1 << (8 * w))
        return bytes([major << 5 | {1: 24, 2: 25, 4: 26, 8: 27}[width]]) + n.to_bytes(width, "big")

    def item(v: Any) -> bytes:
        if isinstance(v, str):
            return head(3, len(v.encode())) + v.encode()
        assert isinstance(v, int) and not isinstance(v, bool) and v >= 0
        return head(0, v)

    pairs = sorted((item(k), item(v)) for k, v in m.items())
    return head(5, len(pairs)) + b"".join(k + v for k, v in pairs)


# --- canonical encoding and ns_id -------------------------------------------------------------


@pytest.mark.parametrize("ns", [LLAMA, MLA], ids=["mha", "mla"])
def test_canonical_bytes_follow_rfc8949_and_ignore_dict_order(ns: Namespace) -> None:
    wire = ns.to_wire()
    assert ns.canonical_bytes() == cbor_map(wire)
    for seed in range(5):
        items = list(wire.items())
        random.Random(seed).shuffle(items)
        shuffled = dict(items)
        assert cbor_map(shuffled) == ns.canonical_bytes()
        assert Namespace.from_wire(shuffled).canonical_bytes() == ns.canonical_bytes()
    assert ns.ns_id == hashlib.sha256(b"kvtier-ns-v1\x00" + ns.canonical_bytes()).digest()[:16]
    assert NS_DOMAIN == b"kvtier-ns-v1\x00" and len(ns.ns_id) == 16


def test_canonical_key_order_is_length_first() -> None:
    raw = LLAMA.canonical_bytes()
    assert raw[0] == 0xA0 | 18  # a map of all 18 fields
    first_keys = [k for k in ("model", "tp_rank", "head_dim", "attention") if k.encode() in raw]
    positions = [raw.index(k.encode()) for k in first_keys]
    assert positions == sorted(positions)


def test_ns_id_is_stable_across_processes_and_hash_seeds() -> None:
    code = ("from kvtier_protocol.namespace import Namespace\n"
            "print(Namespace('m', 'r', 'mha', 2, 2, 8, tenant_salt='t').ns_id.hex())\n")
    seen = set()
    for seed in ("123", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT / "protocol")}
        seen.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, cwd=ROOT, timeout=60).stdout.strip())
    assert seen == {Namespace("m", "r", "mha", 2, 2, 8, tenant_salt="t").ns_id.hex()}


VARIANTS: dict[str, Any] = {
    "model": "other/model", "revision": "0e9e39f3", "attention": "mla", "num_layers": 31,
    "num_kv_heads": 4, "head_dim": 64, "head_dim_v": 64, "mla_rope_dim": 64, "kv_dtype": "float16",
    "kv_codec": "int8", "block_tokens": 32, "hash_tokens": 8, "hash_scheme": "sglang-sha256-u32le",
    "tp_rank": 1, "tp_size": 2, "pp_rank": 1, "pp_size": 2, "tenant_salt": "tenant-a",
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_ns_id_differs_when_any_field_differs(name: str) -> None:
    base = Namespace("m", "r", "mha", 32, 8, 128, tp_size=4, pp_size=4)
    changes: dict[str, Any] = {name: VARIANTS[name]}
    if name == "attention":
        changes.update(num_kv_heads=1, head_dim_v=0)
    if name == "mla_rope_dim":
        changes.update(attention="mla", num_kv_heads=1, head_dim_v=0)
        base = dataclasses.replace(base, attention="mla", num_kv_heads=1, head_dim_v=0)
    other = dataclasses.replace(base, **changes)
    assert getattr(other, name) != getattr(base, name)
    assert other.ns_id != base.ns_id and other != base
    assert dataclasses.replace(base).ns_id == base.ns_id


def test_equal_namespaces_hash_equal_and_hide_the_salt() -> None:
    a = Namespace("m", "r", "mha", 2, 2, 8, tenant_salt="secret")
    b = Namespace("m", "r", "mha", 2, 2, 8, tenant_salt="secret")
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert "secret" not in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.model = "x"  # type: ignore[misc]


# --- geometry ---------------------------------------------------------------------------------


def test_mha_sizes() -> None:
    assert LLAMA.head_dim_v == 128 and LLAMA.units_per_block == 1 and LLAMA.dtype_size == 2
    assert LLAMA.bytes_per_token() == 32 * 2 * 8 * 128 * 2
    assert LLAMA.block_payload_bytes() == 32 * 2 * 8 * 16 * 128 * 2
    assert LLAMA.bytes_per_token(1) == 32 * 2 * 8 * 128
    odd = Namespace("t", "r", "mha", 2, 2, 8, head_dim_v=4, kv_dtype="float32", block_tokens=4, hash_tokens=2)
    assert odd.bytes_per_token() == 2 * 2 * (8 + 4) * 4 and odd.units_per_block == 2


def test_mla_sizes() -> None:
    assert MLA.head_dim_v == 0 and MLA.num_kv_heads == 1
    assert MLA.bytes_per_token() == 61 * (512 + 64) * 2
    assert MLA.block_payload_bytes() == 61 * 64 * (512 + 64) * 2


def test_block_keys_salt_unit_zero_with_the_tenant_salt() -> None:
    tokens = list(range(70))
    ns = Namespace("m", "r", "mha", 2, 2, 8, block_tokens=32, tenant_salt="t")
    units = keys.chain_hashes(tokens, 16, extras=keys.ExtraKeys(cache_salt="t"))
    assert ns.block_keys(tokens) == [units[1], units[3]]
    assert ns.extra_keys(lora_name="l").for_unit(0, 16) == (("lora", "l", ""), ("cache_salt", "t"))
    plain = dataclasses.replace(ns, tenant_salt="")
    assert plain.block_keys(tokens) == keys.block_keys(keys.chain_hashes(tokens, 16), 2)
    assert plain.extra_keys().cache_salt is None
    with pytest.raises(NamespaceError):
        ns.block_keys(tokens, keys.ExtraKeys(cache_salt="other"))
    sg = Namespace("m", "r", "mha", 2, 2, 8, block_tokens=64, hash_tokens=64,
                   hash_scheme="sglang-sha256-u32le", tenant_salt="t")
    seed = keys.sglang_namespace_seed(None, "t")
    assert sg.block_keys(tokens) == [keys.hash_block_tokens(seed, tokens[:64], scheme=sg.hash_scheme)]


# --- validation -------------------------------------------------------------------------------

BAD: list[dict[str, Any]] = [
    {"model": ""}, {"model": "x" * 257}, {"model": "é" * 129}, {"model": 5}, {"model": "\ud800"},
    {"revision": ""}, {"revision": b"r"}, {"attention": "gqa"}, {"num_layers": 0},
    {"num_layers": 4097}, {"num_layers": True}, {"num_layers": 2.0}, {"num_kv_heads": 0},
    {"head_dim": 0}, {"head_dim": 65537}, {"head_dim_v": 0}, {"mla_rope_dim": 64},
    {"kv_dtype": "int8"}, {"kv_dtype": "fp8"}, {"kv_codec": "zstd"}, {"block_tokens": 0},
    {"block_tokens": 24}, {"hash_tokens": 32}, {"hash_tokens": 0}, {"hash_scheme": "md5"},
    {"tp_rank": 1}, {"tp_rank": -1}, {"tp_size": 0}, {"pp_rank": 1}, {"pp_size": 65537},
    {"tenant_salt": None}, {"tenant_salt": "s" * 257},
    {"kv_dtype": "float8_e4m3fn", "kv_codec": "int4"},
    {"attention": "mla", "num_kv_heads": 2, "head_dim_v": 0},
    {"attention": "mla", "head_dim_v": 128, "num_kv_heads": 1},
]


@pytest.mark.parametrize("changes", BAD, ids=[",".join(c) for c in BAD])
def test_invalid_fields_raise_namespace_error(changes: dict[str, Any]) -> None:
    kwargs: dict[str, Any] = {"model": "m", "revision": "r", "attention": "mha", "num_layers": 2,
                              "num_kv_heads": 2, "head_dim": 8, **changes}
    with pytest.raises(NamespaceError):
        Namespace(**kwargs)


def test_fp8_kv_is_allowed_raw_and_lossy_codecs_on_floats() -> None:
    assert Namespace("m", "r", "mha", 2, 2, 8, kv_dtype="float8_e5m2").kv_codec == "raw"
    for codec in ("int8", "int4", "int2", "fp8_e4m3"):
        assert Namespace("m", "r", "mha", 2, 2, 8, kv_codec=codec).kv_codec == codec


# --- wire form --------------------------------------------------------------------------------


def test_wire_round_trip_through_msgpack_ignores_unknown_keys() -> None:
    for ns in (LLAMA, MLA):
        wire = msgpack.unpackb(msgpack.packb(ns.to_wire()), raw=False)
        assert Namespace.from_wire(wire) == ns
        assert Namespace.from_wire({**wire, "future_key": [1, 2], "x": None}).ns_id == ns.ns_id
    minimal = {k: LLAMA.to_wire()[k] for k in ("model", "revision", "attention", "num_layers",
                                               "num_kv_heads", "head_dim")}
    assert Namespace.from_wire(minimal) == LLAMA  # the optional keys take their documented defaults


@pytest.mark.parametrize("m", [None, [], "ns", {"model": "m"}, {**LLAMA.to_wire(), "num_layers": "32"},
                               {**LLAMA.to_wire(), "tp_size": True}, {**LLAMA.to_wire(), "model": b"m"},
                               {**LLAMA.to_wire(), "head_dim_v": None}])
def test_from_wire_rejects_bad_maps(m: Any) -> None:
    with pytest.raises(NamespaceError):
        Namespace.from_wire(m)


GARBAGE: list[Any] = [None, True, False, 0, -1, 1, 2, 3, 8, 16, 2**31, 2**64 - 1, -(2**63), 1.5,
                      float("nan"), "", "mla", "mha", "raw", "int4", "bfloat16", "x" * 300, b"",
                      b"\x00" * 40, [], [1], {}, {"a": 1}, "sglang-sha256-u32le"]


def fuzz_inputs(rng: random.Random, count: int) -> list[bytes]:
    """msgpack documents: valid maps with mutated, dropped or added keys, flipped bytes, noise."""
    base = [ns.to_wire() for ns in (LLAMA, MLA)]
    out: list[bytes] = []
    while len(out) < count:
        m = dict(rng.choice(base))
        kind = rng.randrange(5)
        if kind == 0:
            for _ in range(rng.randint(1, 3)):
                m[rng.choice(list(m))] = rng.choice(GARBAGE)
        elif kind == 1:
            for _ in range(rng.randint(1, 3)):
                m.pop(rng.choice(list(m)), None)
        elif kind == 2:
            m[rng.choice(["zzz", "", "model ", "MODEL"])] = rng.choice(GARBAGE)
        raw = msgpack.packb(m if kind != 4 else rng.choice(GARBAGE))
        if kind == 3:
            buf = bytearray(raw)
            for _ in range(rng.randint(1, 4)):
                buf[rng.randrange(len(buf))] = rng.randrange(256)
            raw = bytes(buf)
        out.append(raw)
    return out


def test_from_wire_fuzz_raises_only_namespace_error() -> None:
    rng = random.Random(20261130)
    delivered = accepted = 0
    for raw in fuzz_inputs(rng, 12_000):
        try:
            obj = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # not a msgpack document: never reaches from_wire
            continue
        delivered += 1
        try:
            ns = Namespace.from_wire(obj)
        except NamespaceError:
            continue
        except KVTierError as exc:
            pytest.fail(f"wrong error class {type(exc).__name__} for {obj!r}")
        accepted += 1
        assert Namespace.from_wire(ns.to_wire()) == ns
    assert delivered >= 10_000 and 0 < accepted < delivered


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.sampled_from(list(VARIANTS) + ["other"]),
                       st.one_of(st.none(), st.integers(-5, 2**65), st.text(max_size=8),
                                 st.binary(max_size=4),
                                 st.booleans(), st.floats(allow_nan=True)), max_size=20))
def test_from_wire_on_arbitrary_maps(m: dict[str, Any]) -> None:
    try:
        ns = Namespace.from_wire(m)
    except NamespaceError:
        return  # the only error allowed; anything else fails the test
    assert Namespace.from_wire(ns.to_wire()) == ns


# --- golden vectors ---------------------------------------------------------------------------


def test_every_namespace_vector_reproduces() -> None:
    cases = json.loads(VECTORS.read_text())["cases"]
    assert cases
    for c in cases:
        ns = Namespace.from_wire(c["wire"])
        assert ns.to_wire() == c["wire"], c["name"]
        assert ns.canonical_bytes().hex() == c["canonical_hex"] == cbor_map(c["wire"]).hex(), c["name"]
        assert ns.ns_id.hex() == c["ns_id_hex"], c["name"]
        digest = hashlib.sha256(NS_DOMAIN + bytes.fromhex(c["canonical_hex"])).hexdigest()
        assert digest[:32] == c["ns_id_hex"]
        assert ns.bytes_per_token() == c["bytes_per_token"]
        assert ns.block_payload_bytes() == c["block_payload_bytes"]
