"""Tests of kvtier_protocol.keys: chain hashing against vLLM's and SGLang's byte formats."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_protocol import keys
from kvtier_protocol.errors import InvalidKey, InvalidRequest, NamespaceError
from kvtier_protocol.keys import ExtraKeys, MMItem

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "protocol" / "vectors" / "hashes"
REF_NONE = "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"
REF_0_15 = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"
REF_EVENT = 2233398808101521225
U64 = 1 << 64


# --- an independent encoder for the CBOR subset the SPEC uses (RFC 8949 §3, §4.2.1) ------------


def cbor(obj: Any) -> bytes:
    """Deterministic CBOR of None, ints, bytes, str, tuples/lists and text-keyed maps."""

    def head(major: int, n: int) -> bytes:
        if n < 24:
            return bytes([major << 5 | n])
        for info, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
            if n < 1 << (8 * width):
                return bytes([major << 5 | info]) + n.to_bytes(width, "big")
        raise ValueError("integer needs a bignum")

    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        raise TypeError("bool is not in the subset")
    if isinstance(obj, int):
        return head(0, obj) if obj >= 0 else head(1, -1 - obj)
    if isinstance(obj, bytes):
        return head(2, len(obj)) + obj
    if isinstance(obj, str):
        raw = obj.encode("utf-8")
        return head(3, len(raw)) + raw
    if isinstance(obj, (tuple, list)):
        return head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    if isinstance(obj, dict):  # keys ordered by the bytewise order of their encodings
        pairs = sorted((cbor(k), cbor(v)) for k, v in obj.items())
        return head(5, len(pairs)) + b"".join(k + v for k, v in pairs)
    raise TypeError(type(obj))


def sglang_ref(prior: bytes | None, page: list[int]) -> bytes:
    """SGLang hash_binding.cpp, re-derived from its C++: u32le page, or 0xFF + u64le if wide."""
    if any(t > 0xFFFFFFFF for t in page):
        data = b"\xff" + b"".join(t.to_bytes(8, "little") for t in page)
    else:
        data = b"".join(t.to_bytes(4, "little") for t in page)
    return hashlib.sha256((prior or b"") + data).digest()


def sglang_seed_ref(extra_key: str | None, salt: str | None) -> bytes | None:
    """SGLang's storage_namespace_seed (mem_cache/utils.py), as bytes instead of hex."""
    if extra_key is None and salt is None:
        return None
    data = b"sglang-cache-namespace-v1"
    for part in (extra_key, salt):
        raw = None if part is None else part.encode()
        data += b"\x00" if raw is None else b"\x01" + struct.pack("<Q", len(raw)) + raw
    return hashlib.sha256(data).digest()


# --- reference vectors ------------------------------------------------------------------------


def test_reference_vectors_from_vllm() -> None:
    assert keys.NONE_HASH.hex() == REF_NONE
    h = keys.hash_block_tokens(None, range(16))
    assert h.hex() == REF_0_15
    assert keys.event_hash(h) == REF_EVENT
    assert keys.chain_hashes(list(range(16)), 16) == [h]


def test_reference_preimage_matches_independent_encoder() -> None:
    pre = keys.SCHEMES[keys.VLLM_SCHEME].preimage(None, range(16))
    assert pre == cbor((keys.NONE_HASH, tuple(range(16)), None))
    assert pre.hex() == "835820" + REF_NONE + "90" + bytes(range(16)).hex() + "f6"
    assert hashlib.sha256(cbor(keys.VLLM_SEED)).hexdigest() == REF_NONE


def test_chain_is_identical_under_any_pythonhashseed() -> None:
    code = (
        "from kvtier_protocol.keys import chain_hashes, ExtraKeys, MMItem\n"
        "e = ExtraKeys(lora_name='l', cache_salt='s', mm_items=(MMItem('m', 3, 40),))\n"
        "print(','.join(h.hex() for h in chain_hashes(list(range(100)), 16, extras=e)))\n"
        "print(','.join(h.hex() for h in chain_hashes(list(range(64)), 16, "
        "scheme='sglang-sha256-u32le', extras=ExtraKeys(lora_name='a', cache_salt='b'))))\n"
    )
    outputs = set()
    for seed in ("123", "random", "0"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(ROOT / "protocol")}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             check=True, cwd=ROOT, timeout=60)
        outputs.add(run.stdout)
    assert len(outputs) == 1
    e = ExtraKeys(lora_name="l", cache_salt="s", mm_items=(MMItem("m", 3, 40),))
    here = ",".join(h.hex() for h in keys.chain_hashes(list(range(100)), 16, extras=e))
    assert outputs.pop().splitlines()[0] == here


# --- properties -------------------------------------------------------------------------------

texts = st.text(max_size=12)
extra_key = st.one_of(
    st.tuples(st.just("lora"), texts, texts),
    st.tuples(st.just("mm"), texts, st.integers(-(1 << 40), 1 << 40)),
    st.tuples(st.just("cache_salt"), texts),
    st.tuples(st.just("prompt_embeds"), st.binary(min_size=32, max_size=32)),
)
token_lists = st.lists(st.integers(0, U64 - 1), max_size=40)


@settings(max_examples=150, deadline=None)
@given(parent=st.one_of(st.none(), st.binary(min_size=32, max_size=32)), tokens=token_lists,
       extra=st.one_of(st.none(), st.lists(extra_key, min_size=1, max_size=4).map(tuple)))
def test_preimage_agrees_with_independent_cbor(parent: bytes | None, tokens: list[int],
                                                extra: tuple[Any, ...] | None) -> None:
    want = cbor((parent or keys.NONE_HASH, tuple(tokens), extra))
    assert keys.SCHEMES[keys.VLLM_SCHEME].preimage(parent, tokens, extra) == want
    assert cbor2.dumps((parent or keys.NONE_HASH, tuple(tokens), extra), canonical=True) == want
    assert keys.hash_block_tokens(parent, tokens, extra) == hashlib.sha256(want).digest()


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 1 << 20), max_size=90), ht=st.sampled_from([1, 4, 16]),
       salt=st.one_of(st.none(), texts), cut=st.integers(0, 6))
def test_chain_equals_stepwise_and_continues(tokens: list[int], ht: int, salt: str | None,
                                             cut: int) -> None:
    e = ExtraKeys(cache_salt=salt, lora_name="x", mm_items=(MMItem("img", 5, 9),))
    chain = keys.chain_hashes(tokens, ht, extras=e)
    assert len(chain) == len(tokens) // ht
    parent = None
    for i, h in enumerate(chain):
        parent = keys.hash_block_tokens(parent, tokens[i * ht:(i + 1) * ht], e.for_unit(i * ht, (i + 1) * ht))
        assert parent == h
    cut = min(cut, len(chain))
    if cut:
        rest = keys.chain_hashes(tokens[cut * ht:], ht, extras=e, parent=chain[cut - 1], start=cut * ht)
        assert chain[:cut] + rest == chain


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, (1 << 63) - 1), max_size=40), ht=st.sampled_from([1, 3, 8]),
       extra_key=st.one_of(st.none(), texts), salt=st.one_of(st.none(), texts))
def test_sglang_chain_matches_reference(tokens: list[int], ht: int, extra_key: str | None,
                                        salt: str | None) -> None:
    e = ExtraKeys(lora_name=extra_key, cache_salt=salt)
    prior = sglang_seed_ref(extra_key, salt)
    assert keys.sglang_namespace_seed(extra_key, salt) == prior
    want = []
    for i in range(len(tokens) // ht):
        prior = sglang_ref(prior, tokens[i * ht:(i + 1) * ht])
        want.append(prior)
    assert keys.chain_hashes(tokens, ht, scheme=keys.SGLANG_SCHEME, extras=e) == want
    assert [keys.from_hex(keys.to_hex(h)) for h in want] == want


# --- extra keys -------------------------------------------------------------------------------


def test_extra_keys_follow_vllm_order_and_placement() -> None:
    d = hashlib.sha256(b"e").digest()
    e = ExtraKeys(lora_name="ad", lora_path="/p", cache_salt="t", prompt_embeds=(d, d),
                  mm_items=(MMItem("a", 4, 20), MMItem("b", 30, 2), MMItem("c", 40, 1)))
    assert e.for_unit(0, 16) == (("lora", "ad", "/p"), ("mm", "a", 4), ("cache_salt", "t"),
                                 ("prompt_embeds", d))
    assert e.for_unit(16, 32) == (("lora", "ad", "/p"), ("mm", "a", -12), ("mm", "b", 14),
                                  ("prompt_embeds", d))
    assert e.for_unit(32, 48) == (("lora", "ad", "/p"), ("mm", "c", 8))
    assert ExtraKeys().for_unit(0, 16) is None
    assert ExtraKeys(cache_salt="").for_unit(0, 16) is None  # vLLM: an empty salt is no salt
    assert keys.event_extra_keys(e.for_unit(0, 16)) == ("ad", ("a", 4), "t", d)
    assert keys.event_extra_keys(None) is None


def test_salt_changes_every_digest_but_enters_unit_zero_only() -> None:
    plain = keys.chain_hashes(list(range(48)), 16)
    salted = keys.chain_hashes(list(range(48)), 16, extras=ExtraKeys(cache_salt="tenant"))
    assert all(a != b for a, b in zip(plain, salted))
    assert keys.hash_block_tokens(salted[0], range(16, 32)) == salted[1]


@pytest.mark.parametrize("kwargs", [
    {"lora_name": 3}, {"lora_path": None}, {"cache_salt": b"x"}, {"cache_salt": "\ud800"},
    {"mm_items": (MMItem("a", 9, 1), MMItem("b", 2, 1))}, {"mm_items": [MMItem("a", 0, 1)]},
    {"mm_items": ("a",)}, {"prompt_embeds": (b"short",)},
])
def test_bad_extra_keys_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest):
        ExtraKeys(**kwargs)


@pytest.mark.parametrize("args", [(1, 0, 1), ("a", -1, 1), ("a", 0, 0), ("a", True, 1), ("\udfff", 0, 1)])
def test_bad_mm_items_are_rejected(args: tuple[Any, ...]) -> None:
    with pytest.raises(InvalidRequest):
        MMItem(*args)


# --- validation -------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [[-1], [U64], [1.0], [True], ["1"], [None], 5])
def test_bad_tokens_raise_invalid_key(tokens: Any) -> None:
    with pytest.raises(InvalidKey):
        keys.hash_block_tokens(None, tokens)
    with pytest.raises(InvalidKey):
        keys.chain_hashes(tokens if isinstance(tokens, list) else tokens, 1)


def test_scheme_specific_limits_and_inputs() -> None:
    keys.hash_block_tokens(None, [U64 - 1])
    with pytest.raises(InvalidKey):
        keys.hash_block_tokens(None, [1 << 63], scheme=keys.SGLANG_SCHEME)
    with pytest.raises(InvalidRequest):
        keys.hash_block_tokens(None, [1], ("lora", "a", ""), scheme=keys.SGLANG_SCHEME)
    with pytest.raises(InvalidRequest):
        keys.chain_hashes([1] * 16, 16, scheme=keys.SGLANG_SCHEME,
                          extras=ExtraKeys(mm_items=(MMItem("a", 0, 1),)))
    with pytest.raises(InvalidKey):
        keys.hash_block_tokens(None, [1], ["not", "a", "tuple"])
    with pytest.raises(InvalidKey):
        keys.hash_block_tokens(None, [1], (object(),))
    with pytest.raises(NamespaceError):
        keys.hash_block_tokens(None, [1], scheme="md5")
    with pytest.raises(NamespaceError):
        keys.get_scheme(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("parent", [b"x" * 31, b"x" * 33, "ab" * 32, 7])
def test_bad_parent_raises_invalid_key(parent: Any) -> None:
    for scheme in keys.SCHEMES:
        with pytest.raises(InvalidKey):
            keys.hash_block_tokens(parent, [1, 2], scheme=scheme)


def test_chain_arguments_are_checked() -> None:
    h = keys.chain_hashes(list(range(32)), 16)
    with pytest.raises(InvalidRequest):
        keys.chain_hashes([1], 0)
    with pytest.raises(InvalidRequest):
        keys.chain_hashes([1], 16, start=8, parent=h[0])
    with pytest.raises(InvalidRequest):
        keys.chain_hashes([1], 16, start=16)  # a continuation needs its parent
    with pytest.raises(InvalidRequest):
        keys.chain_hashes([1], 16, parent=h[0])
    assert keys.chain_hashes(list(range(31)), 16) == h[:1]  # the partial unit is not hashed
    assert keys.chain_hashes([], 16) == []


def test_block_keys_take_each_blocks_last_unit() -> None:
    units = [bytes([i]) * 32 for i in range(7)]
    assert keys.block_keys(units, 1) == units
    assert keys.block_keys(units, 2) == [units[1], units[3], units[5]]
    assert keys.block_keys(units, 8) == []
    with pytest.raises(InvalidRequest):
        keys.block_keys(units, 0)


def test_key_helpers() -> None:
    h = bytes(range(32))
    assert keys.check_chain_hash(h) is h
    assert keys.event_hash(h) == int.from_bytes(h[24:], "big")
    assert keys.to_hex(h) == h.hex() and keys.from_hex(h.hex()) == h
    for bad in (b"", h[:31], bytearray(h), h.hex()):
        with pytest.raises(InvalidKey):
            keys.check_chain_hash(bad)
    for bad in (h.hex().upper(), h.hex()[:-1], " " + h.hex()[1:], "g" * 64, h, None):
        with pytest.raises(InvalidKey):
            keys.from_hex(bad)
    with pytest.raises(InvalidKey):
        keys.event_hash(b"1234567")


# --- golden vectors ---------------------------------------------------------------------------


def extras_from(spec: dict[str, Any] | None) -> ExtraKeys | None:
    if spec is None:
        return None
    return ExtraKeys(lora_name=spec["lora_name"], lora_path=spec["lora_path"], cache_salt=spec["cache_salt"],
                     mm_items=tuple(MMItem(*m) for m in spec["mm_items"]),
                     prompt_embeds=tuple(bytes.fromhex(d) for d in spec["prompt_embeds_hex"]))


@pytest.mark.parametrize("fname", ["vllm_chains.json", "sglang_chains.json"])
def test_every_chain_vector_reproduces(fname: str) -> None:
    cases = json.loads((VECTORS / fname).read_text())["cases"]
    assert cases
    for c in cases:
        scheme, ht, tokens, e = c["scheme"], c["hash_tokens"], c["tokens"], extras_from(c["extras"])
        parent = bytes.fromhex(c["parent_hex"]) if c["parent_hex"] else None
        got = keys.chain_hashes(tokens, ht, scheme=scheme, extras=e, parent=parent, start=c["start"])
        assert [h.hex() for h in got] == [u["hash_hex"] for u in c["units"]], c["name"]
        seed = bytes.fromhex(c["seed_hex"]) if c["seed_hex"] else None
        prev = parent if c["start"] else seed
        if scheme == keys.SGLANG_SCHEME:
            assert seed == sglang_seed_ref(e.lora_name if e else None, e.cache_salt if e else None)
        for i, u in enumerate(c["units"]):
            pre = bytes.fromhex(u["preimage_hex"])
            if scheme == keys.VLLM_SCHEME:  # the SPEC's bytes, rebuilt without cbor2
                start = c["start"] + i * ht
                extra = e.for_unit(start, start + ht) if e else None
                assert pre == cbor((prev or keys.NONE_HASH, tuple(tokens[i * ht:(i + 1) * ht]), extra))
            else:
                assert hashlib.sha256(pre).digest() == sglang_ref(prev, tokens[i * ht:(i + 1) * ht])
            assert hashlib.sha256(pre).hexdigest() == u["hash_hex"]
            assert keys.event_hash(bytes.fromhex(u["hash_hex"])) == u["event_u64"]
            prev = bytes.fromhex(u["hash_hex"])
        first_unit = c["start"] // ht  # block keys count units from the request's first token
        assert [k.hex() for k in keys.block_keys(got, c["units_per_block"], first_unit)] == c["block_keys_hex"]


def test_vllm_reference_vector_file() -> None:
    ref = json.loads((VECTORS / "vllm_reference.json").read_text())
    assert ref["none_hash_hex"] == REF_NONE and ref["hash_hex"] == REF_0_15 and ref["event_u64"] == REF_EVENT
    assert bytes.fromhex(ref["seed_cbor_hex"]) == cbor(ref["seed"])
    assert bytes.fromhex(ref["preimage_hex"]) == cbor((keys.NONE_HASH, tuple(ref["tokens"]), None))


def test_continuation_vector_matches_the_full_chain() -> None:
    cases = {c["name"]: c for c in json.loads((VECTORS / "vllm_chains.json").read_text())["cases"]}
    for whole, part, first in (("blocks-of-2-units", "continuation", 2),
                               ("extras-two-images", "continuation-with-extras", 2),
                               ("blocks-of-2-units", "continuation-mid-block", 1)):
        full, cont = cases[whole], cases[part]
        assert cont["start"] == first * cont["hash_tokens"]
        n = len(cont["units"])
        assert [u["hash_hex"] for u in full["units"][first:first + n]] == [u["hash_hex"] for u in cont["units"]]
        # The continuation's block keys are the whole chain's keys of the blocks it completes.
        assert set(cont["block_keys_hex"]) <= set(full["block_keys_hex"])
    assert cases["continuation-mid-block"]["block_keys_hex"] == cases["blocks-of-2-units"]["block_keys_hex"][:2]


def test_block_keys_count_units_from_the_request_start() -> None:
    units = [bytes([i]) * 32 for i in range(6)]
    assert keys.block_keys(units, 2, first_unit=1) == [units[0], units[2], units[4]]
    assert keys.block_keys(units, 3, first_unit=4) == [units[1], units[4]]
    assert keys.block_keys(units, 2, first_unit=2) == keys.block_keys(units, 2)
    with pytest.raises(InvalidRequest):
        keys.block_keys(units, 2, first_unit=-1)


def test_generator_reproduces_the_files_byte_for_byte() -> None:
    path = ROOT / "protocol" / "vectors" / "gen_hashes.py"
    spec = importlib.util.spec_from_file_location("gen_hashes", path)
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    for name, doc in gen.build().items():
        assert (VECTORS / name).read_text(encoding="utf-8") == gen.dumps(doc) + "\n", name


def test_wide_sglang_page_has_odd_length_tag() -> None:
    pre = keys.SCHEMES[keys.SGLANG_SCHEME].preimage(None, [1, 1 << 32])
    assert pre == b"\xff" + struct.pack("<2Q", 1, 1 << 32)
    assert keys.SCHEMES[keys.SGLANG_SCHEME].preimage(None, [1, 2]) == struct.pack("<2I", 1, 2)
