"""The disk tier: self-describing block records in RocksDB (through rocksdict), large values in blob files.

Two column families, always written together in one atomic WriteBatch::

    records:  key -> header bytes || payload       (a whole record: decodable and verifiable alone)
    meta:     key -> u64le record length || header bytes   (small; what start-up reads)

At start the store rebuilds its index from ``meta`` alone (:meth:`DiskTier.iter_meta`), never
reading a payload. Values of ``blob_min_bytes`` and more go to blob files, so compaction of the
LSM tree moves keys and small pointers, not megabytes of KV.

Durability: every write goes to the write-ahead log before it is acknowledged. By default the WAL
is not fsynced, which survives a crash or SIGKILL of the process (the bytes are in the kernel's
page cache) but not a power loss; ``sync_writes=True`` fsyncs the WAL on each batch for that.

The tier does not evict by itself: the store's index picks victims (LRU over disk blocks) and calls
:meth:`DiskTier.delete_many`. All methods block; the store runs them on a thread pool. Note that
rocksdict keeps the GIL during a call, so a multi-megabyte get still pauses other Python threads.

Reads skip RocksDB's own block/blob checksums: a record carries an xxh3 checksum of its header and
of its payload, which the store verifies on every disk read, and this build of RocksDB computes
its CRC32C in software (about 1 GB/s), which would otherwise double the CPU cost per byte read.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from rocksdict import (BottommostLevelCompaction, CompactOptions, DBCompressionType, Options, Rdict, ReadOptions,
                       WriteBatch, WriteOptions)

from kvtier_protocol.errors import KVTierError, StorageError

KIB, MIB = 1 << 10, 1 << 20
_LEN = struct.Struct("<Q")  # the record length that prefixes a meta value
_RECORDS, _META = "records", "meta"
_GC_AGE_CUTOFF = 0.5


@contextmanager
def _storage_errors(what: str) -> Iterator[None]:
    """Turn RocksDB failures (plain ``Exception`` from rocksdict: I/O errors, ENOSPC, a closed
    database) into StorageError. Programming errors (TypeError, ValueError) pass through."""
    try:
        yield
    except (KVTierError, TypeError, ValueError):
        raise
    except Exception as e:
        raise StorageError(f"disk tier {what}: {e}") from e


class DiskTier:
    """Block records in RocksDB.

    Args:
        path: the database directory (created if missing).
        capacity_bytes: the byte budget of records (header + payload) the store keeps here;
            reported for the store's eviction, not enforced by this class.
        blob_min_bytes: values at least this large are stored in blob files.
        sync_writes: fsync the WAL on every batch (survives power loss, slower).
        max_background_jobs: RocksDB flush and compaction threads.
        write_buffer_bytes: memtable size of the records family; a flush writes this much at once.
            RocksDB holds every value in a memtable (up to 4 of them) until a flush moves it into a
            blob file, so this is RAM the disk tier costs: size it with :func:`ram_budget`.
        tune_malloc: make glibc malloc reuse large buffers (see :func:`tune_glibc_malloc`).
        malloc_trim_bytes: freed memory glibc may keep per arena (the first DiskTier sets it).
        min_free_bytes: a write that would leave less free space than this on the file system is
            refused (StorageError) before RocksDB sees it. RocksDB treats a failed write (ENOSPC)
            as a sticky error: every later write and the close fail, and a reopen must flush the
            log into new files, which fails on a full disk too. The margin covers the memtables
            (in the log until flushed, then written again as blob files). Default: eight
            memtables (``write_buffer_bytes * 8``), over twice the 3 RocksDB may hold.

    Raises:
        StorageError: the database cannot be opened (bad path, permissions, corruption).
    """

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, blob_min_bytes: int = 64 * KIB,
                 sync_writes: bool = False, max_background_jobs: int = 2, write_buffer_bytes: int = 64 * MIB,
                 tune_malloc: bool = True, min_free_bytes: int | None = None,
                 malloc_trim_bytes: int = 512 * MIB) -> None:
        if tune_malloc:
            tune_glibc_malloc(malloc_trim_bytes)
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.min_free_bytes = 8 * write_buffer_bytes if min_free_bytes is None else min_free_bytes
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_max_background_jobs(max_background_jobs)
        opts.set_keep_log_file_num(4)
        opts.set_max_total_wal_size(4 * write_buffer_bytes)
        # Leave the kernel's readahead on: blocks of one prefix are written together, so they lie
        # next to each other in a blob file and the next one is read while this one is copied
        # (measured 0.69 -> 1.15 GB/s cold reads of 8 MiB records). RocksDB's default, made for
        # small random values, disables it with POSIX_FADV_RANDOM.
        opts.set_advise_random_on_open(False)
        records = Options(raw_mode=True)
        records.set_enable_blob_files(True)
        records.set_min_blob_size(blob_min_bytes)
        records.set_blob_file_size(256 * MIB)
        # Compactions relocate the live blobs of the oldest half of blob files, and a blob file
        # that is more than half garbage forces such a compaction: a cache deletes a lot, and a
        # blob file is only dropped once every record in it is gone.
        records.set_enable_blob_gc(True)
        records.set_blob_gc_age_cutoff(_GC_AGE_CUTOFF)
        records.set_blob_gc_force_threshold(0.5)
        records.set_blob_compression_type(DBCompressionType.none())  # raw KV does not compress (DESIGN §3)
        records.set_compression_type(DBCompressionType.none())
        records.set_write_buffer_size(write_buffer_bytes)
        records.set_max_write_buffer_number(3)  # keep accepting writes while one or two memtables flush
        meta = Options(raw_mode=True)
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync_writes
        self._read_opts = ReadOptions()
        self._read_opts.set_verify_checksums(False)
        self._lock = threading.Lock()  # serialises writes with their byte accounting
        self._closed = False
        with _storage_errors(f"open {self.path}"):
            self._db = Rdict(self.path, opts, column_families={_RECORDS: records, _META: meta})
            self._records = self._db.get_column_family(_RECORDS)
            # Preset, not only passed per call: rocksdict's multi-get ignores a read_opt argument.
            self._records.set_read_options(self._read_opts)
            self._meta = self._db.get_column_family(_META)
            self._records_cf = self._db.get_column_family_handle(_RECORDS)
            self._meta_cf = self._db.get_column_family_handle(_META)
            used = count = 0
            for value in self._meta.values():
                used += _LEN.unpack_from(value)[0]
                count += 1
        self._used = used
        self._count = count

    # --- writes --------------------------------------------------------------------------------

    def put_many(self, items: Sequence[tuple[bytes, bytes, bytes | memoryview]]) -> None:
        """Store ``(key, header, payload)`` records, all or none (one atomic batch).

        A key stored already is overwritten. The record is ``header || payload``, built with one
        copy (rocksdict accepts only ``bytes``).

        Raises:
            StorageError: the write failed (I/O error, disk full); nothing was written.
        """
        if not items:
            return
        with self._lock, _storage_errors("write"):
            self._check_open()
            self._check_room(sum(len(h) + len(p) for _, h, p in items))
            batch = WriteBatch(raw_mode=True)
            lengths: dict[bytes, int] = {}
            for key, header, payload in items:
                record = b"".join((header, payload))
                batch.put(key, record, self._records_cf)
                batch.put(key, _LEN.pack(len(record)) + header, self._meta_cf)
                lengths[key] = len(record)
            old = self._lengths(list(lengths))
            self._db.write(batch, self._write_opts)
            self._used += sum(lengths.values()) - sum(n for n in old if n is not None)
            self._count += sum(n is None for n in old)

    def delete_many(self, keys: Sequence[bytes]) -> None:
        """Remove records (absent keys are ignored), all or none.

        Raises:
            StorageError: the write failed.
        """
        if not keys:
            return
        unique = list(dict.fromkeys(keys))
        with self._lock, _storage_errors("delete"):
            self._check_open()
            batch = WriteBatch(raw_mode=True)
            for key in unique:
                batch.delete(key, self._records_cf)
                batch.delete(key, self._meta_cf)
            old = [n for n in self._lengths(unique) if n is not None]
            self._db.write(batch, self._write_opts)
            self._used -= sum(old)
            self._count -= len(old)

    # --- reads ---------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        """The whole record (header + payload) as stored, or None. The caller verifies it."""
        with _storage_errors("read"):
            self._check_open()
            return self._records.get(key, read_opt=self._read_opts)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Records of ``keys`` in order (None for a missing one)."""
        with _storage_errors("read"):
            self._check_open()
            # One get per key: as fast as rocksdict's multi-get for blob values (measured).
            get, opts = self._records.get, self._read_opts
            return [get(key, read_opt=opts) for key in keys]

    def contains(self, key: bytes) -> bool:
        with _storage_errors("read"):
            self._check_open()
            return self._meta.get(key) is not None

    def iter_meta(self) -> Iterator[tuple[bytes, bytes]]:
        """Every ``(key, header bytes)`` in key order, read from the meta family only."""
        with _storage_errors("scan"):
            self._check_open()
            for key, value in self._meta.items():
                yield key, value[_LEN.size:]

    @property
    def used_bytes(self) -> int:
        """Bytes of the stored records (header + payload), excluding RocksDB's own overhead."""
        return self._used

    @property
    def num_records(self) -> int:
        return self._count

    # --- maintenance ---------------------------------------------------------------------------

    def flush(self) -> None:
        """Write the memtables to SST/blob files and sync the WAL."""
        with _storage_errors("flush"):
            self._check_open()
            self._records.flush(True)
            self._meta.flush(True)
            self._db.flush_wal(True)

    def compact(self) -> None:
        """Compact both families fully and rewrite every blob file that holds deleted records,
        so the files shrink to the live records (costs a rewrite of all live payloads)."""
        full = CompactOptions()
        full.set_bottommost_level_compaction(BottommostLevelCompaction.force())
        with _storage_errors("compact"):
            self._check_open()
            self._records.set_options({"blob_garbage_collection_age_cutoff": "1.0"})
            try:
                self._records.compact_range(None, None, full)
            finally:
                self._records.set_options({"blob_garbage_collection_age_cutoff": str(_GC_AGE_CUTOFF)})
            self._meta.compact_range(None, None, full)

    def live_files(self) -> list[str]:
        """Paths of the files holding data (SST, blob)."""
        names = os.listdir(self.path)
        return [os.path.join(self.path, n) for n in names if n.endswith((".sst", ".blob"))]

    @property
    def file_bytes(self) -> int:
        """Bytes of the database's data and log files on disk: ``used_bytes`` plus RocksDB's
        overhead and not yet collected garbage of deleted records."""
        total = 0
        for name in os.listdir(self.path):
            if name.endswith((".sst", ".blob", ".log")):
                try:
                    total += os.path.getsize(os.path.join(self.path, name))
                except FileNotFoundError:
                    pass  # removed by a background job meanwhile
        return total

    def close(self) -> None:
        """Flush memtables and release the database (its lock too). Idempotent.

        Every handle is closed even when an earlier one fails (a database in RocksDB's error
        state, after ENOSPC or a damaged file, fails its flush at close): otherwise the database
        and its lock would stay held by this process.

        Raises:
            StorageError: the first failure, after everything was released.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            first: StorageError | None = None
            # rocksdict keeps the database open while any family object lives: close all.
            for what in (self._records, self._meta, self._db):
                try:
                    with _storage_errors("close"):
                        what.close()
                except StorageError as e:
                    first = first or e
            del self._records_cf, self._meta_cf
            if first is not None:
                raise first

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _lengths(self, keys: list[bytes]) -> list[int | None]:
        """Record lengths of ``keys`` (None: absent), from the meta family."""
        return [None if v is None else _LEN.unpack_from(v)[0] for v in self._meta.get(keys)]

    def _check_room(self, nbytes: int) -> None:
        """Refuse a write of ``nbytes`` that would eat into ``min_free_bytes`` (see the class)."""
        st = os.statvfs(self.path)
        free = st.f_bavail * st.f_frsize
        if free - 2 * nbytes < self.min_free_bytes:  # the log, then the blob file at the flush
            raise StorageError(f"disk tier write of {nbytes} bytes refused: {free} bytes free on "
                               f"{self.path}, {self.min_free_bytes} kept free for RocksDB")

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the disk tier is closed")


_malloc_tuned = False


def ram_budget(host_bytes: int) -> tuple[int, int]:
    """``(write_buffer_bytes, malloc_trim_bytes)`` for a daemon whose host tier holds ``host_bytes``.

    The disk tier's RAM (up to 3 memtables of whole values, and the freed buffers glibc keeps)
    is sized from the host tier, so that the daemon stays within its tiers + 10 %: each is
    1/128 of the host tier (3 memtables: 2.3 %), within 1-64 MiB (memtables) and 8-512 MiB (trim
    threshold). A 64 MiB memtable whatever the tiers cost ~90 MiB of RAM beside a 32 MiB host
    tier, and 1/64 still put a 1 GiB host tier 1.5 % over the bound (``kvtier bench soak``);
    below 8 GiB of host tier, flushes come more often, in smaller files.
    """
    share = host_bytes // 128
    return min(64 * MIB, max(MIB, share)), min(512 * MIB, max(8 * MIB, share))


def tune_glibc_malloc(trim_bytes: int = 512 * MIB) -> None:
    """Make glibc malloc keep and reuse large freed buffers (process-wide, once; a no-op elsewhere).

    RocksDB and rocksdict allocate a fresh buffer for every value read, and glibc serves buffers
    above its mmap threshold with a new mapping each time, so every multi-megabyte get paid page
    faults that zero the memory: measured 0.4-0.6 GB/s warm reads before, 1.7-3 GB/s after.
    Raising the mmap threshold to its maximum (32 MiB) and the trim threshold keeps such buffers
    in the heap. The price: up to ``trim_bytes`` (``M_TRIM_THRESHOLD``) of freed memory stays in
    each malloc arena of the process.
    """
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 * MIB)
    mallopt(m_trim_threshold, trim_bytes)
