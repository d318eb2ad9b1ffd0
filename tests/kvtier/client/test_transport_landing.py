"""load_into over TCP: each record's payload is received straight into the caller's buffer and
hashed as it lands (kvtier.client.steps.Landing, kvtier.client.transport), never copied after;
what cannot land (a miss, a record that is not what its header says, a buffer too small) is met
by the load as before."""

from __future__ import annotations

import time

import pytest

from kvtier.client import Client, ClientOptions, parse_address
from kvtier.client.steps import Call, Landing
from kvtier.client.transport import BlockingConnection
from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.header import payload_checksum, split_record
from tests.kvtier.client.clientkit import NS_ID, key, make_blocks
from tests.kvtier.client.peer import Peer
from tests.kvtier.waitkit import PATIENCE_S

MiB = 1 << 20


def _tcp(peer: Peer) -> str:
    return f"tcp://127.0.0.1:{peer.tcp_port}"


def _payloads(blocks: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [bytes(split_record(r)[1]) for _, r in blocks]


def test_a_gets_payloads_land_in_the_given_buffers_with_their_digests(peer: Peer) -> None:
    blocks = make_blocks(3, 2 * MiB, tag=b"land") + make_blocks(2, 4096, tag=b"land-small")
    keys = [k for k, _ in blocks]
    with Client(_tcp(peer)) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 5
    conn = BlockingConnection.open(parse_address(_tcp(peer)), ClientOptions(), time.monotonic() + PATIENCE_S)
    try:
        dests = [memoryview(bytearray(len(p) + 64)) for p in _payloads(blocks)]  # larger than needed: fine
        whole = [memoryview(bytearray(16)), *dests]  # the get's keys are the load's keys 1..5
        digests: list[int | None] = [None] * len(whole)
        deadline = time.monotonic() + PATIENCE_S
        r = conn.call(Call("get", {"ns_id": NS_ID, "hashes": keys}, into=Landing(whole, digests, first=1)), deadline)
        assert r.lens == tuple(len(rec) for _, rec in blocks)
        assert digests == [None, *(payload_checksum(p) for p in _payloads(blocks))]  # set only where landed
        assert [bytes(d[:len(p)]) for d, p in zip(dests, _payloads(blocks))] == _payloads(blocks)
        plain = conn.call(Call("get", {"ns_id": NS_ID, "hashes": keys[:1]}), deadline)  # no landing: as ever
        assert bytes(plain.payload) == blocks[0][1]
    finally:
        conn.close()


def test_load_into_over_tcp_gets_the_bytes_and_stops_at_a_miss(peer: Peer) -> None:
    blocks = make_blocks(4, MiB, tag=b"miss")
    keys = [k for k, _ in blocks]
    with Client(_tcp(peer)) as kv:
        assert kv.save(NS_ID, blocks[:2] + blocks[3:]) == ["stored"] * 3  # key 2 is missing
        dests = [bytearray(MiB) for _ in keys]
        assert len(kv.load_into(NS_ID, keys, dests)) == 2
        assert [bytes(d) for d in dests[:2]] == _payloads(blocks[:2])
        assert dests[3] == bytearray(MiB), "a buffer after the miss is left untouched"


def test_a_payload_that_does_not_match_its_checksum_is_a_miss(peer: Peer) -> None:
    blocks = make_blocks(3, MiB, tag=b"bad")
    keys = [k for k, _ in blocks]
    with Client(_tcp(peer)) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 3
        _, slot = peer.blocks[(NS_ID, keys[1])]
        peer.mm[slot[1] + 100] ^= 0xFF  # the stored payload of block 1 no longer matches its header
        dests = [bytearray(MiB) for _ in keys]
        assert len(kv.load_into(NS_ID, keys, dests)) == 1
        assert bytes(dests[0]) == _payloads(blocks)[0]


def test_a_buffer_too_small_is_refused_as_before(peer: Peer) -> None:
    blocks = make_blocks(2, MiB, tag=b"small")
    with Client(_tcp(peer)) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 2
        with pytest.raises(InvalidRequest, match="buffer 1 holds"):
            kv.load_into(NS_ID, [k for k, _ in blocks], [bytearray(MiB), bytearray(MiB - 32)])
        dests = [bytearray(MiB) for _ in blocks]  # the connection is still good for the next load
        assert len(kv.load_into(NS_ID, [k for k, _ in blocks], dests)) == 2
        assert [bytes(d) for d in dests] == _payloads(blocks)
        assert kv.load_into(NS_ID, [key(99, b"none")], [bytearray(16)]) == []
