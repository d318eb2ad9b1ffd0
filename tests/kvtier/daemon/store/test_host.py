"""HostTier and the shared-memory helpers: slots, views, background pre-fault, cleanup, other processes."""

from __future__ import annotations

import gc
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kvtier_protocol.errors import CapacityError, InvalidRequest, StorageError

from kvtier.daemon.store import shm
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.types import Slot
from tests.kvtier.waitkit import PATIENCE_S

MIB, GIB = 1 << 20, 1 << 30


@pytest.fixture
def tier():
    t = HostTier(32 * MIB, segment_bytes=8 * MIB, name_prefix="kvtier-test", prefault=False, pin=False)
    yield t
    t.close()


def _shm_files(prefix: str) -> set[str]:
    return {n for n in os.listdir(shm.SHM_DIR) if n.startswith(prefix)}


def test_segments_are_private_files_in_dev_shm(tier: HostTier) -> None:
    segs = tier.segments
    assert [s.index for s in segs] == [0, 1, 2, 3] and all(s.size == 8 * MIB for s in segs)
    assert len({s.name for s in segs}) == 4
    for s in segs:
        assert s.name.startswith(f"kvtier-test-{os.getpid()}-")
        st = os.stat(shm.segment_path(s.name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 8 * MIB
        assert os.fstat(s.fd).st_ino == st.st_ino
    assert tier.capacity == 32 * MIB and tier.segment_bytes == 8 * MIB


def test_write_and_read_through_views(tier: HostTier) -> None:
    a, b = tier.allocate(3 * MIB + 5), tier.allocate(100)
    assert a is not None and b is not None
    va, vb = tier.view(a), tier.view(b)
    assert len(va) == a.length and len(vb) == 100 and not va.readonly
    va[:] = os.urandom(a.length)
    vb[:] = b"x" * 100
    assert bytes(tier.view(a)) == bytes(va)  # the same memory, not a copy
    assert bytes(tier.view(b)) == b"x" * 100
    t = tier.torch_view(a)
    t[0] = 7
    assert va[0] == 7 and t.numel() == a.length
    assert tier.allocated_bytes >= a.length + b.length and tier.stats.num_slots == 2
    tier.free(a)
    tier.free(b)
    assert tier.allocated_bytes == 0
    tier.allocator.check()


def test_bad_slots_and_sizes(tier: HostTier) -> None:
    with pytest.raises(InvalidRequest):
        tier.view(Slot(4, 0, 1))
    with pytest.raises(InvalidRequest):
        tier.view(Slot(0, 8 * MIB - 1, 2))
    with pytest.raises(InvalidRequest):
        tier.view(Slot(-1, 0, 1))
    with pytest.raises(CapacityError):
        tier.allocate(8 * MIB + 1)
    assert tier.can_ever_fit(8 * MIB) and not tier.can_ever_fit(8 * MIB + 1)
    slots = [tier.allocate(8 * MIB) for _ in range(4)]
    assert all(slots) and tier.allocate(4096) is None


def test_close_unlinks_is_idempotent_and_blocks_views() -> None:
    t = HostTier(4 * MIB, name_prefix="kvtier-close", prefault=False, pin=False)
    names = [s.name for s in t.segments]
    slot = t.allocate(1000)
    assert slot is not None
    held = t.view(slot)  # a view alive at close: the mapping outlives the tier, the file does not
    t.close()
    t.close()
    assert not any(os.path.exists(shm.segment_path(n)) for n in names)
    held[0] = 1  # still mapped memory, no crash
    with pytest.raises(StorageError):
        t.view(slot)


def test_dropped_tier_leaks_no_files() -> None:
    t = HostTier(4 * MIB, name_prefix="kvtier-drop", prefault=False, pin=False)
    names = [s.name for s in t.segments]
    del t
    gc.collect()
    assert not any(os.path.exists(shm.segment_path(n)) for n in names)


def test_prefault_runs_in_background_and_never_blocks_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    # The pre-fault (the real shm.populate) starts only when the test lets it: a constructor that
    # waited for it would never return (the gate's wait would give up and the check below fail).
    gate = threading.Event()
    populate = shm.populate

    def gated_populate(*args: object) -> None:
        assert gate.wait(PATIENCE_S), "the test never let the pre-fault start"
        populate(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(shm, "populate", gated_populate)
    t = HostTier(GIB, name_prefix="kvtier-prefault", pin=False)
    try:
        assert not t.prefault_done.is_set(), "the constructor waited for the pre-fault"
        slot = t.allocate(MIB)
        assert slot is not None
        t.view(slot)[:4] = b"live"  # usable while pre-faulting
        gate.set()
        assert t.prefault_done.wait(PATIENCE_S)
        assert t.prefault_error is None
        assert t.pin_done.wait(PATIENCE_S) and not t.pinned
        assert bytes(t.view(slot)[:4]) == b"live"  # pre-faulting never changes contents
    finally:
        t.close()


def test_close_during_prefault_stops_it() -> None:
    t = HostTier(GIB, name_prefix="kvtier-stop", pin=False)
    names = [s.name for s in t.segments]
    t.close()
    assert t.prefault_done.is_set()
    assert not any(os.path.exists(shm.segment_path(n)) for n in names)


_READER = """
import sys
from kvtier.daemon.store.shm import map_segment
name, size, off, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mm = map_segment(name, size)
sys.stdout.write(bytes(mm[off:off + n]).hex())
mm[off:off + 5] = b"child"
"""


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[4])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, os.path.join(root, "protocol")])
    return env


def test_another_process_maps_a_segment_by_name(tier: HostTier) -> None:
    tier.allocate(12345)  # so the slot below is not at offset 0
    slot = tier.allocate(64 * 1024)
    assert slot is not None and slot.offset > 0
    payload = os.urandom(slot.length)
    tier.view(slot)[:] = payload
    seg = tier.segments[slot.segment]
    out = subprocess.run([sys.executable, "-c", _READER, seg.name, str(seg.size), str(slot.offset), str(slot.length)],
                         capture_output=True, text=True, env=_child_env(), timeout=60, check=True)
    assert bytes.fromhex(out.stdout) == payload
    assert bytes(tier.view(slot)[:5]) == b"child"  # the child's write is visible here


_FD_READER = """
import socket, sys
from kvtier.daemon.store.shm import map_segment
sock = socket.socket(fileno=int(sys.argv[1]))
msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
size, off, n = (int(x) for x in msg.split())
mm = map_segment(fds[0], size)
sys.stdout.write(bytes(mm[off:off + n]).hex())
"""


def test_another_process_maps_a_segment_from_a_passed_fd(tier: HostTier) -> None:
    slot = tier.allocate(4096)
    assert slot is not None
    tier.view(slot)[:] = b"\xab" * 4096
    seg = tier.segments[slot.segment]
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent, child:
        proc = subprocess.Popen([sys.executable, "-c", _FD_READER, str(child.fileno())], pass_fds=[child.fileno()],
                                stdout=subprocess.PIPE, text=True, env=_child_env())
        socket.send_fds(parent, [f"{seg.size} {slot.offset} {slot.length}".encode()], [seg.fd])
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert bytes.fromhex(out) == b"\xab" * 4096


def test_map_segment_errors() -> None:
    with pytest.raises(InvalidRequest):
        shm.map_segment("../etc/passwd", 4096)
    with pytest.raises(StorageError):
        shm.map_segment("kvtier-test-does-not-exist", 4096)
    with HostTier(MIB, name_prefix="kvtier-small", prefault=False, pin=False) as t:
        with pytest.raises(StorageError):
            shm.map_segment(t.segments[0].name, 2 * MIB)  # larger than the segment
        with pytest.raises(StorageError):
            shm.create_segment(t.segments[0].name, MIB)  # exists already


def test_populate_keeps_contents() -> None:
    with HostTier(8 * MIB, name_prefix="kvtier-pop", prefault=False, pin=False) as t:
        slot = t.allocate(MIB)
        assert slot is not None
        t.view(slot)[:] = b"\x5a" * MIB
        seg = t.segments[0]
        mm = shm.map_segment(seg.name, seg.size)
        address, anchor = shm.address_of(mm)
        shm.populate(seg.fd, address, seg.size)
        assert bytes(t.view(slot)) == b"\x5a" * MIB
        del anchor
        mm.close()


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _segment_file(name: str, nbytes: int) -> str:
    path = os.path.join(shm.SHM_DIR, name)
    with open(path, "wb") as f:
        f.write(b"x" * nbytes)  # written, so it holds memory as a real segment does
    return path


def test_segments_left_by_a_dead_process_are_removed_at_the_next_start(caplog) -> None:
    """A daemon killed with SIGKILL cannot unlink its segments; the next host tier of the same
    prefix removes them (their memory is /dev/shm's), and nothing else."""
    prefix = f"kvt{os.getpid()}stale"
    dead = _dead_pid()
    stale = _segment_file(f"{prefix}-{dead}-{'ab' * 6}", 1 << 20)
    alive = _segment_file(f"{prefix}-{os.getpid()}-{'cd' * 6}", 4096)  # a live process's: kept
    other = _segment_file(f"{prefix}x-{dead}-{'ef' * 6}", 4096)  # another prefix: kept
    odd = _segment_file(f"{prefix}-{dead}-notours", 4096)  # not a name unique_name makes: kept
    try:
        with caplog.at_level("WARNING", logger="kvtier.daemon.store.host"):
            t = HostTier(8 * MIB, name_prefix=prefix, prefault=False, pin=False)
        t.close()
        assert not os.path.exists(stale)
        assert all(os.path.exists(p) for p in (alive, other, odd))
        assert any(os.path.basename(stale) in r.getMessage() and "1 MiB" in r.getMessage() for r in caplog.records)
        assert shm.reclaim_stale(prefix) == []  # nothing more to remove
    finally:
        for path in (stale, alive, other, odd):
            if os.path.exists(path):
                os.unlink(path)
