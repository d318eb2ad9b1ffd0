"""The asyncio client against the toy peer (peer.py): pipelining, timeouts, reconnects, leases."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from kvtier.client import NO_HITS, AsyncClient, ConnectionLost, LookupResult, TimedOut
from kvtier_protocol.errors import FrameError, Unauthorized
from kvtier_protocol.frames import Frame, Limits
from tests.kvtier.client.clientkit import NS_ID, eventually, key, make_blocks, short_timeout
from tests.kvtier.client.peer import Peer
from tests.kvtier.waitkit import ManualClock, wait_until_async

MiB = 1 << 20


@pytest.mark.parametrize("path", ["unix", "tcp"])
async def test_round_trip_and_every_op(peer: Peer, path: str) -> None:
    address = peer.unix_path if path == "unix" else f"tcp://127.0.0.1:{peer.tcp_port}"
    blocks = make_blocks(3, 2 * MiB)
    keys = [k for k, _ in blocks]
    async with await AsyncClient.connect(address) as kv:
        assert (kv.session.shm is not None) == (path == "unix")
        assert await kv.save(NS_ID, blocks) == ["stored"] * 3
        assert await kv.lookup(NS_ID, keys) == LookupResult(3, ("host",) * 3)
        assert await kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert (await kv.stats())["blocks"] == 3
        assert await kv.ping() > 0
        assert await kv.delete(NS_ID, keys[2:]) == 1
        assert await kv.clear(NS_ID) == 2
        assert await kv.lookup(NS_ID, keys) is NO_HITS
    assert eventually(lambda: not peer.leases)


async def test_many_requests_in_flight_answered_out_of_order(peer: Peer) -> None:
    blocks = make_blocks(4, 64 << 10)
    keys = [k for k, _ in blocks]
    async with AsyncClient(peer.unix_path, timeout_s=60.0) as kv:
        await kv.save(NS_ID, blocks)
        gate = peer.gates["lookup"] = threading.Event()  # the lookups are answered last
        lookups = [asyncio.ensure_future(kv.lookup(NS_ID, keys[:i % 4 + 1])) for i in range(20)]
        loaded = await asyncio.gather(*[kv.load(NS_ID, keys[i:]) for i in range(4)])
        assert not any(t.done() for t in lookups), "later requests were answered first"
        assert loaded == [[r for _, r in blocks[i:]] for i in range(4)]
        gate.set()
        hits = await asyncio.gather(*lookups)
        assert [h.num_hits for h in hits] == [1, 2, 3, 4] * 5
    # Concurrency is shown by the peer, not by a stopwatch: it was answering all 20 lookups at once.
    assert peer.most_inflight >= 20, "the lookups ran concurrently on one connection"
    assert peer.ops["hello"] == 1


async def test_stuck_daemon_degrades_then_reconnects(peer: Peer) -> None:
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    clock = ManualClock()
    async with AsyncClient(peer.unix_path, timeout_s=30.0, holddown_s=5.0, clock=clock) as kv:
        await kv.save(NS_ID, blocks)
        peer.stalled.set()  # the peer reads requests and never answers them
        with short_timeout(kv):
            results = await asyncio.gather(kv.lookup(NS_ID, keys), kv.load(NS_ID, keys))
        assert results == [NO_HITS, []]
        seen = sum(peer.ops.values())
        assert await kv.lookup(NS_ID, keys) is NO_HITS  # within the hold-down: not even asked
        assert sum(peer.ops.values()) == seen
        clock.advance(5.0)
        with short_timeout(kv), pytest.raises(TimedOut):
            await kv.lookup(NS_ID, keys, degrade=False)
        peer.stalled.clear()
        clock.advance(5.0)
        assert await kv.load(NS_ID, keys) == [r for _, r in blocks]
    assert peer.ops["hello"] >= 2


async def test_lost_connection_fails_waiters_who_retry(peer: Peer) -> None:
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    async with AsyncClient(peer.unix_path, timeout_s=60.0) as kv:
        await kv.save(NS_ID, blocks)
        gate = peer.gates["lookup"] = threading.Event()  # unanswered until the connection drops
        pending = [asyncio.ensure_future(kv.lookup(NS_ID, keys)) for _ in range(8)]
        await wait_until_async(lambda: peer.inflight == 8, what="the 8 lookups reaching the peer")
        peer.drop_connections()  # the connection they were sent on is gone before any answer...
        gate.set()  # ...and their retries on a new connection are answered
        assert [h.num_hits for h in await asyncio.gather(*pending)] == [2] * 8
    assert peer.ops["hello"] == 2


async def test_save_is_not_retried_after_commit_was_sent(peer: Peer) -> None:
    blocks = make_blocks(1, 4096)
    async with AsyncClient(peer.unix_path) as kv:
        peer.drop_on.add("commit")
        with pytest.raises(ConnectionLost):
            await kv.save(NS_ID, blocks)
        peer.drop_on.add("reserve")
        assert await kv.save(NS_ID, blocks) == ["stored"]
    assert peer.ops["reserve"] == 3 and peer.ops["commit"] == 2


async def test_cancelled_load_releases_its_pin(peer: Peer) -> None:
    blocks = make_blocks(2, 4096)
    async with AsyncClient(peer.unix_path, timeout_s=60.0) as kv:
        await kv.save(NS_ID, blocks)
        gate = peer.gates["acquire"] = threading.Event()
        task = asyncio.ensure_future(kv.load(NS_ID, [k for k, _ in blocks]))
        await wait_until_async(lambda: peer.inflight == 1, what="the acquire reaching the peer")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()  # the grant arrives after the load was cancelled
        await wait_until_async(lambda: peer.ops["release"] == 1 and not peer.leases,
                               what="the late grant's release")  # the late grant was released
        assert await kv.ping() > 0  # the connection stays usable


async def test_token_and_dead_daemon(make_peer: Callable[..., Peer]) -> None:
    peer = make_peer(token="t0k")
    tcp = f"127.0.0.1:{peer.tcp_port}"
    with pytest.raises(Unauthorized):
        await AsyncClient.connect(tcp, token="nope")
    async with AsyncClient(tcp, token="t0k", holddown_s=0) as kv:
        assert await kv.lookup(NS_ID, [key(1)]) is NO_HITS
        assert kv.session.shm is None
        peer.stop()
        peer.stop = lambda: None  # type: ignore[method-assign]
        assert await kv.lookup(NS_ID, [key(1)]) is NO_HITS
        with pytest.raises(ConnectionLost):
            await kv.lookup(NS_ID, [key(1)], degrade=False)


async def test_in_flight_requests_stay_within_the_daemons_limit(make_peer: Callable[..., Peer]) -> None:
    peer = make_peer(limits=Limits(max_inflight=3))
    peer.delays["ping"] = 0.05
    async with AsyncClient(peer.unix_path) as kv:
        await asyncio.gather(*[kv.ping() for _ in range(12)])
    assert peer.ops["ping"] == 12 and peer.most_inflight == 3


async def test_malformed_response_breaks_only_that_connection(peer: Peer) -> None:
    async with AsyncClient(peer.unix_path) as kv:
        await kv.ping()
        peer.bad_reply.add("stats")
        with pytest.raises(FrameError):
            await kv.stats()
        peer.bad_reply.clear()
        assert (await kv.stats())["blocks"] == 0  # a fresh connection
    assert peer.ops["hello"] == 2


async def test_large_payloads_travel_unjoined_and_land_in_reused_buffers(peer: Peer) -> None:
    blocks = make_blocks(3, 2 << 20, tag=b"aio-pooled")  # above kvtier_protocol.frame_stream.POOLED_PAYLOAD_BYTES
    async with AsyncClient(f"127.0.0.1:{peer.tcp_port}") as kv:
        assert await kv.save(NS_ID, blocks) == ["stored"] * 3  # one 6 MiB put frame, written unjoined
        kept = await kv.load(NS_ID, [blocks[0][0]], degrade=False)  # the caller keeps this record
        for k, record in blocks[1:] * 2:  # later answers are received into the pool's buffers
            assert await kv.load(NS_ID, [k], degrade=False) == [record]
        assert kept == [blocks[0][1]]  # never changed under its holder
        dest = [bytearray(len(r)) for _, r in blocks]
        headers = await kv.load_into(NS_ID, [k for k, _ in blocks], dest, degrade=False)
        assert [bytes(d[:h.payload_len]) for d, h in zip(dest, headers)] == [
            r[len(r) - h.payload_len:] for (_, r), h in zip(blocks, headers)]


async def test_a_release_due_while_a_large_frame_goes_out_follows_that_frame(peer: Peer) -> None:
    # A lease release comes up (the answer of a cancelled acquire) while a large frame is being
    # written in slices: written then it would land inside that frame, so it waits for its end.
    async with AsyncClient(f"127.0.0.1:{peer.tcp_port}") as kv:
        await kv.ping()
        conn = kv._conn
        assert conn is not None
        async with conn._writing:  # as while a put frame goes out slice by slice
            conn._abandoned("acquire", Frame({"id": 99, "ok": True, "lease": 7}, None))
            assert len(conn._held_back) == 1 and peer.ops["release"] == 0
        blocks = make_blocks(2, MiB, tag=b"held")  # one put frame above JOIN_WRITE_BYTES: sliced
        assert await kv.save(NS_ID, blocks) == ["stored", "stored"]
        assert conn._held_back == []
        assert eventually(lambda: peer.ops["release"] == 1)
        assert await kv.load(NS_ID, [k for k, _ in blocks]) == [r for _, r in blocks]


@pytest.mark.parametrize("announced", [True, False])
async def test_releases_go_quiet_only_to_a_daemon_that_announced_it(peer: Peer, announced: bool) -> None:
    peer.quiet_release = announced  # False: a daemon from before SPEC 7.4's quiet releases
    blocks = make_blocks(3, 4096)
    keys = [k for k, _ in blocks]
    async with await AsyncClient.connect(peer.unix_path) as kv:
        assert await kv.save(NS_ID, blocks) == ["stored"] * 3
        for _ in range(3):  # each load's release: answered and dropped, or never answered
            assert await kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert kv.session.quiet_release is announced
        assert await kv.ping() > 0
        assert eventually(lambda: peer.ops["release"] >= 3 and not peer.leases)
        assert (peer.last["release"].quiet is True) is announced
