"""Values read back from a remote tier are judged, never trusted: every malformation is a typed miss."""

from __future__ import annotations

import dataclasses
import hashlib

import cbor2
import pytest
import torch

from kvtier_protocol.block import encode_block
from kvtier_protocol.header import PREAMBLE_LEN, Section, decode_header, encode_header
from kvtier_protocol.namespace import NS_DOMAIN, Namespace

from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.verify import MissReason, verify_namespace, verify_record
from kvtier.daemon.store.config import tier_quant
from tests.kvtier.daemon.remote.remotekit import chain_hash, make_blocks, make_record, namespace_for

NS = namespace_for(64 << 10)
OTHER = namespace_for(64 << 10, model="another-model")
[(KEY, RECORD)] = make_blocks(NS, 1)


def test_a_whole_record_of_the_key_is_a_hit_with_its_payload() -> None:
    v = verify_record(KEY, RECORD, namespace=NS)
    assert v.ok and v.reason is None and v.detail == ""
    assert v.header is not None and v.header.chain_hash == KEY.chain_hash and v.header.ns_id == NS.ns_id
    assert v.payload is not None and bytes(v.payload) == RECORD[-NS.block_payload_bytes():]


def _flip(buf: bytes, at: int) -> bytes:
    return buf[:at] + bytes([buf[at] ^ 0x01]) + buf[at + 1:]


@pytest.mark.parametrize("value, reason", [
    (b"", MissReason.TRUNCATED),
    (RECORD[:PREAMBLE_LEN - 1], MissReason.TRUNCATED),
    (RECORD[:PREAMBLE_LEN + 10], MissReason.TRUNCATED),  # header map cut
    (RECORD[:-1], MissReason.TRUNCATED),  # payload one byte short
    (RECORD + b"\0", MissReason.BAD_HEADER),  # bytes after the payload
    (b"XXXX" + RECORD[4:], MissReason.BAD_HEADER),  # magic
    (_flip(RECORD, 4), MissReason.BAD_HEADER),  # version
    (_flip(RECORD, PREAMBLE_LEN + 3), MissReason.BAD_HEADER),  # a header byte: its xxh3 fails
    (_flip(RECORD, len(RECORD) - 1), MissReason.BAD_CHECKSUM),  # a payload byte
    (b"\0" * 4096, MissReason.BAD_HEADER),
])
def test_malformed_values_are_typed_misses(value: bytes, reason: MissReason) -> None:
    v = verify_record(KEY, value, namespace=NS)
    assert v.reason is reason, v.detail
    assert not v.ok and v.header is None and v.payload is None and v.detail


def test_a_valid_record_of_another_block_is_a_miss() -> None:
    other_ns = make_record(OTHER, KEY.chain_hash)  # same chain hash, another namespace
    assert verify_record(KEY, other_ns).reason is MissReason.WRONG_BLOCK
    other_hash = make_record(NS, chain_hash(99))
    assert verify_record(KEY, other_hash).reason is MissReason.WRONG_BLOCK


def test_a_record_that_names_the_key_but_lies_about_its_shape_is_a_miss() -> None:
    # Built for a namespace of another geometry, then stored under NS's ns_id: the header is
    # whole and names the key, but its block does not fit NS.
    wide = namespace_for(128 << 10)
    lying = make_record(wide, KEY.chain_hash)
    h, off = decode_header(lying)
    forged = encode_header(dataclasses.replace(h, ns_id=NS.ns_id)) + lying[off:]
    assert verify_record(KEY, forged).ok  # without the namespace only identity and checksum count
    v = verify_record(KEY, forged, namespace=NS)
    assert v.reason is MissReason.WRONG_GEOMETRY and "heads" in v.detail


def test_a_declared_payload_beyond_the_limit_is_refused_before_reading_it() -> None:
    v = verify_record(KEY, RECORD, max_payload_len=1024)
    assert v.reason is MissReason.TOO_LARGE


def test_namespace_bytes_are_accepted_only_when_they_hash_to_the_id() -> None:
    assert verify_namespace(NS.ns_id, NS.canonical_bytes()) == NS
    assert verify_namespace(NS.ns_id, OTHER.canonical_bytes()) is None
    assert verify_namespace(NS.ns_id, NS.canonical_bytes()[:-1]) is None
    assert verify_namespace(NS.ns_id, b"") is None
    # Bytes that hash right can only be the namespace's own: a valid CBOR map that is not a
    # namespace, stored under its own id, is still refused.
    junk = cbor2.dumps({"model": 1}, canonical=True)
    junk_id = hashlib.sha256(NS_DOMAIN + junk).digest()[:16]
    assert verify_namespace(junk_id, junk) is None


def test_remote_keys_are_checked() -> None:
    with pytest.raises(ValueError):
        RemoteKey("Tenant:A", NS.ns_id, KEY.chain_hash)
    with pytest.raises(ValueError):
        RemoteKey("a{b}", NS.ns_id, KEY.chain_hash)
    with pytest.raises(ValueError):
        RemoteKey("a", NS.ns_id[:15], KEY.chain_hash)
    with pytest.raises(ValueError):
        RemoteKey("a", NS.ns_id, b"short")
    assert RemoteKey.of("a", NS.ns_id + KEY.chain_hash) == RemoteKey("a", NS.ns_id, KEY.chain_hash)


# --- precision by tier (issue 25): re-encoded records of a raw namespace ---------------------------

def _recoded(ns: Namespace, chain: bytes, codec: str = "int8", *, layout: str | None = None,
             compression: str | None = None, k_axis: str = "channel") -> bytes:
    """The record a tier's re-encoding makes of block ``chain`` (raw bfloat16 KV of ``ns``)."""
    mla = ns.attention == "mla"
    shape = (ns.num_layers, ns.block_tokens, ns.head_dim + ns.mla_rope_dim) if mla else \
        (ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    return encode_block(x, ns_id=ns.ns_id, chain_hash=chain, parent_hash=None,
                        layout=layout or ("mla-latent" if mla else "canonical"), codec=codec,
                        mla_rope_dim=ns.mla_rope_dim if mla else 0, compression=compression,
                        quant=tier_quant(codec, k_axis, mla=mla))


def _forge(record: bytes, **changes: object) -> bytes:
    """``record`` with header fields replaced (the payload, and so its checksum, unchanged)."""
    h, off = decode_header(record)
    return encode_header(dataclasses.replace(h, **changes)) + record[off:]


MLA_NS = Namespace(model="remote-tests-mla", revision="r1", attention="mla", num_layers=2, num_kv_heads=1,
                   head_dim=64, head_dim_v=0, mla_rope_dim=8, block_tokens=16, hash_tokens=16)


@pytest.mark.parametrize("codec", ["int8", "int4", "int2", "fp8_e4m3"])
@pytest.mark.parametrize("ns", [NS, MLA_NS], ids=["mha", "mla"])
def test_a_re_encoding_of_a_raw_namespace_is_a_hit(codec: str, ns: Namespace) -> None:
    key = RemoteKey("default", ns.ns_id, chain_hash(7))
    for compression in (None, "lz4"):
        record = _recoded(ns, key.chain_hash, codec, compression=compression)
        v = verify_record(key, record, namespace=ns)
        assert v.ok, v.detail
        assert v.header is not None and v.header.codec == codec  # it says what it is: never raw


def test_a_re_encoding_must_be_one_the_tiers_produce() -> None:
    key = RemoteKey("default", NS.ns_id, chain_hash(7))
    good = _recoded(NS, key.chain_hash)
    h, _ = decode_header(good)

    def refused(value: bytes, namespace: Namespace = NS) -> str:
        v = verify_record(key, value, namespace=namespace)
        assert v.reason is MissReason.WRONG_GEOMETRY, v.detail
        return v.detail

    # Only raw namespaces are re-encoded: an int4 namespace's block in int8 is no tier's doing.
    int4 = dataclasses.replace(NS, kv_codec="int4")
    lossy_key = RemoteKey("default", int4.ns_id, key.chain_hash)
    v = verify_record(lossy_key, _forge(good, ns_id=int4.ns_id), namespace=int4)
    assert v.reason is MissReason.WRONG_GEOMETRY and "raw KV only" in v.detail
    # Sections that do not follow the codec's plan: the decoder would read the wrong bytes.
    a, b, c = h.sections
    shifted = (Section(a.name, 0, a.length - 2), Section(b.name, a.length - 2, b.length + 2), c)
    assert "plan" in refused(_forge(good, sections=shifted))
    # Quant parameters other than the plan's (another group size): the sections no longer fit.
    assert h.quant is not None
    assert "plan" in refused(_forge(good, quant=dataclasses.replace(h.quant, k_group=32, v_group=32)))
    # A codec name the format does not know, or one of another width than its parameters.
    assert "raw KV only" in refused(_forge(good, codec="int7"))
    assert refused(_forge(good, codec="int4"))
    # Another dtype than the namespace's, another shape: the geometry checks refuse them first.
    assert "dtype" in refused(_forge(good, dtype="float16"))
    # A compression stage of an algorithm no reader knows.
    packed = _recoded(NS, key.chain_hash, compression="lz4")
    ph, _ = decode_header(packed)
    assert ph.compression is not None
    assert "compression" in refused(_forge(packed, compression=dataclasses.replace(ph.compression, alg="zstd")))
    # The good record still is a hit; without its namespace only identity and checksum count.
    assert verify_record(key, good, namespace=NS).ok and verify_record(key, good).ok


@pytest.mark.parametrize("codec", ["int8", "int4", "int2"])
def test_a_re_encoding_with_k_per_token_is_a_hit_and_its_sections_must_fit_that_plan(codec: str) -> None:
    # [tiers.remote] k_axis = "token": the plan of the header's own quant decides the sections.
    key = RemoteKey("default", NS.ns_id, chain_hash(11))
    good = _recoded(NS, key.chain_hash, codec, k_axis="token")
    h, _ = decode_header(good)
    assert h.quant is not None and h.quant.k_axis == "token"
    assert verify_record(key, good, namespace=NS).ok
    # The same bytes claiming K per channel: the scales no longer have the plan's length.
    v = verify_record(key, _forge(good, quant=dataclasses.replace(h.quant, k_axis="channel")), namespace=NS)
    assert v.reason is MissReason.WRONG_GEOMETRY and "plan" in v.detail


def test_an_mla_re_encoding_keeps_the_namespaces_rope_dims_raw() -> None:
    key = RemoteKey("default", MLA_NS.ns_id, chain_hash(7))
    good = _recoded(MLA_NS, key.chain_hash)
    h, _ = decode_header(good)
    assert h.quant is not None and h.quant.rope_dims == 8 and verify_record(key, good, namespace=MLA_NS).ok
    v = verify_record(key, _forge(good, quant=dataclasses.replace(h.quant, rope_dims=0)), namespace=MLA_NS)
    assert v.reason is MissReason.WRONG_GEOMETRY and "quant" in v.detail


def test_a_re_encoding_in_a_non_canonical_layout_is_a_miss() -> None:
    # vllm-flash [L, 2, T, H, D]: the same numbers in another axis order decode wrong elements.
    ns = namespace_for(64 << 10)
    key = RemoteKey("default", ns.ns_id, chain_hash(3))
    good = _recoded(ns, key.chain_hash)
    h, _ = decode_header(good)
    L, _, H, T, D = h.shape
    v = verify_record(key, _forge(good, layout="vllm-flash", shape=(L, 2, T, H, D)), namespace=ns)
    assert v.reason is MissReason.WRONG_GEOMETRY and "canonical" in v.detail
