"""Pipelined save and load over shared memory (kvtier/client/save.py, load.py), with both drivers:
many sub-batches in flight, refusals and errors in the middle of a pipeline, and a daemon that
dies in the middle of one (the real daemon, killed at a chosen step of the flow)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

import pytest

from kvtier.client import AsyncClient, Client, ConnectionLost
from kvtier.client.core import Job
from kvtier.client.load import load_flow
from kvtier.client.save import save_flow
from kvtier.client.steps import Call
from kvtier.client.records import prepare_records
from kvtier_protocol.errors import ChecksumMismatch
from kvtier_protocol.frames import Limits
from tests.kvtier.client.clientkit import NS_ID, eventually, key, make_blocks, make_record
from tests.kvtier.client.peer import Peer
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.waitkit import wait_until_async

KiB, MiB = 1 << 10, 1 << 20
BLOCK = 256 * KiB


PIPE = 1 * MiB  # sub-batches of four 256 KiB blocks


def _save_load(address: str, blocks: list[tuple[bytes, bytes]], driver: str,
               pipeline_bytes: int = PIPE, grant_bytes: int = 0) -> tuple[list[str], list[bytes]]:
    """One save (reserve/commit: no granted slots unless ``grant_bytes``), then one load (calls that
    must succeed: a timeout no busy machine comes near)."""
    keys = [k for k, _ in blocks]
    if driver == "sync":
        with Client(address, timeout_s=60.0, pipeline_bytes=pipeline_bytes, grant_bytes=grant_bytes) as kv:
            return kv.save(NS_ID, blocks), kv.load(NS_ID, keys, degrade=False)

    async def run() -> tuple[list[str], list[bytes]]:
        async with AsyncClient(address, timeout_s=60.0, pipeline_bytes=pipeline_bytes,
                               grant_bytes=grant_bytes) as kv:
            return await kv.save(NS_ID, blocks), await kv.load(NS_ID, keys, degrade=False)
    return asyncio.run(run())


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_many_sub_batches_travel_while_the_client_copies(peer: Peer, driver: str) -> None:
    blocks = make_blocks(24, BLOCK, tag=driver.encode())
    peer.overlap["commit"] = 3  # a commit is answered once three requests wait at once: only a pipeline gets there
    saved, loaded = _save_load(peer.unix_path, blocks, driver)
    assert saved == ["stored"] * 24
    assert loaded == [r for _, r in blocks]  # in order, whole and verified
    # 24 blocks, 4 per sub-batch, the first and the last split 1+3 and 3+1
    assert peer.ops["reserve"] == peer.ops["commit"] == 8
    assert peer.ops["acquire"] >= 3  # the first sized by FIRST_KEYS, the others from the slots seen
    assert peer.most_inflight >= 3, "reserves, commits and acquires overlapped"
    assert eventually(lambda: peer.ops["release"] == peer.ops["acquire"] and not peer.leases)


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_full_store_mid_pipeline_answers_full_for_the_rest(make_peer: Callable[..., Peer],
                                                             driver: str) -> None:
    peer = make_peer(segment_bytes=10 * BLOCK)
    blocks = make_blocks(16, BLOCK, tag=driver.encode())
    saved, loaded = _save_load(peer.unix_path, blocks, driver)
    assert saved == ["stored"] * 10 + ["full"] * 6
    assert loaded == [r for _, r in blocks[:10]]  # the prefix ends at the first block not stored
    assert eventually(lambda: not peer.leases), "every reservation committed or released"


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_commit_refused_mid_pipeline_raises_its_typed_error(peer: Peer,
                                                               driver: str) -> None:
    blocks = make_blocks(12, BLOCK, tag=driver.encode())
    bad = bytearray(blocks[5][1])
    bad[-1] ^= 0xFF  # block 5 (third sub-batch, blocks 4-7): its payload no longer matches its checksum
    blocks[5] = (blocks[5][0], bytes(bad))
    with pytest.raises(ChecksumMismatch):
        _save_load(peer.unix_path, blocks, driver)
    assert (NS_ID, blocks[0][0]) in peer.blocks and (NS_ID, blocks[5][0]) not in peer.blocks
    assert eventually(lambda: not peer.leases), "reservations are committed, or end with the connection"
    # 1 + 3 + 4 (refused) + 3 + 1 blocks: all sent before the refusal is known (the peer may
    # miss the last when the client's close resets the connection with answers unread)
    assert peer.ops["commit"] >= 4


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_connection_lost_mid_save_is_not_retried_and_mid_load_is(peer: Peer,
                                                                   driver: str) -> None:
    blocks = make_blocks(12, BLOCK, tag=driver.encode())
    peer.drop_on.add("commit")  # the first commit: the second reserve is already in flight
    with pytest.raises(ConnectionLost):
        _save_load(peer.unix_path, blocks, driver)
    # Never sent again = no second attempt, which would start on a new connection (a new hello).
    # (The commits of later sub-batches may reach the peer on the same connection before it drops
    # it: its read loop can take several pipelined frames before the first one's task runs.)
    assert peer.ops["commit"] >= 1 and peer.ops["hello"] == 1, "a save whose commit was sent is never sent again"
    peer.drop_on.add("release")  # the first release of the load: the next acquire is in flight
    saved, loaded = _save_load(peer.unix_path, blocks, driver)
    assert saved == ["stored"] * 12 and loaded == [r for _, r in blocks], "the load was tried again"


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_corrupt_block_ends_a_pipelined_load_and_the_acquire_ahead_is_released(
        peer: Peer, driver: str) -> None:
    blocks = make_blocks(16, BLOCK, tag=driver.encode())
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path, pipeline_bytes=PIPE) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 16
    _, slot = peer.blocks[(NS_ID, keys[5])]
    peer.mm[slot[1]] ^= 0xFF  # block 5: in the second acquire (keys 4-7), the third already asked for

    if driver == "sync":
        with Client(peer.unix_path, pipeline_bytes=PIPE) as kv:
            assert kv.load(NS_ID, keys) == [r for _, r in blocks[:5]]
            assert kv.ping() > 0  # the sync driver reads the forgotten answer with the next one
            assert eventually(lambda: not peer.leases)
    else:
        async def run() -> None:
            async with AsyncClient(peer.unix_path, pipeline_bytes=PIPE) as kv:
                assert await kv.load(NS_ID, keys) == [r for _, r in blocks[:5]]
                await wait_until_async(lambda: not peer.leases, what="the acquire ahead being released")
        asyncio.run(run())
    assert peer.ops["acquire"] == 3 and peer.ops["release"] == 3


@pytest.mark.parametrize("driver", ["sync", "aio"])
@pytest.mark.parametrize("how", ["pipeline_bytes=0", "max_inflight=2"])
def test_without_a_pipeline_every_answer_is_awaited(make_peer: Callable[..., Peer], driver: str,
                                                    how: str) -> None:
    peer = make_peer(limits=Limits(max_inflight=2)) if how == "max_inflight=2" else make_peer()
    blocks = make_blocks(12, BLOCK, tag=driver.encode())
    peer.delays.update(commit=0.01)
    saved, loaded = _save_load(peer.unix_path, blocks, driver, 0 if how == "pipeline_bytes=0" else PIPE)
    assert saved == ["stored"] * 12 and loaded == [r for _, r in blocks]
    assert peer.most_inflight == 1
    assert peer.ops["reserve"] == peer.ops["commit"] == peer.ops["acquire"] == 1  # one batch each


def test_an_empty_save_and_load_send_nothing(peer: Peer) -> None:
    with Client(peer.unix_path, pipeline_bytes=PIPE) as kv:
        assert kv.save(NS_ID, []) == [] and kv.load(NS_ID, []) == []
    assert not (peer.ops["reserve"] or peer.ops["acquire"])


# --- the real daemon, killed in the middle of a pipeline ----------------------------------------


def _kill_at(flow: Generator[Any, Any, Any], op: str, nth: int,
             kill: Callable[[], None]) -> Generator[Any, Any, Any]:
    """``flow``, unchanged, except that ``kill()`` runs when it yields its ``nth`` ``op`` call
    (before the driver sends it)."""
    seen = 0
    try:
        step = next(flow)
        while True:
            if isinstance(step, Call) and step.op == op:
                seen += 1
                if seen == nth:
                    kill()
            try:
                reply = yield step
            except Exception as exc:
                step = flow.throw(exc)
            else:
                step = flow.send(reply)
    except StopIteration as stop:
        return stop.value


def _killer(daemon: KvtierDaemon) -> Callable[[], None]:
    def kill() -> None:
        daemon.process.kill()
        daemon.process.wait()
    return kill


def _records(n: int, tag: bytes) -> list[Any]:
    keys = [key(i, tag) for i in range(n)]
    return prepare_records(NS_ID, [(k, make_record(NS_ID, k, BLOCK, seed=i)) for i, k in enumerate(keys)])


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_daemon_killed_mid_save_is_a_typed_error_and_mid_load_a_miss(kvtier_daemon: KvtierDaemon,
                                                                        driver: str) -> None:
    records = _records(24, driver.encode())
    keys = [r.key for r in records]
    kill = _killer(kvtier_daemon)
    with Client(kvtier_daemon.address, timeout_s=60.0, pipeline_bytes=PIPE) as kv:
        assert kv.save(NS_ID, [(r.key, bytes(r.record)) for r in records[:8]]) == ["stored"] * 8

    def save(s: Any) -> Any:  # killed before the second commit is sent: the first and reserve 3 in flight
        return _kill_at(save_flow(s, NS_ID, records[8:], None, None, 0), "commit", 2, kill)

    def load(s: Any) -> Any:  # killed before the second acquire is sent
        return _kill_at(load_flow(s, NS_ID, keys), "acquire", 2, kill)

    # The calls that must succeed get a timeout no busy machine comes near; the killed daemon's
    # calls fail because their connection died (ConnectionLost), never by waiting it out.
    if driver == "sync":
        with Client(kvtier_daemon.address, timeout_s=60.0, pipeline_bytes=PIPE) as kv:
            assert len(kv.load(NS_ID, keys[:8])) == 8
            with pytest.raises(ConnectionLost):
                kv._run(Job(lambda: save, idempotent=False))
            kvtier_daemon.restart()
            # a fresh daemon: memory is gone; what its disk tier got written through before the
            # kill (more or less, with the machine's speed) is served, byte-identical
            got = kv.load(NS_ID, keys, degrade=False)
            assert got == [bytes(r.record) for r in records[:len(got)]]
            assert set(kv.save(NS_ID, [(r.key, bytes(r.record)) for r in records[:8]])) <= {"stored", "exists"}
            assert kv._run(Job(lambda: load, idempotent=True, degrade=True, fallback=[])) == []
    else:
        async def run() -> None:
            async with AsyncClient(kvtier_daemon.address, timeout_s=60.0, pipeline_bytes=PIPE) as kv:
                assert len(await kv.load(NS_ID, keys[:8])) == 8
                with pytest.raises(ConnectionLost):
                    await kv._run(Job(lambda: save, idempotent=False))
                kvtier_daemon.restart()
                got = await kv.load(NS_ID, keys, degrade=False)
                assert got == [bytes(r.record) for r in records[:len(got)]]
                assert set(await kv.save(NS_ID, [(r.key, bytes(r.record)) for r in records[:8]])) <= {"stored", "exists"}
                assert await kv._run(Job(lambda: load, idempotent=True, degrade=True, fallback=[])) == []
        asyncio.run(run())
