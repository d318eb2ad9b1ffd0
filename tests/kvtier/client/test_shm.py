"""SegmentMap: mapping received descriptors, bounds-checked slot copies, unmapping."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from kvtier.client import ConnectionLost
from kvtier.client import shm as shm_mod
from kvtier.client.shm import SegmentMap
from kvtier_protocol.errors import FrameError, StorageError
from kvtier_protocol.frames import Segment


def memfd(size: int) -> int:
    fd = os.memfd_create("kvtier-client-test")
    os.ftruncate(fd, size)
    return fd


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_write_then_read_record_and_close() -> None:
    fds = [memfd(8192), memfd(4096)]
    shm = SegmentMap.from_fds([Segment("a", 8192), Segment("b", 4096)], fds)
    assert not any(fd_is_open(fd) for fd in fds), "descriptors are closed once mapped"
    shm.write((1, 100, 5), b"hello")
    shm.write((0, 8190, 2), memoryview(b"xy"))
    assert shm.read_record(b"HDR", (1, 100, 5)) == b"HDRhello"
    assert shm.read_record(b"", (0, 8190, 2)) == b"xy"
    shm.close()
    shm.close()
    assert shm.closed
    with pytest.raises(ConnectionLost):
        shm.read_record(b"", (0, 0, 1))


@pytest.mark.parametrize("slot", [(1, 0, 1), (0, 4090, 7), (0, 4096, 1)])
def test_slots_outside_the_segments_are_refused(slot: tuple[int, int, int]) -> None:
    shm = SegmentMap.from_fds([Segment("a", 4096)], [memfd(4096)])
    with pytest.raises(FrameError):
        shm.write(slot, b"x" * slot[2])
    with pytest.raises(FrameError):
        shm.read_record(b"", slot)
    with pytest.raises(FrameError):
        shm.write((0, 0, 4), b"12345")  # a slot of another length than the payload
    shm.close()


def test_write_many_and_read_many_copy_a_batch() -> None:
    shm = SegmentMap.from_fds([Segment("a", 8192), Segment("b", 4096)], [memfd(8192), memfd(4096)])
    shm.write_many([(1, 100, 5), (0, 8190, 2), (0, 0, 3)], [b"hello", memoryview(b"xy"), bytearray(b"abc")])
    assert shm.read_record(b"", (1, 100, 5)) == b"hello" and shm.read_record(b"", (0, 0, 3)) == b"abc"
    out = [bytearray(5), bytearray(2)]
    shm.read_many([(1, 100, 5), (0, 8190, 2)], [memoryview(b) for b in out])
    assert out == [b"hello", b"xy"]
    shm.write_many([], [])
    shm.close()  # no view of a batch outlives its call: the mappings close
    assert shm.closed


@pytest.mark.parametrize("bad", [(1, 0, 1), (0, 4090, 7), (0, 4096, 1)])
def test_a_bad_slot_in_a_batch_copies_nothing(bad: tuple[int, int, int]) -> None:
    shm = SegmentMap.from_fds([Segment("a", 4096)], [memfd(4096)])
    with pytest.raises(FrameError):
        shm.write_many([(0, 0, 4), bad], [b"good", b"x" * bad[2]])
    with pytest.raises(FrameError):
        shm.write_many([(0, 0, 4), (0, 8, 4)], [b"good", b"12345"])  # a slot shorter than its payload
    assert shm.read_record(b"", (0, 0, 4)) == bytes(4), "the good slot before was not written"
    with pytest.raises(FrameError):
        shm.read_many([(0, 0, 4), bad], [memoryview(bytearray(4)), memoryview(bytearray(bad[2]))])
    with pytest.raises(FrameError):
        shm.read_many([(0, 0, 4)], [])
    shm.close()
    assert shm.closed


def test_descriptor_count_and_size_are_checked() -> None:
    fds = [memfd(4096)]
    with pytest.raises(FrameError):
        SegmentMap.from_fds([Segment("a", 4096), Segment("b", 4096)], fds)
    assert not fd_is_open(fds[0])
    fds = [memfd(4096), memfd(100)]
    with pytest.raises(StorageError):
        SegmentMap.from_fds([Segment("a", 4096), Segment("b", 4096)], fds)
    assert not any(fd_is_open(fd) for fd in fds)


def _resident_kib(mm: mmap.mmap) -> int:
    """Rss of the mapping ``mm`` from /proc/self/smaps (Linux)."""
    buf = ctypes.c_char.from_buffer(mm)
    try:
        start = ctypes.addressof(buf)
    finally:
        del buf  # the export would keep the mapping from closing
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] in (f"{start:x}", f"{start:08x}"):
            rss = next(x for x in lines[i + 1:] if x.startswith("Rss:"))
            return int(rss.split()[1])
    raise AssertionError("mapping not found in /proc/self/smaps")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux /proc")
def test_segments_are_prefaulted_up_to_the_populate_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_mod, "POPULATE_BYTES", 2 << 20)
    sizes = [1 << 20, 1 << 20, 1 << 20]  # the third goes over the budget: mapped lazily
    shm = SegmentMap.from_fds([Segment(str(i), n) for i, n in enumerate(sizes)], [memfd(n) for n in sizes])
    try:
        rss = [_resident_kib(m) for m in shm._maps]
        assert rss[:2] == [1024, 1024] and rss[2] == 0
        shm.write((2, 0, 4), b"late")  # the lazy one works all the same
        assert shm.read_record(b"", (2, 0, 4)) == b"late"
    finally:
        shm.close()
