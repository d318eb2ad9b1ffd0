"""Header templates: a header decoded by matching a template is exactly the header a full decode
gives, and anything a template cannot vouch for is decoded (and refused) in full."""

from __future__ import annotations

import random
from dataclasses import replace

import msgpack
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier_protocol import header_decode as H
from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import PREAMBLE, PREAMBLE_LEN, BlockHeader, Section, decode_header, encode_header
from kvtier_protocol.header_templates import ABSENT, TemplateCache
from kvtier_protocol.quant import QuantParams

NS = bytes(range(16))


def header(i: int = 0, **changes) -> BlockHeader:
    fields = dict(ns_id=NS, chain_hash=i.to_bytes(32, "big"), parent_hash=(i + 1).to_bytes(32, "big"),
                  num_tokens=16, layout="canonical", shape=(2, 2, 2, 16, 8), dtype="bfloat16", codec="raw",
                  sections=(Section("payload", 0, 2048),), payload_len=2048, checksum=1000 + i)
    return BlockHeader(**{**fields, **changes})


def wrap(body: bytes) -> bytes:
    return PREAMBLE.pack(b"KVT1", 1, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body


@pytest.fixture(autouse=True)
def fresh_memos():
    """Every test starts with no memo and no template, and leaves none behind."""
    H._DECODED.clear()
    H._TEMPLATES.clear()
    yield
    H._DECODED.clear()
    H._TEMPLATES.clear()


def full_decode(buf: bytes, **limits) -> BlockHeader | type:
    """What decode_header says with no memo and no template: the header, or the error's type."""
    saved = dict(H._DECODED), H._TEMPLATES
    H._DECODED.clear()
    H._TEMPLATES = TemplateCache(H.MIN_HASH_LEN, H.MAX_HASH_LEN)
    try:
        return decode_header(buf, **limits)[0]
    except KVTierError as e:
        return type(e)
    finally:
        H._DECODED.clear()
        H._DECODED.update(saved[0])
        H._TEMPLATES = saved[1]


def fast_decode(buf: bytes, **limits) -> BlockHeader | type:
    """What decode_header says with the templates learnt so far (and no exact-bytes memo)."""
    H._DECODED.clear()
    try:
        return decode_header(buf, **limits)[0]
    except KVTierError as e:
        return type(e)


def test_a_stream_of_headers_after_the_first_is_decoded_by_template():
    first = encode_header(header(0))
    full_decode(first)  # learns nothing: the full decode above runs on a private cache
    assert len(H._TEMPLATES) == 0
    assert fast_decode(first) == header(0)
    assert len(H._TEMPLATES) == 1, "the first full decode of a canonical header leaves a template"
    for i, h in enumerate([header(1), header(2, parent_hash=None), header(3, checksum=(1 << 64) - 1),
                           header(4, checksum=0), header(5, checksum=255)]):
        buf = encode_header(h)
        H._DECODED.clear()
        assert H._TEMPLATES.match(buf[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is not None, i
        got = fast_decode(buf)
        assert got == h and got == full_decode(buf)
        assert type(got.checksum) is int and type(got.num_tokens) is int and all(type(v) is int for v in got.shape)
    assert len(H._TEMPLATES) == 1, "one stream, one template"
    # Hashes of another length (another hashing scheme) are another stream: decoded in full once,
    # then by a template of their own.
    other = [encode_header(header(6 + i, chain_hash=bytes([7 + i]) * 8, parent_hash=b"\x08" * 8)) for i in range(2)]
    assert H._TEMPLATES.match(other[0][PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is None
    assert fast_decode(other[0]) == full_decode(other[0])
    assert H._TEMPLATES.match(other[1][PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is not None
    assert fast_decode(other[1]) == full_decode(other[1]) and len(H._TEMPLATES) == 2


def test_templates_are_per_geometry_namespace_and_limit():
    for h in (header(0), header(1, shape=(2, 2, 2, 16, 4), sections=(Section("payload", 0, 1024),),
                                 payload_len=1024),
              header(2, ns_id=bytes(16))):
        fast_decode(encode_header(h))
    assert len(H._TEMPLATES) == 3
    assert fast_decode(encode_header(header(9)), max_payload_len=1024) is H.LimitExceeded
    assert fast_decode(encode_header(header(9, shape=(2, 2, 2, 16, 4), sections=(Section("payload", 0, 1024),),
                                            payload_len=1024)), max_payload_len=1024).payload_len == 1024


def test_created_and_quant_and_ns_fields_headers_match_their_own_templates():
    q = QuantParams(bits=8)
    kinds = [dict(created_ms=1_700_000_000_000), dict(ns_fields={"model": "m", "block_tokens": 16}),
             dict(codec="int8", quant=q, sections=(Section("data", 0, 1024), Section("scales", 1024, 64)),
                  payload_len=1088)]
    for kind in kinds:
        for i in range(3):
            h = header(i, **kind)
            if "created_ms" in kind:
                h = replace(h, created_ms=kind["created_ms"] + i)
            buf = encode_header(h)
            got = fast_decode(buf)
            assert got == h == full_decode(buf)


def test_a_header_with_created_does_not_match_a_template_without_it():
    fast_decode(encode_header(header(0)))
    buf = encode_header(header(1, created_ms=5))
    assert H._TEMPLATES.match(buf[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is None
    assert fast_decode(buf) == header(1, created_ms=5)


def _canonical_body(m: dict) -> bytes:
    return msgpack.packb(m, use_bin_type=True)


def _map(h: BlockHeader) -> dict:
    return msgpack.unpackb(encode_header(h)[PREAMBLE_LEN:], raw=False)


@pytest.mark.parametrize("change", [
    {"tokens": 16.0},                      # 16 == 16.0 in Python; a template must never say so
    {"tokens": True},
    {"csum": -1},
    {"csum": 1.5},
    {"csum": True},
    {"hash": b"\x01" * 7},                 # too short
    {"hash": "a-string"},
    {"parent": b"\x01" * 65},              # too long
    {"parent": 0},
    {"created": -5},
    {"created": "yesterday"},
    {"shape": [2, 2, 2, 16, 8.0]},
])
def test_a_varying_or_retyped_value_is_judged_as_the_full_decode_judges_it(change):
    fast_decode(encode_header(header(0)))
    m = _map(header(1))
    m.update(change)
    buf = wrap(_canonical_body(m))
    assert fast_decode(buf) == full_decode(buf)
    assert isinstance(fast_decode(buf), type), "every one of these headers is invalid"


def test_duplicate_keys_and_non_canonical_encodings_never_match():
    fast_decode(encode_header(header(0)))
    body = encode_header(header(1))[PREAMBLE_LEN:]
    # a second "csum" key appended: a map of one more entry (fixmap 0x8d -> 0x8e)
    dup = bytes([body[0] + 1]) + body[1:] + msgpack.packb("csum") + msgpack.packb(5)
    assert fast_decode(wrap(dup)) is H.HeaderError is full_decode(wrap(dup))
    # the checksum written as a non-minimal uint64: valid msgpack, decoded in full, same header
    h = header(2, checksum=7)
    canon = encode_header(h)[PREAMBLE_LEN:]
    wide = canon.replace(msgpack.packb("csum") + b"\x07", msgpack.packb("csum") + b"\xcf" + (7).to_bytes(8, "big"))
    assert wide != canon
    assert fast_decode(wrap(wide)) == h == full_decode(wrap(wide))


def test_learn_refuses_what_cannot_be_a_template():
    cache: TemplateCache[str] = TemplateCache(8, 64)
    body = encode_header(header(0))[PREAMBLE_LEN:]
    assert cache.learn(body, 100, "h")
    assert cache.match(body, 100) == ("h", [header(0).chain_hash, header(0).parent_hash, 1000, ABSENT])
    assert cache.match(body, 101) is None, "another payload limit is another template"
    m = _map(header(0))
    wide = body.replace(msgpack.packb("csum") + msgpack.packb(1000),
                        msgpack.packb("csum") + b"\xcf" + (1000).to_bytes(8, "big"))
    assert not cache.learn(wide, 100, "w"), "not canonical"
    hash_first = _canonical_body({"hash": m.pop("hash"), **m})
    assert not cache.learn(hash_first, 100, "f"), "a varying key among the prefix bytes"
    assert not cache.learn(b"\xc1", 100, "x") and not cache.learn(msgpack.packb([1, 2]), 100, "x")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_a_mutated_header_is_judged_as_the_full_decode_judges_it(data):
    """Differential: flip, insert or drop bytes of a stream header's map (the preamble's xxh3 fixed
    up, so the map itself is what is judged); with a template in place the answer is the same."""
    H._DECODED.clear()
    H._TEMPLATES.clear()
    fast_decode(encode_header(header(0, created_ms=1)))
    body = bytearray(encode_header(header(data.draw(st.integers(1, 1 << 20)), created_ms=2))[PREAMBLE_LEN:])
    for _ in range(data.draw(st.integers(1, 3))):
        pos = data.draw(st.integers(0, len(body) - 1))
        op = data.draw(st.sampled_from(["flip", "set", "insert", "drop"]))
        if op == "flip":
            body[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "set":
            body[pos] = data.draw(st.integers(0, 255))
        elif op == "insert":
            body.insert(pos, data.draw(st.integers(0, 255)))
        elif len(body) > 1:
            del body[pos]
    buf = wrap(bytes(body))
    assert fast_decode(buf) == full_decode(buf)


def test_fuzz_varying_values_of_every_encoding():
    """Every msgpack width of csum and created, nil and bin parents: template answers equal full ones."""
    rng = random.Random(7)
    fast_decode(encode_header(header(0, created_ms=0)))
    matched = 0
    for _ in range(500):
        csum = rng.choice([0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1,
                           rng.randrange(1 << 64)])
        created = rng.choice([0, 127, 1 << 40, (1 << 64) - 1])
        length = rng.choice([32, 32, 32, rng.randint(8, 64)])  # mostly one scheme's length: templated
        parent = rng.choice([None, rng.randbytes(length), rng.randbytes(rng.randint(8, 64))])
        h = header(rng.randrange(1 << 30), checksum=csum, created_ms=created, parent_hash=parent,
                   chain_hash=rng.randbytes(length))
        buf = encode_header(h)
        H._DECODED.clear()
        matched += H._TEMPLATES.match(buf[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is not None
        assert fast_decode(buf) == h == full_decode(buf)
    assert matched > 250, "most of these went through a template"


def test_threads_decoding_and_learning_at_once_agree_with_the_full_decode():
    """Decoders run on several threads (the daemon's I/O pool, a client's callers): matching while
    other threads learn templates of other geometries never fails or answers differently."""
    import threading

    shapes = [(2, 2, 2, 16, 8 * k) for k in range(1, 9)]
    streams = [[encode_header(header(i, shape=s, sections=(Section("payload", 0, 256 * s[-1]),),
                                     payload_len=256 * s[-1])) for i in range(60)] for s in shapes]
    expected = [[full_decode(b) for b in stream] for stream in streams]
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for _ in range(3):
                for buf, want in zip(streams[k], expected[k]):
                    got = decode_header(buf)[0]
                    assert got == want
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(streams))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# --- kvtier's own streams (keys in WIRE_KEYS order, no ``created``): match() reads their groups by
# number and _specialize builds the header without the frozen class's setters. Each answer there
# must be the full decode's, header or error.

LLAMA_NS_FIELDS = {"model": "meta-llama/Llama-3.1-8B", "revision": "main", "attention": "mha", "num_layers": 2,
                   "num_kv_heads": 2, "head_dim": 8, "head_dim_v": 8, "mla_rope_dim": 0, "kv_dtype": "bfloat16",
                   "kv_codec": "raw", "block_tokens": 16, "hash_tokens": 16, "tp_rank": 0, "tp_size": 1}


def llama_header(i: int = 0, **changes) -> BlockHeader:
    """A connector's header: as :func:`header`, with the namespace map after the checksum."""
    from types import MappingProxyType

    return header(i, **{"ns_fields": MappingProxyType(dict(LLAMA_NS_FIELDS)), **changes})


def _standard_template_of(h: BlockHeader) -> None:
    fast_decode(encode_header(h))
    (t,) = [t for ts in H._TEMPLATES._by_prefix.values() for t in ts]
    assert t.standard, "kvtier's writers' headers take the unrolled path"


@pytest.mark.parametrize("make", [header, llama_header])
def test_a_templated_header_is_a_frozen_block_header_equal_to_the_full_decode(make):
    _standard_template_of(make(0))
    for h in [make(1), make(2, parent_hash=None), make(3, checksum=0), make(4, checksum=(1 << 32) - 1),
              make(5, checksum=1 << 32)]:
        buf = encode_header(h)
        assert H._TEMPLATES.match(buf[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is not None
        got = fast_decode(buf)
        assert type(got) is BlockHeader and got == h == full_decode(buf)
        assert [getattr(got, f) for f in BlockHeader.__slots__] == [getattr(h, f) for f in BlockHeader.__slots__]
        assert [type(getattr(got, f)) for f in BlockHeader.__slots__] == \
            [type(getattr(full_decode(buf), f)) for f in BlockHeader.__slots__]
        with pytest.raises(AttributeError):  # FrozenInstanceError is one
            got.checksum = 1
        if h.ns_fields is None:
            assert hash(got) == hash(h)


@pytest.mark.parametrize("make", [header, llama_header])
@pytest.mark.parametrize("mask", [0x01, 0x80, 0xFF])
def test_every_byte_of_a_standard_header_flipped_is_judged_as_the_full_decode_judges_it(make, mask):
    """Exhaustive over positions: each byte of the map flipped (the preamble's xxh3 fixed up, so
    the map itself is judged), and each byte of the whole record flipped as it is (a checksum or
    preamble error); the templated answer is always the full decode's."""
    _standard_template_of(make(0))
    buf = encode_header(make(7, checksum=0x0123456789ABCDEF))
    body = buf[PREAMBLE_LEN:]
    for pos in range(len(body)):
        mutated = bytearray(body)
        mutated[pos] ^= mask
        rec = wrap(bytes(mutated))
        assert fast_decode(rec) == full_decode(rec), pos
    for pos in range(len(buf)):
        mutated = bytearray(buf)
        mutated[pos] ^= mask
        assert fast_decode(bytes(mutated)) == full_decode(bytes(mutated)), pos


FIXED_FIELD_CHANGES = [
    dict(num_tokens=8, shape=(2, 2, 2, 8, 8), sections=(Section("payload", 0, 1024),), payload_len=1024),
    dict(shape=(2, 2, 2, 16, 16), sections=(Section("payload", 0, 4096),), payload_len=4096),
    dict(layout="vllm-flash", shape=(2, 2, 16, 2, 8)),  # same tokens and bytes, another layout
    dict(dtype="float16"),
    dict(codec="int8", quant=QuantParams(bits=8), sections=(Section("data", 0, 1024), Section("scales", 1024, 64)),
         payload_len=1088),
    dict(ns_id=bytes(range(1, 17))),
    dict(chain_hash=bytes(16)),  # another hash length
    dict(parent_hash=bytes(40)),
    dict(created_ms=1),
    dict(extra=(("zz", 1),)),
]


@pytest.mark.parametrize("make", [header, llama_header])
@pytest.mark.parametrize("change", FIXED_FIELD_CHANGES, ids=lambda c: "+".join(c))
def test_a_header_that_differs_from_a_template_in_a_fixed_field_is_decoded_in_full(make, change):
    _standard_template_of(make(0))
    h = make(1, **change)
    buf = encode_header(h)
    assert H._TEMPLATES.match(buf[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is None
    assert fast_decode(buf) == h == full_decode(buf)


@pytest.mark.parametrize("make", [header, llama_header])
@pytest.mark.parametrize("key, value", [
    ("tokens", 17), ("tokens", 16.0), ("layout", "canonicaL"), ("shape", [2, 2, 2, 16, 9]), ("dtype", "bfloat17"),
    ("codec", "rav"), ("sections", [["payload", 0, 2047]]), ("plen", 2047), ("csum_alg", "xxh3-65"),
    ("quant", {}), ("ns_fields", {"model": "other"}), ("ns_fields", None), ("ns", bytes(15)),
])
def test_a_map_that_differs_from_a_template_in_one_value_is_judged_as_the_full_decode_judges_it(make, key, value):
    """One fixed key's value changed in the map (valid or not): never the template's answer."""
    _standard_template_of(make(0))
    m = _map(make(1))
    m[key] = value
    rec = wrap(_canonical_body(m))
    assert H._TEMPLATES.match(rec[PREAMBLE_LEN:], H.DEFAULT_MAX_PAYLOAD_LEN) is None
    assert fast_decode(rec) == full_decode(rec)


@settings(max_examples=200, deadline=None)
@given(i=st.integers(0, 1 << 30), hash_len=st.sampled_from([32, 32, 8, 64, 20]),
       parent=st.sampled_from(["none", "same", "other"]), csum=st.integers(0, (1 << 64) - 1),
       fields=st.booleans(), cut=st.integers(0, 600))
def test_fuzz_random_stream_headers_and_their_truncations(i, hash_len, parent, csum, fields, cut):
    """Random headers of a few streams, whole and cut short anywhere (the preamble kept honest):
    the templated answer is the full decode's."""
    H._DECODED.clear()
    H._TEMPLATES.clear()
    make = llama_header if fields else header
    _standard_template_of(make(0))
    chain = (i * 7919).to_bytes(8, "big") * 8
    up = {"none": None, "same": chain[:hash_len][::-1], "other": bytes(min(64, hash_len + 1))}[parent]
    h = make(i, chain_hash=chain[:hash_len], parent_hash=up, checksum=csum)
    buf = encode_header(h)
    assert fast_decode(buf) == h == full_decode(buf)
    body = buf[PREAMBLE_LEN:]
    rec = wrap(body[:cut % (len(body) + 1)])
    assert fast_decode(rec) == full_decode(rec)


def test_the_preamble_of_an_exact_header_is_judged_as_the_full_decode_judges_it():
    """decode_header's straight path for exactly-a-header bytes (_templated) takes only plain
    preambles whose lengths and xxh3 agree; every other preamble gets the full decode's answer."""
    from kvtier_protocol.compression import FLAG_COMPRESSED, Compression

    _standard_template_of(llama_header(0))
    buf = encode_header(llama_header(1))
    body = buf[PREAMBLE_LEN:]
    xxh = xxhash.xxh3_64_intdigest(body)
    cases = [buf[:n] for n in range(PREAMBLE_LEN + 1)]  # cut inside the preamble, or an empty map
    cases += [PREAMBLE.pack(b"KVT1", 1, 0, len(body) + d, xxh) + body for d in (-1, 1, 1 << 20)]
    cases += [PREAMBLE.pack(b"KVT1", 1, flags, len(body), xxh) + body for flags in (FLAG_COMPRESSED, 2, 0x8000)]
    cases += [PREAMBLE.pack(b"KVT1", 2, 0, len(body), xxh) + body, PREAMBLE.pack(b"KVT2", 1, 0, len(body), xxh) + body,
              PREAMBLE.pack(b"KVT1", 1, 0, len(body), xxh ^ 1) + body, buf + b"\0", bytearray(buf), memoryview(buf)]
    for case in cases:
        assert fast_decode(case) == full_decode(case), bytes(case[:PREAMBLE_LEN])
    # a compressed stream's template, and its map under a preamble that says "not compressed"
    comp = llama_header(0, compression=Compression("lz4", ((2, 2048),)), sections=(Section("payload", 0, 1000),),
                        payload_len=1000)
    H._TEMPLATES.clear()
    fast_decode(encode_header(comp))
    body = encode_header(replace(comp, chain_hash=bytes(32)))[PREAMBLE_LEN:]
    assert H._TEMPLATES.match(body, H.DEFAULT_MAX_PAYLOAD_LEN) is not None
    plain = wrap(body)
    assert fast_decode(plain) is H.HeaderError is full_decode(plain)
    assert fast_decode(encode_header(replace(comp, chain_hash=bytes(32)))) == replace(comp, chain_hash=bytes(32))
