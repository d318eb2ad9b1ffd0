"""Misbehaving clients of a real daemon, each with its designed outcome and no effect on other clients.

* A client that reserves and never commits: its put lease expires, the slots come back (no
  pending block, host bytes freed); a late commit is a typed lease error.
* A client that acquires and never releases: its get lease expires and the pinned blocks become
  evictable again (a reserve that found the host tier full now gets room); a late release is a
  typed lease error.
* A client that disconnects in the middle of a frame: its reservation is released at once,
  nothing becomes visible, and the daemon serves everybody else.
"""

from __future__ import annotations

import time

import pytest

from kvtier.bench.crash.data import NS_ID, Link, block_key, block_parts
from kvtier_protocol.errors import LeaseError
from kvtier_protocol.frames import encode_frame
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.waitkit import PATIENCE_S

BLOCK = 256 << 10
HOST = 4 * BLOCK


def _nothing() -> None:
    return None


@pytest.fixture
def daemon(tmp_path):
    d = KvtierDaemon(tmp_path, host_bytes=str(HOST))
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


def _stats(link: Link) -> dict:
    s = link.call("stats").stats
    return {"leases": s["leases"], "pending": s["pending"], "host": s["tiers"]["host"]["used_bytes"]}


def _wait_for(pred, timeout_s: float = PATIENCE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def _save(link: Link, cycle: int, indices: range) -> list:
    parts = [block_parts(cycle, i, BLOCK) for i in indices]
    r = link.reserve([k for k, _, _ in parts], [len(p) for _, _, p in parts], _nothing)
    for (_, _, payload), slot in zip(parts, r.slots):
        link.shm.write(slot, payload)
    return [r, parts]


def test_a_reservation_never_committed_expires_and_returns_its_space(daemon: KvtierDaemon):
    idle, other = Link(daemon.address, lease_ms=300), Link(daemon.address)
    try:
        r, parts = _save(idle, 1, range(4))
        assert _stats(other) == {"leases": 1, "pending": 4, "host": HOST}
        # The daemon reclaims expired leases every second, even with no request arriving.
        assert _wait_for(lambda: _stats(other) == {"leases": 0, "pending": 0, "host": 0})
        with pytest.raises(LeaseError):
            idle.commit(r.lease, [h for _, h, _ in parts], _nothing)
        r2, parts2 = _save(other, 2, range(4))  # the whole host tier is free again
        assert other.commit(r2.lease, [h for _, h, _ in parts2], _nothing) == 4
        assert other.check_served([(2, i) for i in range(4)], BLOCK).intact == 4
        assert other.lookup_tiers([block_key(1, 0)]) == []
    finally:
        idle.close()
        other.close()


def test_an_acquire_never_released_expires_and_unpins_its_blocks(daemon: KvtierDaemon):
    writer, reader = Link(daemon.address), Link(daemon.address, lease_ms=300)
    try:
        r, parts = _save(writer, 1, range(4))
        assert writer.commit(r.lease, [h for _, h, _ in parts], _nothing) == 4
        held = reader.call("acquire", ns_id=NS_ID, hashes=[k for k, _, _ in parts], lease_ms=300)
        assert held.lease and all(s is not None for s in held.slots)
        new = block_parts(1, 9, BLOCK)
        full = writer.reserve([new[0]], [BLOCK], _nothing)
        assert full.slots == (None,) and full.lease == 0, "every slot is pinned: full, not an error"
        assert _wait_for(lambda: _stats(writer)["leases"] == 0)
        room = writer.reserve([new[0]], [BLOCK], _nothing)
        assert room.lease and room.slots[0] is not None, "the expired lease unpinned its blocks"
        writer.shm.write(room.slots[0], new[2])
        assert writer.commit(room.lease, [new[1]], _nothing) == 1
        with pytest.raises(LeaseError):
            reader.call("release", lease=held.lease)
    finally:
        writer.close()
        reader.close()


def test_a_client_gone_mid_frame_leaves_nothing_behind(daemon: KvtierDaemon):
    quitter, other = Link(daemon.address), Link(daemon.address)
    try:
        r, parts = _save(quitter, 1, range(2))
        frame = b"".join(bytes(b) for b in encode_frame(
            {"op": "commit", "id": 99, "lease": r.lease, "headers": [h for _, h, _ in parts]}))
        sock = quitter.conn._sock  # the raw socket: send half a frame, then vanish
        sock.sendall(frame[:len(frame) // 2])
        quitter.close()
        assert _wait_for(lambda: _stats(other) == {"leases": 0, "pending": 0, "host": 0})
        assert other.lookup_tiers([k for k, _, _ in parts]) == []
        assert other.call("ping") is not None
        r2, parts2 = _save(other, 2, range(4))
        assert other.commit(r2.lease, [h for _, h, _ in parts2], _nothing) == 4
    finally:
        other.close()
