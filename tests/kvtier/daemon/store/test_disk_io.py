"""disk_io: aligned buffers and their reuse, block files written and read with O_DIRECT or buffered."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from kvtier.daemon.store.disk_io import ALIGN, BufferPool, DirectFiles, align_up, copy_into, file_bytes, is_aligned


def test_pool_buffers_are_aligned_and_reused_within_the_cap() -> None:
    pool = BufferPool(keep_bytes=2 * ALIGN)
    a = pool.get(100)
    assert len(a) == 100 and is_aligned(a) and len(a.obj) == ALIGN
    a[:] = b"x" * 100
    pool.give_back(a)
    pool.give_back(a)  # a second give-back must not hand the buffer out twice
    b, c = pool.get(10), pool.get(10)
    assert b.obj is a.obj and c.obj is not a.obj
    big = pool.get(3 * ALIGN)
    pool.give_back(big)  # over the cap: dropped, not kept
    assert pool.get(3 * ALIGN).obj is not big.obj


def test_pool_keeps_each_buffer_once_however_many_it_holds() -> None:
    pool = BufferPool(keep_bytes=2000 * ALIGN)  # a shutdown flush gives back thousands of one size
    views = [pool.get(10) for _ in range(1000)]
    for v in views + views:  # each twice: the second is a no-op
        pool.give_back(v)
    again = [pool.get(10) for _ in range(1000)]
    assert len({id(v.obj) for v in again}) == 1000 and {id(v.obj) for v in again} == {id(v.obj) for v in views}
    pool.give_back(again[0])  # handed out and back once more: kept again
    assert pool.get(10).obj is again[0].obj


def test_pool_never_adopts_a_mapping_it_did_not_make() -> None:
    pool = BufferPool()
    foreign = mmap.mmap(-1, ALIGN)  # a host slot's mapping, say
    pool.give_back(memoryview(foreign)[:10])
    pool.give_back(memoryview(bytearray(10)))
    assert pool.get(10).obj is not foreign


def test_alignment_helpers() -> None:
    assert align_up(0) == 0 and align_up(1) == ALIGN and align_up(ALIGN) == ALIGN
    assert file_bytes(100, 0) == ALIGN and file_bytes(100, ALIGN + 1) == 3 * ALIGN
    view = memoryview(mmap.mmap(-1, 2 * ALIGN))
    assert is_aligned(view) and not is_aligned(view[1:]) and is_aligned(view[ALIGN:])
    assert not is_aligned(memoryview(b"read-only bytes"))


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n", [0, 100, ALIGN, 2 * ALIGN + 5])
def test_write_then_read_a_block_file(tmp_path: Path, direct: bool, n: int) -> None:
    files, pool = DirectFiles(sync=False, direct=direct), BufferPool()
    header = b"H" * 77
    payload = os.urandom(n)
    path = str(tmp_path / "f")
    files.write(path, header, payload, pool)  # bytes: copied into an aligned buffer first
    assert os.path.getsize(path) == file_bytes(len(header), n)
    dest = pool.get(n)
    assert files.read_into(path, len(header), dest, pool) == header and bytes(dest) == payload
    with pytest.raises(FileExistsError):
        files.write(path, header, payload, pool)  # a block file is never written over
    aligned = pool.get(n)
    aligned[:] = payload
    files.write(str(tmp_path / "g"), header, aligned, pool)  # in place
    assert Path(tmp_path / "g").read_bytes() == Path(path).read_bytes()


def test_a_short_file_is_an_io_error(tmp_path: Path) -> None:
    files, pool = DirectFiles(sync=True), BufferPool()
    path = str(tmp_path / "f")
    files.write(path, b"h", b"p" * 3 * ALIGN, pool)
    os.truncate(path, 2 * ALIGN)
    with pytest.raises(OSError, match="holds"):
        files.read_into(path, 1, memoryview(bytearray(3 * ALIGN)), pool)
    with pytest.raises(FileNotFoundError):
        files.read_into(str(tmp_path / "none"), 1, memoryview(bytearray(1)), pool)


def test_copy_into_copies_any_buffer_and_checks_lengths() -> None:
    src = os.urandom(3 * ALIGN + 7)
    for source in (memoryview(src), memoryview(bytearray(src)), memoryview(bytearray(src * 2))[::2]):
        dest = memoryview(bytearray(len(source)))
        copy_into(dest, source)
        assert bytes(dest) == bytes(source)
    with pytest.raises(ValueError):
        copy_into(memoryview(bytearray(3)), memoryview(b"four"))
