"""`kvtier bench store`: the tiered store's host and disk paths next to memcpy and the raw disk.

Rows:
  * ``host put`` / ``host get`` per block size (GB/s): ``reserve → copy into the slot → commit``
    and ``acquire → copy out of the slot → release`` through :class:`TieredStore`, next to a torch
    ``copy_`` of the same bytes. Source and destination buffers rotate over a working set of
    ``--working-set-mib`` on both sides, so neither side measures the cache. Headers (and so the
    client's payload checksum) are computed before the timed region.
  * ``disk write`` (GB/s): the store's demotion path over page-aligned sources (as host slots
    are): ``DiskTier.put_verified`` (a verified snapshot into the tier's aligned buffers, written
    with O_DIRECT while the next block is copied, one meta commit per batch). At capacity (each
    batch first evicts as many bytes: the cache's steady state, free files written over) next
    to ``dd oflag=direct conv=notrunc`` over an allocated file; again with ``flush()`` (syncfs,
    RocksDB's log) next to ``conv=notrunc,fsync``; and into an empty tier (new files) next to
    plain ``dd oflag=direct`` (a new file). Without flush both sides leave the data on the device
    and the file system's metadata unsynced.
  * ``disk read`` (GB/s): :func:`~kvtier.store.transfers.load_records` of every block (O_DIRECT
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

import argparse
import asyncio
import ctypes
import dataclasses
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kvtier.bench.report import Row, SuiteResult, Timer, alternate, gbps, progress, throughput_row
from kvtier.store.config import StoreConfig
from kvtier.store.disk import DiskTier
from kvtier.store.store import TieredStore
from kvtier.store.transfers import load_records
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

DESCRIPTION = "tiered store: host put/get vs torch copy_, disk write/read/promote vs dd O_DIRECT"
MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench store").digest()[:16]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default="2,8,32", help="host block sizes in MiB (default 2,8,32)")
    parser.add_argument("--working-set-mib", type=int, default=None, help="host rotation per side (default 256; --quick 64)")
    parser.add_argument("--disk-mib", type=int, default=None, help="disk data set (default 512; --quick 32)")
    parser.add_argument("--disk-block-mib", type=int, default=8, help="disk block size in MiB (default 8, as dd bs=8M)")
    parser.add_argument("--batch-mib", type=int, default=64, help="bytes of blocks per reserve/acquire/put_many call")
    parser.add_argument("--data-dir", default=None, help="directory on the disk to test (default: a temp dir in /var/tmp)")
    parser.add_argument("--cold", choices=("fadvise", "drop_caches"), default="fadvise",
                        help="how disk reads are kept out of the page cache (default fadvise)")


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    ws = (args.working_set_mib or (64 if args.quick else 256)) * MIB
    batch = args.batch_mib * MIB
    result = SuiteResult("store")
    base = Path(args.data_dir) if args.data_dir else Path("/var/tmp")
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-", dir=base))
    loop = asyncio.new_event_loop()
    try:
        for mib in (int(x) for x in args.sizes_mib.split(",") if x.strip()):
            result.rows += _host_rows(loop, mib * MIB, ws, batch, reps)
        block = args.disk_block_mib * MIB
        count = max(1, (args.disk_mib or (32 if args.quick else 512)) * MIB // block)
        result.rows += _disk_rows(loop, work, block, count, batch, reps, args.cold)
    finally:
        loop.close()
        shutil.rmtree(work, ignore_errors=True)
    return result


# --- blocks ------------------------------------------------------------------------------------


def _chain(i: int) -> bytes:
    return hashlib.sha256(NS + i.to_bytes(8, "little")).digest()


def _header(i: int, payload: memoryview | bytes) -> bytes:
    n = len(payload)
    h = BlockHeader(ns_id=NS, chain_hash=_chain(i), parent_hash=_chain(i - 1) if i else None, num_tokens=16,
                    layout="canonical", shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return encode_header(h)


def _random_blocks(count: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def _batches(n: int, per: int) -> list[range]:
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


async def _put(store: TieredStore, hashes: list[bytes], headers: list[bytes], srcs: list[torch.Tensor],
               per: int) -> None:
    assert store.host is not None
    for r in _batches(len(hashes), per):
        res = await store.reserve(NS, hashes[r.start:r.stop], [srcs[i].numel() for i in r])
        for i, slot in zip(r, res.slots):
            if slot is None:
                raise RuntimeError("the bench's host tier is too small for its working set")
            store.host.torch_view(slot).copy_(srcs[i])
        await store.commit(res.lease_id, headers[r.start:r.stop])


async def _get(store: TieredStore, hashes: list[bytes], dsts: list[torch.Tensor], per: int) -> int:
    assert store.host is not None
    got = 0
    for r in _batches(len(hashes), per):
        acq = await store.acquire(NS, hashes[r.start:r.stop])
        for i, block in zip(r, acq.blocks):
            dsts[i].copy_(store.host.torch_view(block.slot))
        got += len(acq.blocks)
        if acq.lease_id:
            store.release(acq.lease_id)
    return got


# --- host --------------------------------------------------------------------------------------


def _host_rows(loop: asyncio.AbstractEventLoop, nbytes: int, ws: int, batch: int, reps: int) -> list[Row]:
    n = max(2, ws // nbytes)
    mib = nbytes // MIB
    progress(f"store: host {mib} MiB blocks, {n} in rotation ({n * nbytes // MIB} MiB per side)")
    srcs = _random_blocks(n, nbytes, seed=mib)
    dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n)]
    hashes = [_chain(i) for i in range(n)]
    headers = [_header(i, memoryview(s.numpy())) for i, s in enumerate(srcs)]
    per = max(1, batch // nbytes)
    # No background scrub here: this measures the host tier's own path (the daemon's scrub runs in the
    # daemon process, off the client's path; `kvtier bench dataplane` measures it for real).
    cfg = StoreConfig(host_bytes=n * nbytes + 64 * MIB, host_name_prefix="kvtier-bench", scrub_commits=False)
    store = TieredStore(cfg)
    loop.run_until_complete(store.start())
    try:
        assert store.host is not None
        store.host.prefault_done.wait()

        def memcpy() -> float:
            with Timer() as t:
                for s, d in zip(srcs, dsts):
                    d.copy_(s)
            return gbps(n * nbytes, t.seconds)

        def put() -> float:
            with Timer() as t:
                loop.run_until_complete(_put(store, hashes, headers, srcs, per))
            loop.run_until_complete(store.delete(NS, hashes))  # untimed: the next round starts empty
            return gbps(n * nbytes, t.seconds)

        def get() -> float:
            with Timer() as t:
                got = loop.run_until_complete(_get(store, hashes, dsts, per))
            assert got == n, f"bench get found {got} of {n} blocks"
            return gbps(n * nbytes, t.seconds)

        kv, base = alternate(put, memcpy, repetitions=reps)
        rows = [throughput_row(f"host put {mib}MiB", "throughput", "GB/s", kv, "torch copy_", base)]
        loop.run_until_complete(_put(store, hashes, headers, srcs, per))
        kv, base = alternate(get, memcpy, repetitions=reps)
        rows.append(throughput_row(f"host get {mib}MiB", "throughput", "GB/s", kv, "torch copy_", base))
        assert all(torch.equal(s, d) for s, d in zip(srcs, dsts)), "bench get returned other bytes"
        return rows
    finally:
        loop.run_until_complete(store.close())


# --- disk --------------------------------------------------------------------------------------


def _disk_rows(loop: asyncio.AbstractEventLoop, work: Path, block: int, count: int, batch: int, reps: int,
               cold: str) -> list[Row]:
    mib = block // MIB
    total = block * count
    progress(f"store: disk {count} x {mib} MiB blocks in {work}, cold reads via {cold}")
    # Page-aligned sources, as host slots are: what the store snapshots, verifies and writes down.
    pool = [_aligned(bytes(t.numpy())) for t in _random_blocks(4, block, seed=99)]
    views = [pool[i % len(pool)] for i in range(count)]
    keys = [NS + _chain(i) for i in range(count)]
    headers = [_header(i, v) for i, v in enumerate(views)]
    sums = [payload_checksum(v) for v in pool]
    per = max(1, batch // block)
    dd_file = work / "dd.bin"

    def dd_write(*flags: str) -> float:
        return _dd(["if=/dev/zero", f"of={dd_file}", f"bs={mib}M", f"count={count}", "oflag=direct", *flags])

    def kv_write_empty() -> float:
        shutil.rmtree(work / "w", ignore_errors=True)
        with DiskTier(work / "w", 2 * total) as disk:
            with Timer() as t:
                for r in _batches(count, per):
                    _write(disk, keys[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                           [sums[i % len(pool)] for i in r])
        return gbps(total, t.seconds)

    # At capacity (a cache's steady state): each batch first evicts as many bytes as it writes,
    # as the store's make_room_disk does, and the files of the evicted records are written over.
    sets = [keys, [NS + _chain(count + i) for i in range(count)]]
    rounds = [0]

    def kv_write_full(full: DiskTier, flush: bool) -> float:
        new, old = sets[rounds[0] % 2], sets[(rounds[0] + 1) % 2]
        rounds[0] += 1
        with Timer() as t:
            for r in _batches(count, per):
                full.delete_many(old[r.start:r.stop])
                _write(full, new[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                       [sums[i % len(pool)] for i in r])
            if flush:
                full.flush()
        return gbps(total, t.seconds)

    with DiskTier(work / "full", 2 * total) as full, DiskTier(work / "r", 2 * total) as reader:
        for r in _batches(count, per):
            _write(full, sets[1][r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                   [sums[i % len(pool)] for i in r])
            _write(reader, keys[r.start:r.stop], headers[r.start:r.stop], views[r.start:r.stop],
                   [sums[i % len(pool)] for i in r])
        reader.flush()
        dsts = [_aligned(bytes(block)) for _ in range(per)]

        def kv_read() -> float:
            _drop_cache(work / "r", cold)
            with Timer() as t:
                for r in _batches(count, per):
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
    cfg = StoreConfig(host_bytes=total + 64 * MIB, host_name_prefix="kvtier-bench", disk_path=str(work / "s"),
                      disk_bytes=2 * total)
    hashes = [k[len(NS):] for k, _, _ in items]
    srcs = [torch.frombuffer(bytearray(p), dtype=torch.uint8) for _, _, p in items[: min(4, count)]]
    srcs = [srcs[i % len(srcs)] for i in range(count)]

    async def fill() -> None:
        async with TieredStore(dataclasses.replace(cfg, write_through=True)) as store:
            await _put(store, hashes, [h for _, h, _ in items], srcs, per)

    loop.run_until_complete(fill())
    dsts = [torch.empty(block, dtype=torch.uint8) for _ in range(per)]  # _get indexes within a batch

    def promote() -> float:
        _drop_cache(work / "s", cold)
        store = TieredStore(cfg)
        loop.run_until_complete(store.start())  # untimed: rebuilds the index from disk metadata
        try:
            assert store.host is not None
            store.host.prefault_done.wait()
            with Timer() as t:
                for r in _batches(count, per):
                    got = loop.run_until_complete(_get(store, hashes[r.start:r.stop], dsts, per))
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


__all__ = ["DESCRIPTION", "add_arguments", "run"]
