"""Tests of kvtier_protocol.header: the block record preamble, header map, limits and fuzzing."""

from __future__ import annotations

import dataclasses
import math
import random
import struct
import subprocess
import sys
import tracemalloc

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_protocol.dtypes import DTYPE_SIZES, check_dtype, dtype_size
from kvtier_protocol.errors import (BadMagic, ChecksumMismatch, HeaderError, KVTierError,
                                    LimitExceeded, Truncated, UnsupportedVersion)
from kvtier_protocol.header import (_DECODED, PREAMBLE, PREAMBLE_LEN, REQUIRED_KEYS, BlockHeader, Section,
                                    decode_header, encode_header, parse_preamble,
                                    payload_checksum, record_len, split_record, verify_payload)
from kvtier_protocol.layouts import LAYOUTS, Geometry
from kvtier_protocol.quant import QuantParams

NS = bytes(range(16))
HASH = bytes(range(32, 64))


def raw_header(**changes) -> BlockHeader:
    """A valid raw bfloat16 canonical header of a (2, 2, 2, 4, 8) block."""
    fields = dict(ns_id=NS, chain_hash=HASH, parent_hash=None, num_tokens=4, layout="canonical",
                  shape=(2, 2, 2, 4, 8), dtype="bfloat16", codec="raw",
                  sections=(Section("payload", 0, 512),), payload_len=512, checksum=7)
    return BlockHeader(**{**fields, **changes})


def wire_map(h: BlockHeader) -> dict:
    body = encode_header(h)[PREAMBLE_LEN:]
    return msgpack.unpackb(body, raw=False)


def wrap(body: bytes, *, version: int = 1, flags: int = 0) -> bytes:
    """A preamble with a correct header checksum in front of an arbitrary map body."""
    return PREAMBLE.pack(b"KVT1", version, flags, len(body), xxhash.xxh3_64_intdigest(body)) + body


def record_of(m: dict, payload: bytes = b"") -> bytes:
    return wrap(msgpack.packb(m, use_bin_type=True)) + payload


# --- encoding -----------------------------------------------------------------------------------


def test_encode_header_layout_and_key_order() -> None:
    h = raw_header()
    buf = encode_header(h)
    magic, version, flags, header_len, xxh = PREAMBLE.unpack_from(buf)
    assert (magic, version, flags, header_len) == (b"KVT1", 1, 0, len(buf) - 20)
    assert xxh == xxhash.xxh3_64_intdigest(buf[20:])
    assert list(wire_map(h)) == list(REQUIRED_KEYS)
    assert decode_header(buf) == (h, len(buf))


def test_optional_and_unknown_keys_round_trip_byte_identically() -> None:
    h = raw_header(created_ms=1_700_000_000_000, ns_fields={"model": "m", "num_layers": 2},
                   extra=(("x-new", [1, b"\x00", "s"]), ("x-later", {"a": None})))
    buf = encode_header(h)
    assert list(wire_map(h))[-4:] == ["ns_fields", "created", "x-new", "x-later"]
    decoded, _ = decode_header(buf)
    assert decoded == h
    assert encode_header(decoded) == buf


def test_keys_in_any_order_are_accepted() -> None:
    m = wire_map(raw_header())
    shuffled = dict(reversed(list(m.items())))
    h, _ = decode_header(record_of(shuffled))
    assert h == raw_header()


def test_record_helpers() -> None:
    payload = bytes(range(256)) * 2
    h = raw_header(checksum=payload_checksum(payload))
    rec = encode_header(h) + payload
    assert record_len(h) == len(rec)
    got, view = split_record(rec)
    assert got == h and bytes(view) == payload
    verify_payload(h, view)
    assert parse_preamble(rec) == len(rec) - 512 - 20
    # xxh3-64 with seed 0 of the empty string: pins the algorithm and seed.
    assert payload_checksum(b"") == 0x2D06800538D394C2
    got, view = split_record(bytearray(rec))
    assert bytes(view) == payload


def test_quantized_header_round_trip() -> None:
    q = QuantParams(4, k_group=32, v_group=32)
    h = raw_header(codec="int4", quant=q, sections=(Section("payload", 0, 128), Section("scales", 128, 16),
                                                    Section("mins", 144, 16)), payload_len=160)
    assert decode_header(encode_header(h))[0] == h
    assert h.section("scales") == Section("scales", 128, 16)
    with pytest.raises(HeaderError):
        h.section("rope")


def test_dtypes_table() -> None:
    assert dtype_size("bfloat16") == 2 and dtype_size("float32") == 4 and dtype_size("uint8") == 1
    assert set(DTYPE_SIZES) == {"float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
                                "int8", "uint8"}
    with pytest.raises(HeaderError):
        check_dtype("float64")
    with pytest.raises(HeaderError):
        dtype_size(3)


def test_header_module_does_not_import_torch() -> None:
    code = "import sys, kvtier_protocol.header, kvtier_protocol.dtypes; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    dict(ns_id=b"short"), dict(chain_hash=b"1234567"), dict(chain_hash=b"x" * 65),
    dict(parent_hash=b""), dict(num_tokens=3), dict(layout="nope"), dict(shape=(2, 3, 2, 4, 8)),
    dict(shape=(2, 2, 2, 4)), dict(dtype="float64"), dict(codec="RAW"), dict(codec=""),
    dict(checksum_alg="crc32"), dict(checksum=-1), dict(checksum=1 << 64),
    dict(quant=QuantParams(8)), dict(sections=(Section("payload", 0, 256),)),
    dict(sections=(Section("data", 0, 512),)), dict(payload_len=513),
    dict(sections=(Section("payload", 0, 256), Section("rest", 256, 256))),
    dict(sections=()), dict(created_ms=-5), dict(extra=(("ns", 1),)), dict(ns_fields={1: 2}),
    dict(num_tokens=True),
])
def test_invalid_headers_are_refused(changes: dict) -> None:
    with pytest.raises(HeaderError):
        raw_header(**changes)


@pytest.mark.parametrize("sections", [
    (Section("payload", 0, 100), Section("scales", 90, 70)),   # overlap
    (Section("payload", 0, 100), Section("scales", 110, 50)),  # gap
    (Section("payload", 10, 150),),                            # not from 0
    (Section("payload", 0, 100), Section("payload", 100, 60)), # duplicate name
    (Section("payload", 0, 100), Section("scales", 100, 70)),  # beyond plen
])
def test_quantized_sections_must_tile_the_payload(sections: tuple) -> None:
    with pytest.raises(HeaderError):
        raw_header(codec="int8", quant=QuantParams(8), sections=sections, payload_len=160)


@pytest.mark.parametrize("mutate", [
    lambda m: m.pop("csum"), lambda m: m.pop("quant"), lambda m: m.update(tokens=True),
    lambda m: m.update(tokens=4.0), lambda m: m.update(ns="x" * 16), lambda m: m.update(shape=(2,)),
    lambda m: m.update(sections=[["payload", 0]]), lambda m: m.update(sections="payload"),
    lambda m: m.update(quant=[]), lambda m: m.update(ns_fields=[1]), lambda m: m.update(created="now"),
    lambda m: m.update(shape=[2, 2, 2, 4, "8"]), lambda m: m.update(plen=-1),
])
def test_wrong_map_types_are_header_errors(mutate) -> None:
    m = wire_map(raw_header())
    mutate(m)
    with pytest.raises(HeaderError):
        decode_header(record_of(m))


def test_duplicate_keys_and_non_map_bodies_are_refused() -> None:
    body = msgpack.packb(wire_map(raw_header()), use_bin_type=True)
    # Append a second "csum" entry: bump the fixmap count (0x8d = 13 entries) to 14.
    assert body[0] == 0x8D
    dup = bytes([0x8E]) + body[1:] + msgpack.packb("csum") + msgpack.packb(8)
    with pytest.raises(HeaderError, match="duplicate"):
        decode_header(wrap(dup))
    for body in (msgpack.packb([1, 2]), msgpack.packb({1: 2}), b"", b"\xc1", body + b"\x00"):
        with pytest.raises(HeaderError):
            decode_header(wrap(body))


def test_bool_typed_fields_and_shapes_are_refused_after_the_fast_paths_ran() -> None:
    """The typed-map fast path and the (layout, shape) memo never let a bool pass for an int."""
    good = wire_map(raw_header())
    assert decode_header(record_of(good))[0] == raw_header()  # memoises canonical (2, 2, 2, 4, 8)
    for key in ("tokens", "plen", "csum"):
        with pytest.raises(HeaderError):
            decode_header(record_of({**good, key: True}))
    with pytest.raises(HeaderError, match="layout or shape"):
        decode_header(record_of({**good, "shape": [2, True, 2, 4, 8]}))  # (2, 1, ...) == (2, True, ...)
    with pytest.raises(HeaderError, match="layout or shape"):
        raw_header(shape=(2, 2, 2, 4, True))
    with pytest.raises(HeaderError):
        decode_header(record_of({**good, "sections": [("payload", 0, 512)], "shape": [2, 2, 2, 4, 8, 1]}))


def test_nested_duplicate_keys_are_refused() -> None:
    good = wire_map(raw_header(ns_fields={"model": "m"}))
    body = msgpack.packb(good, use_bin_type=True)
    inner = msgpack.packb({"model": "m"})
    assert inner in body
    dup = body.replace(inner, bytes([0x82]) + inner[1:] + msgpack.packb("model") + msgpack.packb("n"))
    with pytest.raises(HeaderError, match="duplicate"):
        decode_header(wrap(dup))


def test_headers_with_optional_and_unknown_keys_decode_like_plain_ones() -> None:
    h = raw_header(ns_fields={"model": "m", "layers": [1, {"a": 2}]}, created_ms=5, extra=(("zz", {"k": [1]}),))
    back, _ = decode_header(encode_header(h))
    assert back == h and back.extra == (("zz", {"k": [1]}),)


# --- preamble and limits ------------------------------------------------------------------------


def test_preamble_errors() -> None:
    body = encode_header(raw_header())[PREAMBLE_LEN:]
    good = wrap(body)
    with pytest.raises(Truncated):
        decode_header(good[:19])
    with pytest.raises(Truncated):
        decode_header(good[:-1])
    with pytest.raises(BadMagic):
        decode_header(b"KVT2" + good[4:])
    with pytest.raises(UnsupportedVersion):
        decode_header(wrap(body, version=2))
    for flags in (2, 0x8000, 0x0003):  # bits no reader knows (bit 0 is "compressed", SPEC 4.8)
        with pytest.raises(UnsupportedVersion):
            decode_header(wrap(body, flags=flags))
    with pytest.raises(HeaderError, match="disagree"):  # the compressed bit without the key
        decode_header(wrap(body, flags=1))
    with pytest.raises(ChecksumMismatch):
        decode_header(good[:12] + struct.pack("<Q", 1) + good[20:])


def test_limits_are_checked_before_allocating() -> None:
    # A preamble declaring a 4 GiB header on a 20-byte buffer: refused as too large, not truncated.
    huge = PREAMBLE.pack(b"KVT1", 1, 0, 0xFFFFFFFF, 0)
    with pytest.raises(LimitExceeded):
        decode_header(huge)
    with pytest.raises(LimitExceeded):
        decode_header(encode_header(raw_header()), max_header_len=100)
    # A consistent map declaring a 2^62-byte payload (and tensor): refused from the header alone.
    m = wire_map(raw_header())
    shape = (1 << 29, 2, 1 << 29, 1, 4)
    m.update(shape=list(shape), tokens=1, plen=math.prod(shape) * 2, sections=[["payload", 0, math.prod(shape) * 2]])
    assert m["plen"] == 1 << 62
    rec = record_of(m)
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded):
            split_record(rec)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    with pytest.raises(LimitExceeded):
        decode_header(encode_header(raw_header()), max_payload_len=511)


def test_decoded_tensor_size_is_bounded_for_quantized_codecs() -> None:
    h = raw_header(codec="int8", quant=QuantParams(8), shape=(64, 2, 64, 4, 1024), num_tokens=4,
                   sections=(Section("payload", 0, 100),), payload_len=100)
    with pytest.raises(LimitExceeded):
        decode_header(encode_header(h), max_payload_len=1 << 20)


def test_payload_checks() -> None:
    payload = bytes(512)
    h = raw_header(checksum=payload_checksum(payload))
    flipped = bytearray(payload)
    flipped[100] ^= 0x10
    with pytest.raises(ChecksumMismatch):
        verify_payload(h, flipped)
    with pytest.raises(Truncated):
        verify_payload(h, payload[:-1])
    with pytest.raises(ChecksumMismatch):
        verify_payload(h, payload + b"\x00")
    rec = encode_header(h) + payload
    with pytest.raises(Truncated):
        split_record(rec[:-1])
    with pytest.raises(HeaderError):
        split_record(rec + b"\x00")


# --- property tests -----------------------------------------------------------------------------


@st.composite
def headers(draw) -> BlockHeader:
    layout = LAYOUTS[draw(st.sampled_from(sorted(LAYOUTS)))]
    size = st.integers(1, 64)
    if layout.is_mla:
        g = Geometry(draw(size), draw(size), latent_dim=draw(size))
    else:
        g = Geometry(draw(size), draw(size), draw(size), draw(size))
    shape = layout.shape_for(g)
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    digest = st.binary(min_size=8, max_size=64)
    common = dict(ns_id=draw(st.binary(min_size=16, max_size=16)), chain_hash=draw(digest),
                  parent_hash=draw(st.none() | digest), num_tokens=g.num_tokens, layout=layout.name,
                  shape=shape, dtype=dtype, checksum=draw(st.integers(0, (1 << 64) - 1)),
                  created_ms=draw(st.none() | st.integers(0, 1 << 50)),
                  extra=tuple(draw(st.dictionaries(st.from_regex(r"x-[a-z]{1,8}", fullmatch=True),
                                                   st.integers(-5, 5) | st.text(max_size=4),
                                                   max_size=2)).items()))
    if draw(st.booleans()):
        n = math.prod(shape) * DTYPE_SIZES[dtype]
        return BlockHeader(codec="raw", sections=(Section("payload", 0, n),), payload_len=n, **common)
    lengths = draw(st.lists(st.integers(0, 10_000), min_size=1, max_size=4))
    names = ["payload", "scales", "mins", "rope"][: len(lengths)]
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    return BlockHeader(codec=draw(st.sampled_from(["int8", "int4", "int2", "fp8_e4m3"])),
                       quant=QuantParams(draw(st.sampled_from([2, 4, 8])),
                                         k_group=draw(st.integers(0, 128))),
                       sections=tuple(map(Section, names, offsets, lengths)),
                       payload_len=sum(lengths), **common)


@settings(max_examples=200, deadline=None)
@given(headers())
def test_random_headers_round_trip(h: BlockHeader) -> None:
    buf = encode_header(h)
    decoded, offset = decode_header(buf, max_payload_len=1 << 62)
    assert decoded == h and offset == len(buf)
    assert encode_header(decoded) == buf
    assert dataclasses.replace(decoded) == h


# --- fuzzing ------------------------------------------------------------------------------------


def _fuzz_cases(rng: random.Random, n: int) -> list[bytes]:
    """Random byte strings, bit-flipped records, byte-mutated maps behind a valid header checksum,
    and structurally mutated maps (a key dropped or given an odd value) behind a valid checksum."""
    base_h = raw_header(codec="int8", quant=QuantParams(8), payload_len=48,
                        sections=(Section("payload", 0, 32), Section("scales", 32, 8), Section("mins", 40, 8)),
                        created_ms=5, extra=(("x-k", [1, 2]),))
    base = encode_header(base_h) + bytes(48)
    body = base[PREAMBLE_LEN:-48]
    base_map = msgpack.unpackb(body, raw=False)
    odd = [None, True, -1, 0, 1, (1 << 64) - 1, 2**40, "", "x" * 40, "raw", "canonical", b"",
           b"\x00" * 16, [], {}, [1, 2], [["payload", 0, 48]], {"bits": 8}, 1.5, [2, 2, 2, 4, 8]]
    cases = []
    for i in range(n):
        kind = i % 5
        if kind == 4:
            m = dict(base_map)
            for _ in range(rng.randrange(1, 3)):
                key = rng.choice(list(m))
                if rng.random() < 0.2:
                    del m[key]
                else:
                    m[key] = rng.choice(odd)
            cases.append(record_of(m, bytes(48)))
            continue
        if kind == 0:
            cases.append(rng.randbytes(rng.randrange(0, 64)))
        elif kind == 1:
            b = bytearray(base)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            cases.append(bytes(b[: rng.randrange(len(b) + 1)] if rng.random() < 0.2 else b))
        elif kind == 2:
            b = bytearray(body)
            for _ in range(rng.randrange(1, 6)):
                op = rng.randrange(3)
                pos = rng.randrange(len(b))
                if op == 0:
                    b[pos] = rng.randrange(256)
                elif op == 1:
                    del b[pos: pos + rng.randrange(1, 8)]
                else:
                    b[pos:pos] = rng.randbytes(rng.randrange(1, 8))
            cases.append(wrap(bytes(b)) + bytes(48))
        else:
            cases.append(b"KVT1" + rng.randbytes(rng.randrange(0, 40)))
    return cases


def test_fuzz_decode_header_raises_only_typed_errors() -> None:
    rng = random.Random(20260101)
    outcomes = {"ok": 0, "error": 0}
    for case in _fuzz_cases(rng, 10_000):
        try:
            h, off = decode_header(case)
        except KVTierError:
            outcomes["error"] += 1
        else:
            assert off <= len(case) and isinstance(h, BlockHeader)
            outcomes["ok"] += 1
    # The map mutations must reach the parser and validator, not stop at the checksum.
    assert outcomes["error"] > 5_000 and outcomes["ok"] > 0


# --- the decoded-header memo --------------------------------------------------------------------


def test_a_header_decoded_again_is_the_same_and_a_changed_byte_is_still_caught() -> None:
    buf = encode_header(raw_header(checksum=12345))
    first, off = decode_header(buf)
    again, off2 = decode_header(bytearray(buf) + b"payload follows")  # another buffer, same header bytes
    assert again == first and off2 == off
    for i in (5, PREAMBLE_LEN + 3, len(buf) - 1):  # version, the map, its last byte
        flipped = bytearray(buf)
        flipped[i] ^= 0x01
        with pytest.raises(KVTierError):
            decode_header(flipped)
    with pytest.raises(LimitExceeded):  # the payload limit is part of what was decoded
        decode_header(buf, max_payload_len=100)


def test_exactly_a_memoised_header_is_looked_up_first_but_within_the_header_limit() -> None:
    # bytes holding exactly a header decoded before (an acquire answer's) skip the preamble parse;
    # a smaller max_header_len than the one they were decoded under still refuses them.
    buf = encode_header(raw_header(checksum=31337))
    first, off = decode_header(bytearray(buf))  # memoised
    assert decode_header(bytes(buf)) == (first, len(buf)) and off == len(buf)
    with pytest.raises(LimitExceeded):
        decode_header(bytes(buf), max_header_len=len(buf) - PREAMBLE_LEN - 1)
    assert decode_header(bytes(buf) + b"payload")[0] is first  # longer bytes: the full path


def test_headers_with_namespace_fields_are_memoised_read_only() -> None:
    fields = {"model": "m", "num_layers": 2, "tenant_salt": ""}
    buf = encode_header(dataclasses.replace(raw_header(checksum=777), ns_fields=fields))
    first = decode_header(buf)[0]
    assert decode_header(bytes(buf))[0] is first, "the connectors' headers are decoded once"
    assert first.ns_fields == fields
    with pytest.raises(TypeError):
        first.ns_fields["model"] = "other"  # type: ignore[index]
    nested = encode_header(dataclasses.replace(raw_header(checksum=778), ns_fields={"model": "m", "list": [1, 2]}))
    a, b = decode_header(nested)[0], decode_header(nested)[0]
    assert a == b and a is not b, "a mutable value inside: decoded afresh every time"


def test_a_header_encoded_here_decodes_from_the_memo_equal_to_a_fresh_decode() -> None:
    h = raw_header(checksum=4242)
    buf = encode_header(h)
    memo = decode_header(buf)[0]
    assert memo is h, "a client checking the record it just built pays a dict lookup"
    _DECODED.clear()
    fresh = decode_header(buf)[0]
    assert fresh == h and fresh is not h
    assert {type(v) for v in (*fresh.shape, fresh.num_tokens)} == {type(v) for v in (*h.shape, h.num_tokens)}
    flipped = bytearray(buf)
    flipped[-1] ^= 0x01
    with pytest.raises(KVTierError):
        decode_header(flipped)
    with pytest.raises(LimitExceeded):  # a smaller limit is another memo key: decoded and refused
        decode_header(buf, max_payload_len=10)
