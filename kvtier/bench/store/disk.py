"""The disk rows of `kvtier bench store`: the disk tier next to dd with O_DIRECT.

Rows:
  * ``disk write`` (GB/s): the store's demotion path over page-aligned sources (as host slots
    are): ``DiskTier.put_verified`` (a verified snapshot into the tier's aligned buffers, written
    with O_DIRECT while the next block is copied, one meta commit per batch). At capacity (each
    batch first evicts as many bytes: the cache's steady state, free files written over) next
    to ``dd oflag=direct conv=notrunc`` over an allocated file; again with ``flush()`` (syncfs,
    RocksDB's log) next to ``conv=notrunc,fsync``; and into an empty tier (new files) next to
    plain ``dd oflag=direct`` (a new file). Without flush both sides leave the data on the device
    and the file system's metadata unsynced.
  * ``disk read`` (GB/s): :func:`~kvtier.daemon.store.transfers.load_records` of every block (O_DIRECT
    read into page-aligned buffers, header and xxh3 check), next to ``dd iflag=direct`` of the
    tier's own block files (same bytes, same place on the device: a virtual disk caches a file
    that dd reads again and again, so a separate dd file would measure that cache).
  * ``disk→host promote`` (GB/s): after a restart of the store, ``acquire`` of every block (disk
    read into host slots, header and xxh3 check, then the bench's copy out of the slot), next to
    dd over that store's block files.

Disk reads are cold: before each timed read the page cache of the files is dropped (``--cold
fadvise``: ``posix_fadvise(DONTNEED)`` on every file of the database, which needs no privilege
and leaves other processes' caches alone; ``--cold drop_caches``: ``/proc/sys/vm/drop_caches``),
and the fraction still resident is measured with ``mincore`` and reported. dd uses O_DIRECT.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import mmap
import os
import re
import shutil
import subprocess
from pathlib import Path

import torch

from kvtier.client import memcopy
from kvtier.bench.report import Row, Timer, alternate, gbps, progress, throughput_row
from kvtier.bench.store.blocks import MIB, NS, batches, block_header, chain_hash, get_blocks, put_blocks, random_blocks
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.transfers import load_records
from kvtier_protocol.header import payload_checksum


def disk_rows(loop: asyncio.AbstractEventLoop, work: Path, block: int, count: int, batch: int, reps: int,
              cold: str) -> list[Row]:
    """The disk write, read and promote rows for ``count`` blocks of ``block`` bytes in ``work``."""
    mib = block // MIB
    total = block * count
    progress(f"store: disk {count} x {mib} MiB blocks in {work}, cold reads via {cold}")
    # Page-aligned sources, as host slots are: what the store snapshots, verifies and writes down.
    pool = [_aligned(bytes(t.numpy())) for t in random_blocks(4, block, seed=99)]
    views = [pool[i % len(pool)] for i in range(count)]
    keys = [NS + chain_hash(i) for i in range(count)]
    headers = [block_header(i, v) for i, v in enumerate(views)]
    sums = [payload_checksum(v) for v in pool]
    per = max(1, batch // block)
    dd_file = work / "dd.bin"

    def dd_write(*flags: str) -> float:
        return _dd(["if=/dev/zero", f"of={dd_file}", f"bs={mib}M", f"count={count}", "oflag=direct", *flags])

    def kv_write_empty() -> float:
        shutil.rmtree(work / "w", ignore_errors=True)
        with DiskTier(work / "w", 2 * total) as disk:
            with Timer() as t:
                for r in batches(count, per):
                    _write(disk, keys[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                           [sums[i % len(pool)] for i in r])
        return gbps(total, t.seconds)

    # At capacity (a cache's steady state): each batch first evicts as many bytes as it writes,
    # as the store's make_room_disk does, and the files of the evicted records are written over.
    sets = [keys, [NS + chain_hash(count + i) for i in range(count)]]
    rounds = [0]

    def kv_write_full(full: DiskTier, flush: bool) -> float:
        new, old = sets[rounds[0] % 2], sets[(rounds[0] + 1) % 2]
        rounds[0] += 1
        with Timer() as t:
            for r in batches(count, per):
                full.delete_many(old[r.start:r.stop])
                _write(full, new[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                       [sums[i % len(pool)] for i in r])
            if flush:
                full.flush()
        return gbps(total, t.seconds)

    with DiskTier(work / "full", 2 * total) as full, DiskTier(work / "r", 2 * total) as reader:
        for r in batches(count, per):
            _write(full, sets[1][r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                   [sums[i % len(pool)] for i in r])
            _write(reader, keys[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                   [sums[i % len(pool)] for i in r])
        reader.flush()
        dsts = [_aligned(bytes(block)) for _ in range(per)]

        def kv_read() -> float:
            _drop_cache(work / "r", cold)
            with Timer() as t:
                for r in batches(count, per):
                    got = load_records(reader, keys[r.start:r.stop], headers[r.start:r.stop], dsts[:len(r)])
                    assert got == ["ok"] * len(r), f"bench read got {got}"
            return gbps(total, t.seconds)

        # Without flush, kvtier and dd promise the same: the bytes are on the device, the file
        # system's metadata is not synced (survives SIGKILL, not power loss). With flush and
        # fsync both sync. At capacity the tier writes over allocated files, and dd over its file.
        dd_write()  # untimed: allocates the file that conv=notrunc writes over
        kv, base = alternate(lambda: kv_write_full(full, False), lambda: dd_write("conv=notrunc"), repetitions=reps)
        rows = [throughput_row(f"disk write {mib}MiB at capacity (evict+snapshot+verify+O_DIRECT write)",
                               "throughput", "GB/s", kv, "dd oflag=direct conv=notrunc", base)]
        kv, base = alternate(lambda: kv_write_full(full, True), lambda: dd_write("conv=notrunc,fsync"),
                             repetitions=reps)
        rows.append(throughput_row(f"disk write {mib}MiB at capacity (... + flush)", "throughput", "GB/s",
                                   kv, "dd oflag=direct conv=notrunc,fsync", base))
        kv, base = alternate(kv_write_empty, dd_write, repetitions=reps)
        rows.append(throughput_row(f"disk write {mib}MiB into an empty tier (new files)", "throughput", "GB/s",
                                   kv, "dd oflag=direct (new file)", base))
        shutil.rmtree(work / "w", ignore_errors=True)
        _drop_cache(work / "r", cold)
        progress(f"store: after dropping caches, {_resident(work / 'r'):.1%} of the tier's files are in the page cache")
        kv, base = alternate(kv_read, lambda: _dd_read(work / "r", mib), repetitions=reps)
        rows.append(throughput_row(f"disk read {mib}MiB cold ({cold}) into aligned buffers, verified", "throughput",
                                   "GB/s", kv, "dd iflag=direct (same files)", base))
    rows.append(_promote_row(loop, work, block, count, [(k, h, v) for k, h, v in zip(keys, headers, views)], per,
                             reps, cold))
    return rows


def _aligned(data: bytes) -> memoryview:
    """``data`` in a page-aligned anonymous mapping (a host slot's alignment)."""
    mm = mmap.mmap(-1, max(1, len(data)))
    view = memoryview(mm)[:len(data)]
    view[:] = data
    return view


def _write(disk: DiskTier, keys: list[bytes], headers: list[bytes], views: list[memoryview], sums: list[int]) -> None:
    """The store's demotion path: verified snapshots into the tier's aligned buffers, written
    with O_DIRECT, one meta commit (``DiskTier.put_verified``, as ``Mover.write_disk_verified``)."""
    assert all(disk.put_verified(list(zip(keys, headers, views, sums)))), "bench sources verify"


def _promote_row(loop: asyncio.AbstractEventLoop, work: Path, block: int, count: int,
                 items: list[tuple[bytes, bytes, memoryview]], per: int, reps: int, cold: str) -> Row:
    total = block * count
    threads = memcopy.default_copy_threads()  # as kvtier's client copies
    cfg = StoreConfig(host_bytes=total + 64 * MIB, host_name_prefix="kvtier-bench", disk_path=str(work / "s"),
                      disk_bytes=2 * total)
    hashes = [k[len(NS):] for k, _, _ in items]
    srcs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for _, _, p in items[: min(4, count)]]
    srcs = [srcs[i % len(srcs)] for i in range(count)]

    async def fill() -> None:
        async with TieredStore(dataclasses.replace(cfg, write_through=True)) as store:
            await put_blocks(store, hashes, [h for _, h, _ in items], [v.numpy() for v in srcs], per, threads)

    loop.run_until_complete(fill())
    dsts = [torch.empty(block, dtype=torch.uint8).numpy() for _ in range(per)]  # get_blocks indexes within a batch

    def promote() -> float:
        _drop_cache(work / "s", cold)
        store = TieredStore(cfg)
        loop.run_until_complete(store.start())  # untimed: rebuilds the index from disk metadata
        try:
            assert store.host is not None
            store.host.prefault_done.wait()
            with Timer() as t:
                for r in batches(count, per):
                    got = loop.run_until_complete(get_blocks(store, hashes[r.start:r.stop], dsts, per, threads))
                    assert got == len(r), f"promotion served {got} of {len(r)} blocks"
            return gbps(total, t.seconds)
        finally:
            loop.run_until_complete(store.close())

    kv, base = alternate(promote, lambda: _dd_read(work / "s", block // MIB), repetitions=reps)
    return throughput_row(f"disk→host promote {block // MIB}MiB cold ({cold})", "throughput", "GB/s", kv,
                          "dd iflag=direct (same files)", base)


# --- the raw disk and the page cache -----------------------------------------------------------

_DD_LINE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.MULTILINE)


def _dd(operands: list[str]) -> float:
    """Run dd and return its own GB/s figure (NaN when dd or O_DIRECT is unavailable here)."""
    nbytes, seconds = _dd_run(operands)
    return gbps(nbytes, seconds)


def _dd_read(tier: Path, mib: int) -> float:
    """dd iflag=direct over the tier's own block files: the same bytes at the same place on the
    device as the records read (a virtual disk may cache a file read again and again)."""
    nbytes = seconds = 0.0
    for path in sorted(_files(tier / "data")):
        n, s = _dd_run([f"if={path}", "of=/dev/null", f"bs={mib}M", "iflag=direct"])
        nbytes, seconds = nbytes + n, seconds + s
    return gbps(int(nbytes), seconds) if nbytes else float("nan")


def _dd_run(operands: list[str]) -> tuple[int, float]:
    """dd's own byte count and seconds; (0, nan) when dd or O_DIRECT is unavailable here."""
    dd = shutil.which("dd")
    if dd is None:
        progress("store: dd not found; baseline is NaN")
        return 0, float("nan")
    out = subprocess.run([dd, *operands], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"})
    m = _DD_LINE.search(out.stderr)
    if out.returncode != 0 or m is None:
        progress(f"store: dd failed ({out.stderr.strip()[-200:]}); baseline is NaN")
        return 0, float("nan")
    return int(m.group(1)), float(m.group(2))


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def _drop_cache(root: Path, how: str) -> None:
    """Evict ``root``'s files from the page cache (O_DIRECT bypasses it; RocksDB's meta files and
    a buffered fallback do not)."""
    if how == "drop_caches":
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("1\n")
            return
        except OSError as e:
            progress(f"store: drop_caches refused ({e}); using fadvise")
    for path in _files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)


def _resident(root: Path) -> float:
    """Fraction of ``root``'s file pages in the page cache (mincore), to show reads are cold."""
    resident = pages = 0
    for path in _files(root):
        size = path.stat().st_size
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                continue
            n = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(n)
            if _libc.mincore(addr, size, vec) == 0:
                resident += sum(b & 1 for b in vec.raw)
                pages += n
            _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return resident / pages if pages else 0.0

