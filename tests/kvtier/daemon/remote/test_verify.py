"""Values read back from a remote tier are judged, never trusted: every malformation is a typed miss."""

from __future__ import annotations

import dataclasses
import hashlib

import cbor2
import pytest

from kvtier_protocol.header import PREAMBLE_LEN, decode_header, encode_header
from kvtier_protocol.namespace import NS_DOMAIN

from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.verify import MissReason, verify_namespace, verify_record
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
