"""BlockFiles: ids in shard directories, free files written over, trimmed to their cap, shed when short."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.daemon.store.disk_files import BlockFiles
from kvtier.daemon.store.disk_io import ALIGN, BufferPool, file_bytes

HEADER = b"h" * 100


@pytest.fixture
def files(tmp_path: Path):
    f = BlockFiles(str(tmp_path / "data"), BufferPool(), keep_free_bytes=3 * 2 * ALIGN, sync=False, direct=True)
    yield f
    f.close()


def _read(files: BlockFiles, fid: int, n: int) -> bytes:
    dest = memoryview(bytearray(n))
    assert files.read_into(fid, len(HEADER), dest) == HEADER
    return bytes(dest)


def test_free_files_are_written_over_by_records_of_their_size(files: BlockFiles) -> None:
    small, big = file_bytes(len(HEADER), 10), file_bytes(len(HEADER), ALIGN + 10)
    a, b = files.write(HEADER, b"a" * 10, small), files.write(HEADER, b"b" * (ALIGN + 10), big)
    assert (a, b) == (1, 2) and Path(files.path(b)).parent.name == "02"
    files.release([(a, small), (b, big)])
    assert files.free_bytes == small + big and files.new_bytes([small, small, big]) == small
    assert files.write(HEADER, b"c" * (ALIGN + 10), big) == b, "the free file of that size"
    assert _read(files, b, ALIGN + 10) == b"c" * (ALIGN + 10)
    assert files.write(HEADER, b"d" * 10, small) == a and files.write(HEADER, b"e" * 10, small) == 3
    assert files.free_bytes == 0


def test_free_files_beyond_the_cap_are_unlinked_oldest_first(files: BlockFiles) -> None:
    size = file_bytes(len(HEADER), 10)
    ids = [files.write(HEADER, b"x" * 10, size) for _ in range(8)]
    files.release([(f, size) for f in ids])
    files.drain()
    assert files.free_bytes == 3 * size
    assert sorted(int(Path(p).name, 16) for p in files.listing()) == ids[-3:]


def test_shed_unlinks_free_files_of_other_sizes(files: BlockFiles) -> None:
    small, big = file_bytes(len(HEADER), 10), file_bytes(len(HEADER), ALIGN + 10)
    a, b = files.write(HEADER, b"a" * 10, small), files.write(HEADER, b"b" * (ALIGN + 10), big)
    files.release([(a, small), (b, big)])
    files.shed({small})
    assert [int(Path(p).name, 16) for p in files.listing()] == [a] and files.free_bytes == small


def test_reclaim_frees_unnamed_files_and_removes_strays(tmp_path: Path, files: BlockFiles) -> None:
    size = file_bytes(len(HEADER), 10)
    live, orphan = files.write(HEADER, b"l" * 10, size), files.write(HEADER, b"o" * 10, size)
    Path(files.path(7)).write_bytes(b"torn")  # a crash mid-write: not a whole number of pages
    Path(files.root, "00", "junk").write_bytes(b"")
    files.close()
    again = BlockFiles(files.root, BufferPool(), keep_free_bytes=1 << 20, sync=False, direct=True)
    try:
        again.reclaim({live})
        assert sorted(again.listing()) == sorted([again.path(live), again.path(orphan)])
        assert again.free_bytes == size and again.next_id == 8, "ids continue above every id seen"
        assert again.write(HEADER, b"n" * 10, size) == orphan
    finally:
        again.close()


def test_a_failed_write_leaves_nothing_behind(files: BlockFiles) -> None:
    size = file_bytes(len(HEADER), 10)
    os.rmdir(os.path.dirname(files.path(1)))  # the shard directory is gone: the create fails
    with pytest.raises(FileNotFoundError):
        files.write(HEADER, b"x" * 10, size)
    assert files.free_bytes == 0 and files.write(HEADER, b"y" * 10, size) == 2
