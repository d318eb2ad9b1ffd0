"""The blocking connection: hello with descriptors, error responses, broken streams."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from kvtier.client import Client, ClientOptions, ConnectionLost, TimedOut, parse_address
from kvtier.client.steps import Call
from kvtier.client.transport import BlockingConnection
from kvtier_protocol.errors import FrameError, InvalidRequest, LeaseError, LimitExceeded
from kvtier_protocol.frames import Limits
from tests.kvtier.client.clientkit import NS_ID, key, make_blocks
from tests.kvtier.client.peer import Peer
from tests.kvtier.waitkit import PATIENCE_S


def opened(address: str, **options: object) -> BlockingConnection:
    return BlockingConnection.open(parse_address(address), ClientOptions(**options),  # type: ignore[arg-type]
                                   time.monotonic() + PATIENCE_S)


def deadline() -> float:
    """The deadline of a call that must succeed: one no busy machine comes near."""
    return time.monotonic() + PATIENCE_S


def test_hello_maps_segments_on_unix_only(peer: Peer) -> None:
    unix, tcp = opened(peer.unix_path), opened(f"127.0.0.1:{peer.tcp_port}")
    assert unix.session.shm is not None and unix.session.shm.segments[0].size == peer.size
    assert tcp.session.shm is None and tcp.session.server == "peer"
    for conn in (unix, tcp):
        conn.close()
        assert conn.closed
    assert unix.session.shm.closed


def test_error_responses_are_typed_and_keep_the_connection(peer: Peer) -> None:
    conn = opened(f"127.0.0.1:{peer.tcp_port}")
    with pytest.raises(LeaseError):
        conn.call(Call("release", {"lease": 12345}), deadline())
    with pytest.raises(InvalidRequest):
        conn.call(Call("acquire", {"ns_id": NS_ID, "hashes": [key(0)]}), deadline())  # no shm on TCP
    assert not conn.closed
    assert conn.call(Call("ping"), deadline()).id > 0
    conn.close()


def test_requests_above_the_daemons_limits_are_not_sent(make_peer: Callable[..., Peer]) -> None:
    peer = make_peer(limits=Limits(max_header_len=256))
    conn = opened(peer.unix_path)
    with pytest.raises(LimitExceeded):
        conn.call(Call("lookup", {"ns_id": NS_ID, "hashes": [key(i) for i in range(20)]}), deadline())
    assert not conn.closed and peer.ops["lookup"] == 0
    conn.close()


def test_malformed_response_closes_the_connection(peer: Peer) -> None:
    conn = opened(peer.unix_path)
    peer.bad_reply.add("lookup")
    with pytest.raises(FrameError):
        conn.call(Call("lookup", {"ns_id": NS_ID, "hashes": [key(0)]}), deadline())
    assert conn.closed
    with pytest.raises(ConnectionLost):
        conn.call(Call("ping"), deadline())


def test_silence_and_hangups(peer: Peer) -> None:
    conn = opened(peer.unix_path)
    peer.stalled.set()
    start = time.monotonic()
    with pytest.raises(TimedOut):
        conn.call(Call("ping"), time.monotonic() + 0.2)
    # it waited out its deadline (a lower bound no slow machine can break), then gave the connection up
    assert time.monotonic() - start >= 0.2 and conn.closed
    peer.stalled.clear()
    conn = opened(peer.unix_path)
    peer.drop_connections()
    with pytest.raises(ConnectionLost):
        conn.call(Call("ping"), deadline())
    assert conn.closed


def test_large_payloads_are_received_into_reused_buffers_that_never_change_a_kept_record(peer: Peer) -> None:
    blocks = make_blocks(3, 2 << 20, tag=b"pooled")  # each get answer is above POOLED_PAYLOAD_BYTES
    with Client(f"127.0.0.1:{peer.tcp_port}") as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 3
        kept = kv.load(NS_ID, [blocks[0][0]], degrade=False)  # the caller keeps this record
        for key, record in blocks[1:] * 2:  # later answers land in the pool's buffers
            assert kv.load(NS_ID, [key], degrade=False) == [record]
        assert kept == [blocks[0][1]]
        dest = [bytearray(len(r)) for _, r in blocks]
        headers = kv.load_into(NS_ID, [k for k, _ in blocks], dest, degrade=False)
        assert [bytes(d[:h.payload_len]) for d, h in zip(dest, headers)] == [
            r[len(r) - h.payload_len:] for (_, r), h in zip(blocks, headers)]
