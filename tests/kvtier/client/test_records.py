"""Records in and out: splitting before a save, and verification of what comes back."""

from __future__ import annotations

import pytest

from kvtier.client.records import check_hashes, check_ns_id, prepare_records, verified_record
from kvtier_protocol.errors import HeaderError, InvalidKey, InvalidRequest
from tests.kvtier.client.clientkit import NS_ID, OTHER_NS_ID, key, make_blocks, make_record


def test_prepare_splits_header_and_payload() -> None:
    (k, record), = make_blocks(1, 4096)
    rec, = prepare_records(NS_ID, [(k, bytearray(record))])
    assert rec.key == k and rec.payload.nbytes == 4096
    assert rec.header + bytes(rec.payload) == record and rec.record.nbytes == len(record)


def test_prepare_refuses_foreign_or_malformed_records() -> None:
    (k, record), = make_blocks(1, 4096)
    with pytest.raises(InvalidRequest):
        prepare_records(OTHER_NS_ID, [(k, record)])
    with pytest.raises(InvalidRequest):
        prepare_records(NS_ID, [(key(5), record)])
    with pytest.raises(HeaderError):
        prepare_records(NS_ID, [(k, record + b"x")])  # bytes after the payload
    with pytest.raises(InvalidKey):
        prepare_records(NS_ID, [(b"tiny", record)])


def test_verified_record_turns_every_defect_into_a_miss() -> None:
    k = key(1)
    record = make_record(NS_ID, k, 4096)
    assert verified_record(NS_ID, k, memoryview(record)) == record
    flipped_payload = bytearray(record)
    flipped_payload[-1] ^= 1
    flipped_header = bytearray(record)
    flipped_header[30] ^= 1
    for bad in (flipped_payload, flipped_header, record[:-1], record[:10], b""):
        assert verified_record(NS_ID, k, bytes(bad)) is None
    assert verified_record(NS_ID, key(2), record) is None  # another key's block
    assert verified_record(OTHER_NS_ID, k, record) is None


def test_key_checks() -> None:
    assert check_ns_id(bytearray(NS_ID)) == NS_ID
    assert check_hashes([memoryview(key(0))]) == [key(0)]
    for bad in (NS_ID[:15], "x" * 16, None):
        with pytest.raises(InvalidKey):
            check_ns_id(bad)  # type: ignore[arg-type]
    for bad_hash in (b"1234567", b"x" * 65, 12):
        with pytest.raises(InvalidKey):
            check_hashes([bad_hash])  # type: ignore[list-item]


def test_check_hashes_fast_and_slow_paths() -> None:
    keys = [key(i) for i in range(300)]
    assert check_hashes(keys) == keys and check_hashes(tuple(keys)) == keys
    assert check_hashes(iter(keys[:3])) == keys[:3]  # any iterable, walked once
    assert check_hashes([bytearray(keys[0]), memoryview(keys[1])]) == keys[:2]
    assert check_hashes([b"a" * 8, b"b" * 64]) == [b"a" * 8, b"b" * 64] and check_hashes([]) == []
    for bad in ([keys[0], b"a" * 7], [b"a" * 65], [keys[0], "x" * 32], [None], [keys[0], 5]):
        with pytest.raises(InvalidKey):
            check_hashes(bad)
