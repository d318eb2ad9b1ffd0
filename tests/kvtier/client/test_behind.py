"""Write-behind saves (kvtier/client/behind.py, ``ClientOptions.write_behind``) with both drivers,
against the real daemon: a save returns before its commit is answered, yet the client reads its
own writes, a quiet or closing client still commits, and a commit refused or lost after the save
returned is counted and raised by ``flush``. The toy peer shows the order requests travel in."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.client import AsyncClient, Client, ConnectionLost, behind
from kvtier_protocol.errors import ChecksumMismatch
from kvtier_protocol.header import decode_header
from tests.kvtier.client.clientkit import NS_ID, eventually, make_blocks
from tests.kvtier.client.peer import Peer
from tests.kvtier.conftest import KvtierDaemon

KiB = 1 << 10
BLOCK = 64 * KiB


def _keys(blocks: list[tuple[bytes, bytes]]) -> list[bytes]:
    return [k for k, _ in blocks]


def _bad_checksum(record: bytes) -> bytes:
    """``record`` with one payload byte flipped: its header's checksum no longer matches."""
    _, offset = decode_header(record)  # the payload starts here
    out = bytearray(record)
    out[offset] ^= 0xFF
    return bytes(out)


@pytest.fixture
def verifying_daemon(tmp_path: Path) -> Iterator[KvtierDaemon]:
    """A daemon that checks every payload at commit: a corrupt one is a refused commit."""
    config = tmp_path / "kvtier.toml"
    config.write_text("[store]\nverify_on_commit = true\n")
    daemon = KvtierDaemon(tmp_path, extra_args=("--config", str(config)))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


def test_a_save_returns_before_its_commit_and_the_blocks_land_soon_after(kvtier_daemon: KvtierDaemon) -> None:
    blocks = make_blocks(6, BLOCK, tag=b"wb-lands")
    with Client(kvtier_daemon.address, write_behind=True) as kv, Client(kvtier_daemon.address) as other:
        assert kv.save(NS_ID, blocks) == ["stored"] * 6
        # Nothing else is sent: the held-back commit leaves on its own (FLUSH_AFTER_S), and lands.
        assert eventually(lambda: other.lookup(NS_ID, _keys(blocks)).num_hits == 6)
        assert other.load(NS_ID, _keys(blocks), degrade=False) == [r for _, r in blocks]
        kv.flush()  # nothing refused
        assert kv.late_failures == 0


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_the_client_reads_its_own_writes(kvtier_daemon: KvtierDaemon, driver: str) -> None:
    first, second = make_blocks(5, BLOCK, tag=b"ryw-1" + driver.encode()), make_blocks(5, BLOCK, tag=b"ryw-2" + driver.encode())
    if driver == "sync":
        with Client(kvtier_daemon.address, write_behind=True) as kv:
            assert kv.save(NS_ID, first) == ["stored"] * 5
            assert kv.lookup(NS_ID, _keys(first)).num_hits == 5  # at once: the commit is claimed first
            assert kv.save(NS_ID, second) == ["stored"] * 5
            assert kv.load(NS_ID, _keys(second), degrade=False) == [r for _, r in second]
            # Into granted slots, its place not waited for: "stored" (they are, since the first save).
            assert kv.save(NS_ID, first) == ["stored"] * 5
            assert kv.delete(NS_ID, _keys(first)) == 5
            assert kv.lookup(NS_ID, _keys(first)).num_hits == 0
        return

    async def run() -> None:
        async with AsyncClient(kvtier_daemon.address, write_behind=True) as kv:
            assert await kv.save(NS_ID, first) == ["stored"] * 5
            assert (await kv.lookup(NS_ID, _keys(first))).num_hits == 5
            assert await kv.save(NS_ID, second) == ["stored"] * 5
            assert await kv.load(NS_ID, _keys(second), degrade=False) == [r for _, r in second]
            assert await kv.delete(NS_ID, _keys(first)) == 5
            assert (await kv.lookup(NS_ID, _keys(first))).num_hits == 0
            await kv.flush()
    asyncio.run(run())


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_close_waits_for_the_commits_still_unanswered(kvtier_daemon: KvtierDaemon, driver: str) -> None:
    blocks = make_blocks(8, BLOCK, tag=b"wb-close" + driver.encode())
    if driver == "sync":
        kv = Client(kvtier_daemon.address, write_behind=True)
        assert kv.save(NS_ID, blocks) == ["stored"] * 8
        kv.close()
    else:
        async def run() -> None:
            kv = AsyncClient(kvtier_daemon.address, write_behind=True)
            assert await kv.save(NS_ID, blocks) == ["stored"] * 8
            await kv.close()
        asyncio.run(run())
    with Client(kvtier_daemon.address) as other:
        assert other.lookup(NS_ID, _keys(blocks)).num_hits == 8  # no waiting: close committed them


@pytest.mark.parametrize("driver", ["sync", "aio"])
def test_a_refused_commit_is_counted_and_raised_by_flush(verifying_daemon: KvtierDaemon, driver: str) -> None:
    good, bad = make_blocks(3, BLOCK, tag=b"good" + driver.encode()), make_blocks(3, BLOCK, tag=b"bad" + driver.encode())
    bad = [(k, _bad_checksum(r)) for k, r in bad]
    if driver == "sync":
        with Client(verifying_daemon.address, write_behind=True) as kv:
            assert kv.save(NS_ID, bad) == ["stored"] * 3  # predicted: the daemon has not answered yet
            with pytest.raises(ChecksumMismatch):
                kv.flush()
            assert kv.late_failures == 1
            kv.flush()  # raised once
            assert kv.save(NS_ID, good) == ["stored"] * 3  # the client goes on
            assert kv.lookup(NS_ID, _keys(good)).num_hits == 3
            assert kv.lookup(NS_ID, _keys(bad)).num_hits == 0  # the refused blocks are not stored
    else:
        async def run() -> None:
            async with AsyncClient(verifying_daemon.address, write_behind=True) as kv:
                assert await kv.save(NS_ID, bad) == ["stored"] * 3
                assert (await kv.lookup(NS_ID, _keys(bad))).num_hits == 0  # the refusal is recorded here...
                with pytest.raises(ChecksumMismatch):
                    await kv.flush()  # ... and raised here
                assert kv.late_failures == 1
                await kv.flush()
                assert await kv.save(NS_ID, good) == ["stored"] * 3
                assert (await kv.lookup(NS_ID, _keys(good))).num_hits == 3
        asyncio.run(run())


def test_a_daemon_lost_with_a_commit_unanswered_is_a_late_failure(kvtier_daemon: KvtierDaemon,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(behind, "FLUSH_AFTER_S", 30.0)  # the commit stays held back until flush
    blocks = make_blocks(4, BLOCK, tag=b"wb-lost")
    with Client(kvtier_daemon.address, write_behind=True, retries=0, holddown_s=0.0) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 4
        proc = kvtier_daemon.process
        assert proc is not None
        proc.kill()  # SIGKILL: the held-back commit never reaches it
        proc.wait(10)
        kvtier_daemon.process = None
        with pytest.raises(ConnectionLost):
            kv.flush()
        assert kv.late_failures == 1
        kv.flush()  # raised once
    kvtier_daemon.start()
    with Client(kvtier_daemon.address) as other:  # never committed: not there after the restart
        assert other.lookup(NS_ID, _keys(blocks)).num_hits == 0


def test_the_next_reserve_travels_ahead_of_the_held_back_commit(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(behind, "FLUSH_AFTER_S", 30.0)  # held until a request takes it along
    a, b = make_blocks(2, BLOCK, tag=b"order-a"), make_blocks(2, BLOCK, tag=b"order-b")
    with Client(peer.unix_path, write_behind=True, grant_bytes=0) as kv:
        kv.save(NS_ID, a)
        assert peer.arrivals == ["reserve"]  # its commit is held back
        kv.save(NS_ID, b)
        # One write: b's reserve first (the daemon grants it while a's commit waits), then a's commit.
        assert eventually(lambda: peer.arrivals == ["reserve", "reserve", "commit"])
        assert kv.lookup(NS_ID, _keys(a + b)).num_hits == 4  # a lookup waits for both commits first
        assert peer.arrivals[3:] == ["commit", "lookup"]


def test_granted_saves_send_their_place_at_once(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(behind, "FLUSH_AFTER_S", 30.0)  # a held-back commit waits for a request
    a, b, c = (make_blocks(2, BLOCK, tag=b"granted-" + t) for t in (b"a", b"b", b"c"))
    with Client(peer.unix_path, write_behind=True) as kv:
        kv.save(NS_ID, a)  # reserve, the grant for the next save behind it; the commit held back
        assert eventually(lambda: peer.arrivals == ["reserve", "grant"]), peer.arrivals
        # Into the granted slots: a's commit leaves with b's refill, and b's place right after its
        # copy (not held back: the daemon places while the caller prepares its next save).
        kv.save(NS_ID, b)
        assert eventually(lambda: peer.arrivals == ["reserve", "grant", "commit", "grant", "place"]), peer.arrivals
        kv.save(NS_ID, c)
        assert eventually(lambda: peer.arrivals[5:] == ["grant", "place"]), peer.arrivals
        assert kv.lookup(NS_ID, _keys(a + b + c)).num_hits == 6  # after every place's answer
        assert peer.arrivals[7:] == ["lookup"]
    # The pool's last grant ended with the connection (the peer drops it once it sees the close).
    assert eventually(lambda: not peer.grants)


def test_a_late_answer_leaves_the_held_back_commit_held(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(behind, "FLUSH_AFTER_S", 30.0)
    peer.delays["grant"] = 0.3  # the save waits for its refill's answer after the copy
    with Client(peer.unix_path, write_behind=True) as kv:
        kv.save(NS_ID, make_blocks(2, BLOCK, tag=b"late-grant"))
        # Waiting for an answer to a request already sent does not write what is held back: the
        # commit still waits for the next request (it used to leave whenever an answer was late).
        assert peer.arrivals == ["reserve", "grant"]
        kv.flush()
        assert peer.arrivals == ["reserve", "grant", "commit"]


def test_without_write_behind_a_save_waits_for_its_commit(peer: Peer) -> None:
    blocks, more = make_blocks(2, BLOCK, tag=b"plain"), make_blocks(2, BLOCK, tag=b"plain-more")
    with Client(peer.unix_path) as kv:
        kv.save(NS_ID, blocks)
        assert peer.arrivals == ["reserve", "grant", "commit"]  # answered before save returned
        assert kv.save(NS_ID, more + blocks[:1]) == ["stored", "stored", "exists"]
        assert peer.arrivals[3:] == ["reserve", "grant", "commit"]  # 3 blocks: the pool holds 2
        assert kv.save(NS_ID, make_blocks(3, BLOCK, tag=b"plain-3")) == ["stored"] * 3
        # The pool was topped up to 3 (2 + 1 slots of two grants): one place per grant.
        assert peer.arrivals[6:] == ["grant", "place", "place"]
        kv.flush()  # nothing to wait for
        assert kv.late_failures == 0


def test_a_quiet_release_waits_for_the_next_request(peer: Peer, monkeypatch: pytest.MonkeyPatch) -> None:
    peer.quiet_release = True
    monkeypatch.setattr(behind, "FLUSH_AFTER_S", 30.0)  # held until a request takes it along
    blocks = make_blocks(2, 4096)
    keys = [k for k, _ in blocks]
    with Client(peer.unix_path) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 2
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
        assert peer.ops["release"] == 0 and len(peer.leases) == 1  # still in the client's outbox
        assert kv.ping() > 0  # written with the ping, ahead of it: read before the ping is answered
        assert peer.ops["release"] == 1 and not peer.leases
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]
    assert eventually(lambda: peer.ops["release"] == 2 and not peer.leases)  # close wrote what was held back


def test_a_held_quiet_release_leaves_on_its_own(peer: Peer) -> None:
    peer.quiet_release = True
    blocks = make_blocks(2, 4096)
    with Client(peer.unix_path) as kv:
        assert kv.save(NS_ID, blocks) == ["stored"] * 2
        assert kv.load(NS_ID, [k for k, _ in blocks]) == [r for _, r in blocks]
        # Nothing else is sent: the release leaves within FLUSH_AFTER_S and ends the lease.
        assert eventually(lambda: peer.ops["release"] == 1 and not peer.leases)
