"""The disk tier: one file per block record, written and read with O_DIRECT; RocksDB for metadata only.

Layout under ``path``::

    meta/          RocksDB: key -> record length, file id, header (:mod:`kvtier.daemon.store.disk_meta`)
    data/00..ff/   block files, named by their file id (16 hex digits), in shard ``id & 0xff``;
                   also the free files that no meta entry names, kept for reuse

A block file is the whole record, header then payload, each padded to a page (see
:mod:`kvtier.daemon.store.disk_io`): decodable and verifiable alone, and its payload moves by DMA between
the device and a page-aligned host slot. At start the store rebuilds its index from ``meta``
alone (:meth:`DiskTier.iter_meta`), never reading a payload.

Why a file per block (measured, see the disk note): no allocator or free-space map to recover
after a crash, and the file system allocates. Creating a file costs ~1 ms on ext4, so the files
of deleted records are kept and written over by later records of the same size
(:mod:`kvtier.daemon.store.disk_files`): a cache at capacity creates and unlinks no file.

Crash consistency: a record's file (a free one, or a new one) is written completely, and only
then is its meta entry committed, so a key in ``meta`` names a whole file. A file is written over
or unlinked only after the meta deletion (or overwrite) that dropped it was committed. Files that
no meta entry names (a crash between the two steps) are free again at open. A meta entry whose
file is gone reads as a miss.

Durability: by default the payload is on the device when ``pwrite`` returns (O_DIRECT) and the
meta commit is in RocksDB's write-ahead log, unsynced: this survives a crash or SIGKILL of the
process, not a power loss. ``sync_writes=True`` fdatasyncs each file, fsyncs its directory and
syncs the log before :meth:`DiskTier.put_many` returns. The store verifies header and payload
(xxh3) of every record it reads, so a damaged file is a miss, never wrong bytes.

The tier does not evict by itself: the store's index picks victims (LRU over disk blocks) and calls
:meth:`DiskTier.delete_many`. All methods block; the store runs them on a thread pool, and the
file I/O releases the GIL (RocksDB calls hold it, but carry only small metadata now).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence

from kvtier_protocol.errors import StorageError
from kvtier_protocol.header import payload_checksum

from kvtier.daemon.store.disk_files import BlockFiles, Payload
from kvtier.daemon.store.disk_io import BufferPool, copy_into
from kvtier.daemon.store.disk_meta import Location, MetaDB, storage_errors
from kvtier.daemon.store.disk_ram import tune_glibc_malloc

MIB = 1 << 20


class DiskTier:
    """Block records in files, their metadata in RocksDB.

    Args:
        path: the tier's directory (created if missing). A directory of the former layout (whole
            records in RocksDB) is recognised and its records are dropped, with one log line.
        capacity_bytes: the byte budget of records (header + payload) the store keeps here;
            reported for the store's eviction, not enforced by this class.
        sync_writes: fdatasync files, fsync directories and sync the log on every write
            (survives power loss, slower).
        max_background_jobs: RocksDB flush and compaction threads.
        write_buffer_bytes: RocksDB's memtable size (keys and headers only).
        tune_malloc: make glibc malloc reuse large buffers (see :func:`tune_glibc_malloc`).
        malloc_trim_bytes: freed memory glibc may keep per arena (the first DiskTier sets it).
        buffer_pool_bytes: page-aligned snapshot and bounce buffers kept for reuse (:attr:`buffers`).
        direct_io: write and read block files with O_DIRECT (off: through the page cache, as
            happens anyway, logged once, on a file system that refuses O_DIRECT).
        keep_free_bytes: files of deleted records kept to be written over by new records of the
            same size (no file created, none unlinked); beyond this they are unlinked, oldest
            first. Default: what ``capacity_bytes`` leaves beside the live files, so that the
            tier's files, live and free, take no more than its budget (plus page padding).
        min_free_bytes: a write that would leave less free space than this on the file system is
            refused (StorageError) before any byte is written, so RocksDB (whose failed write is
            a sticky error) always has room for its log and tables. Default: eight memtables.

    Raises:
        StorageError: the tier cannot be opened (bad path, permissions, corruption, locked).
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, sync_writes: bool = False,
                 max_background_jobs: int = 2, write_buffer_bytes: int = 4 * MIB, tune_malloc: bool = True,
                 min_free_bytes: int | None = None, malloc_trim_bytes: int = 512 * MIB,
                 buffer_pool_bytes: int = 64 * MIB, direct_io: bool = True,
                 keep_free_bytes: int | None = None) -> None:
        if tune_malloc:
            tune_glibc_malloc(malloc_trim_bytes)
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = 8 * write_buffer_bytes if min_free_bytes is None else min_free_bytes
        self.buffers = BufferPool(buffer_pool_bytes)
        self._lock = threading.Lock()  # serialises writes with their byte accounting and file ids
        self._closed = False
        self._meta = MetaDB(self.path, sync=sync_writes, max_background_jobs=max_background_jobs,
                            write_buffer_bytes=write_buffer_bytes)
        try:
            with storage_errors(f"open {self.path}"):
                self._keep_free = keep_free_bytes
                self._files = BlockFiles(os.path.join(self.path, "data"), self.buffers, keep_free_bytes=0,
                                         sync=sync_writes, direct=direct_io)
                try:
                    self._scan()
                except BaseException:
                    self._files.close()
                    raise
        except BaseException:
            self._meta.close()
            raise

    def _scan(self) -> None:
        """Count the records from meta alone; the files no record names are free."""
        used = count = fbytes = 0
        live: set[int] = set()
        for _, loc in self._meta.entries():
            used += loc.length
            count += 1
            fbytes += loc.file_bytes
            live.add(loc.fid)
        self._used, self._count, self._file_bytes = used, count, fbytes
        self._files.keep_free_bytes = self._free_budget()
        self._files.reclaim(live)

    # --- writes --------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, bytes, Payload]]) -> None:
        """Store ``(key, header, payload)`` records, all or none (one atomic meta batch).

        A key stored already is overwritten (the last of a key in ``items`` wins). Each payload is
        written where it lies when it is page-aligned (a view from :attr:`buffers`, a host slot),
        else through one copy into an aligned buffer.

        Raises:
            StorageError: the write failed (I/O error, disk full); nothing was written.
        """
        if not items:
            return
        last = {key: (header, payload) for key, header, payload in items}
        payloads = [p for _, p in last.values()]
        self._put([(k, h, memoryview(p).nbytes) for k, (h, p) in last.items()], payloads.__getitem__, None)

    def put_verified(self, items: Sequence[tuple[bytes, bytes, memoryview, int]]) -> list[bool]:
        """Store ``(key, header, source, checksum)`` records through verified snapshots: each
        source (a host slot) is copied into an aligned buffer, the copy's xxh3 is checked against
        ``checksum``, and only a matching copy is written, so the bytes written down are exactly
        the bytes checked. The copy and hash of a record run while the one before is written.
        Keys must be distinct; a key stored already is overwritten, as by :meth:`put_many`.

        Returns:
            Per item: stored, or False when its copy failed the check (nothing written for it).

        Raises:
            StorageError: the write failed (I/O error, disk full); nothing was written.
        """
        if not items:
            return []
        assert len({key for key, *_ in items}) == len(items), "put_verified takes distinct keys"

        def snapshot(i: int) -> memoryview | None:
            source, checksum = items[i][2], items[i][3]
            copy = self.buffers.get(source.nbytes)
            copy_into(copy, source)
            if payload_checksum(copy) == checksum:
                return copy
            self.buffers.give_back(copy)
            return None

        return self._put([(k, h, v.nbytes) for k, h, v, _ in items], snapshot, self.buffers.give_back)

    def _put(self, entries: list[tuple[bytes, bytes, int]], payload_of: Callable[[int], Payload | None],
             release: Callable[[memoryview], None] | None) -> list[bool]:
        """Write the files of ``(key, header, payload bytes)`` entries, then commit their meta in
        one batch. ``payload_of(i)`` gives entry i's payload (None: skip it); with ``release``
        (given each payload once written), it runs while the previous entry is being written."""
        locs = [Location(len(h) + n, 0, h) for _, h, n in entries]
        with self._lock, storage_errors("write"):
            self._check_open()
            self._check_room([loc.file_bytes for loc in locs])
            old = self._meta.locate([k for k, _, _ in entries])
            written: list[tuple[int, int]] = []  # (entry, file id)
            try:
                self._files.write_many([(loc.header, loc.file_bytes) for loc in locs], payload_of, release, written)
                puts = [(entries[i][0], Location(locs[i].length, fid, locs[i].header)) for i, fid in written]
                if self._files.io.sync:
                    self._files.sync_dirs([fid for _, fid in written])
                self._meta.commit(puts)
            except BaseException:
                self._files.release([(fid, locs[i].file_bytes) for i, fid in written])
                raise
            self._account([loc for _, loc in puts], [o for o in (old[i] for i, _ in written) if o is not None])
        stored = [False] * len(entries)
        for i, _ in written:
            stored[i] = True
        return stored

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove records (absent keys are ignored), all or none; their files become free after
        the commit (written over by later records, or unlinked).

        Raises:
            StorageError: the write failed.
        """
        if not keys:
            return
        unique = list(dict.fromkeys(keys))
        with self._lock, storage_errors("delete"):
            self._check_open()
            old = [o for o in self._meta.locate(unique) if o is not None]
            self._meta.commit([], unique)
            self._account([], old)

    def _account(self, added: list[Location], gone: list[Location]) -> None:
        """Count committed records in and out; the files of those gone are free from now on."""
        self._used += sum(loc.length for loc in added) - sum(loc.length for loc in gone)
        self._file_bytes += sum(loc.file_bytes for loc in added) - sum(loc.file_bytes for loc in gone)
        self._count += len(added) - len(gone)
        self._files.keep_free_bytes = self._free_budget()
        self._files.release([(loc.fid, loc.file_bytes) for loc in gone])

    def _free_budget(self) -> int:
        """Bytes of free files to keep (see ``keep_free_bytes``)."""
        if self._keep_free is not None:
            return self._keep_free
        return max(0, self.capacity_bytes - self._file_bytes)

    # --- reads ---------------------------------------------------------------------------------

    def read_into(self, keys: Sequence[bytes], views: Sequence[memoryview]) -> list[bytes | None]:
        """Read the payloads of ``keys`` into ``views`` (each exactly its payload's length) and
        return each record's header as stored in its file; None for a missing record (no meta
        entry, no file, or a payload length other than the view's). Unverified: the caller checks.

        Raises:
            StorageError: a file could not be read or is shorter than its record.
        """
        out: list[bytes | None] = []
        with storage_errors("read"):
            self._check_open()
            for key, view in zip(keys, views):
                loc = self._meta.get(key)
                if loc is None or loc.payload_len != view.nbytes:
                    out.append(None)
                    continue
                try:
                    out.append(self._files.read_into(loc.fid, len(loc.header), view))
                except FileNotFoundError:
                    out.append(None)  # meta without data: a miss, never other bytes
        return out

    def get(self, key: bytes) -> bytes | None:
        """The whole record (header + payload) as stored, or None. The caller verifies it."""
        with storage_errors("read"):
            self._check_open()
            loc = self._meta.get(key)
        if loc is None:
            return None
        record = bytearray(loc.length)
        header = self.read_into([key], [memoryview(record)[len(loc.header):]])[0]
        if header is None:
            return None
        record[:len(header)] = header
        return bytes(record)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Records of ``keys`` in order (None for a missing one)."""
        return [self.get(key) for key in keys]

    def contains(self, key: bytes) -> bool:
        with storage_errors("read"):
            self._check_open()
            return self._meta.get(key) is not None

    def iter_meta(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(key, header bytes)`` in key order, read from the metadata only."""
        with storage_errors("scan"):
            self._check_open()
            for key, loc in self._meta.entries():
                yield key, loc.header

    @property
    def used_bytes(self) -> int:
        """Bytes of the stored records (header + payload), without padding or metadata."""
        return self._used

    @property
    def num_records(self) -> int:
        return self._count

    # --- maintenance ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Make what was written durable: sync the file system (the files' metadata: their data
        went down with O_DIRECT), flush RocksDB's memtable and sync its log."""
        with storage_errors("flush"):
            self._check_open()
            self._files.sync_all()
            self._meta.flush()

    def compact(self) -> None:
        """Compact the metadata and unlink the free files (deleted records leave no garbage
        inside files: there is no data to compact)."""
        with storage_errors("compact"):
            self._check_open()
            self._meta.compact()
            self._files.shed(set())

    def drain(self) -> None:
        """Wait until the unlinks of free files beyond ``keep_free_bytes`` are done."""
        self._files.drain()

    def live_files(self) -> list[str]:
        """Paths of the block files, free ones included."""
        return self._files.listing()

    def file_path(self, key: bytes) -> str | None:
        """The block file of ``key`` (None: no record), for tools and tests that inspect the bytes."""
        with storage_errors("read"):
            loc = self._meta.get(key)
        return None if loc is None else self._files.path(loc.fid)

    @property
    def file_bytes(self) -> int:
        """Bytes the tier takes on disk: the block files of records (padded to pages), the free
        files kept for reuse, and RocksDB's files."""
        return self._file_bytes + self._files.free_bytes + self._meta.disk_bytes()

    def close(self) -> None:
        """Finish the pending writes and unlinks, flush RocksDB's memtable and release the
        database (its lock too), even when a step fails. Idempotent.

        Raises:
            StorageError: the first failure, after everything was released.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._files.close()
            finally:
                self._meta.close()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals -----------------------------------------------------------------------------

    def _check_room(self, sizes: list[int]) -> None:
        """Refuse writes of files of ``sizes`` that would eat into ``min_free_bytes`` (see the
        class); free files of other sizes are unlinked first when the disk is short."""
        need = self._files.new_bytes(sizes)
        if _free_space(self.path) - need < self.min_free_bytes:
            self._files.shed(set(sizes))
        free = _free_space(self.path)
        if free - need < self.min_free_bytes:
            raise StorageError(f"disk tier write of {need} new bytes refused: {free} bytes free on "
                               f"{self.path}, {self.min_free_bytes} kept free for RocksDB")

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the disk tier is closed")


def _free_space(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
