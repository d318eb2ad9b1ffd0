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

Damaged metadata: a cache must never refuse to start over its own metadata, and never lose
blocks silently over it, and every block file is self-describing (a header naming its namespace,
key and checksum), so the metadata can always be rebuilt from the files. At open the metadata is
damaged when RocksDB fails to open it (a truncated or missing table, MANIFEST or CURRENT), when
the full scan of its entries hits a damaged table (a flipped byte), when it is new while block
files exist, or when block files exist that it does not list and that the free list saved at the
last clean close does not name either. Then ``meta`` is moved aside (``meta.damaged-<UTC time>``,
kept for the operator), a new one is built from the headers of the block files (not the free
ones, where the free list tells them), the repair is logged and described in
:attr:`DiskTier.repair`.

Namespaces: the store saves each namespace it registers here (:meth:`DiskTier.save_namespace`,
``ns:<ns_id>`` in ``meta``), and reads them back at open (:meth:`DiskTier.namespaces`), so a
restarted daemon still knows the model and geometry of the blocks it keeps. A stored block's
namespace that ``meta`` does not hold (metadata rebuilt from the block files, or written before
namespaces were saved) is recovered at open from a header that carries ``ns_fields``, if any does.

Who owns the directory: ``owner.lock`` (:class:`~kvtier.daemon.store.owner.OwnerLock`), taken
before anything else and held until :meth:`DiskTier.close`; a second process is refused with
one line naming the holder. Directories are made 0700 and files 0600, whatever the umask.

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

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import cbor2

from kvtier_protocol.errors import KVTierError, StorageError
from kvtier_protocol.header import decode_header, payload_checksum
from kvtier_protocol.header_types import PREAMBLE_LEN
from kvtier_protocol.namespace import NS_ID_LEN, Namespace

from kvtier.daemon.store.disk_files import BlockFiles, Payload
from kvtier.daemon.store.disk_io import ALIGN, BufferPool, copy_into, file_bytes
from kvtier.daemon.store.disk_meta import Location, MetaDB, storage_errors
from kvtier.daemon.store.disk_ram import tune_glibc_malloc
from kvtier.daemon.store.owner import OwnerLock
from kvtier.daemon.store.types import make_key

log = logging.getLogger(__name__)
MIB = 1 << 20
_COMMIT_BATCH = 1024  # meta entries per batch while rebuilding
_NS_CANDIDATES = 4  # headers with ns_fields kept per unsaved namespace at open, should one be bad
# RocksDB open failures that are not damage of the metadata: rebuilding would not help.
_NOT_DAMAGE = ("While lock file", "Resource temporarily unavailable", "Permission denied", "No space left",
               "Read-only file system")


@dataclass(frozen=True, slots=True)
class MetaRepair:
    """How the metadata was found damaged at open, and rebuilt from the block files.

    Attributes:
        reason: what showed the damage (RocksDB's error, or a count of files against entries).
        moved_to: where the damaged metadata was moved (kept for the operator).
        adopted: block files whose record is listed again.
        skipped: block files left free (the free list named them, or no valid record in them).
    """

    reason: str
    moved_to: str
    adopted: int
    skipped: int

    def describe(self) -> str:
        return (f"metadata damaged ({self.reason}); moved aside to {self.moved_to}; rebuilt from "
                f"the block files: {self.adopted} records listed again, {self.skipped} files left free")


@dataclass(frozen=True, slots=True)
class Unlisted:
    """A block file that the metadata does not list and that is not a free file: a valid record."""

    fid: int
    key: bytes
    header: bytes


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

    Attributes:
        repair: the metadata repair made at open (None: the metadata was sound).
        previous_owner: the pid of the process that held the directory before, and is gone now
            (None: none recorded, or it closed the tier cleanly).

    Raises:
        DirectoryBusy: another live process has the tier open (a StorageError).
        StorageError: the tier cannot be opened (bad path, permissions, a full disk).
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
        self.repair: MetaRepair | None = None
        self._owner = OwnerLock.acquire(self.path)  # first: nothing else may touch a live tier's files
        self.previous_owner = self._owner.previous_pid
        self._open_db = functools.partial(MetaDB, self.path, sync=sync_writes,
                                          max_background_jobs=max_background_jobs,
                                          write_buffer_bytes=write_buffer_bytes)
        try:
            with storage_errors(f"open {self.path}"):
                self._keep_free = keep_free_bytes
                self._files = BlockFiles(os.path.join(self.path, "data"), self.buffers, keep_free_bytes=0,
                                         sync=sync_writes, direct=direct_io)
                try:
                    self._open_meta()
                except BaseException:
                    self._files.close()
                    raise
        except BaseException:
            self._owner.release()
            raise

    def _open_meta(self) -> None:
        """Open the metadata, check it against the block files, rebuild it if damaged, and count
        the records; the files no record names are free."""
        free = self._files.take_free_list()
        reason = tally = None
        try:
            self._meta = self._open_db()
        except StorageError as e:
            if any(s in str(e) for s in _NOT_DAMAGE):
                raise
            reason = str(e)
        if reason is None:
            try:
                tally = self._tally()
                reason = self._count_check(tally, free)
            except StorageError as e:
                reason = str(e)
            if reason is not None:
                self._meta.close()
        try:
            if reason is not None:
                self._rebuild(reason, free)
                tally = self._tally()
            assert tally is not None, "tallied above, or after the rebuild"
            self._used, self._count, self._file_bytes, live = tally
            self._load_namespaces()
            self._files.keep_free_bytes = self._free_budget()
            self._files.reclaim(live)
        except BaseException:
            self._meta.close()
            raise

    def _saved_namespaces(self) -> dict[bytes, Namespace]:
        """The namespaces saved in ``meta`` (a damaged or foreign entry is dropped with a log line).

        Raises:
            StorageError: a damaged table.
        """
        out: dict[bytes, Namespace] = {}
        for ns_id, canonical in self._meta.namespaces().items():
            ns = _namespace_from(canonical)
            if ns is None or ns.ns_id != ns_id:
                log.warning("kvtier disk tier %s: saved namespace %s is unreadable: dropped", self.path, ns_id.hex())
                continue
            out[ns_id] = ns
        return out

    def _load_namespaces(self) -> None:
        """Recover the namespaces of stored blocks that ``meta`` lacks from the headers carrying
        ``ns_fields`` that :meth:`_tally` set aside, and save them."""
        found: dict[bytes, Namespace] = {}
        for ns_id, headers in self._ns_candidates.items():
            for header in headers:
                ns = _header_namespace(header)
                if ns is not None and ns.ns_id == ns_id:  # else a bad one: the next may do
                    found[ns_id] = ns
                    break
        self._ns_candidates = {}
        if found:
            self._meta.put_namespaces([(ns_id, ns.canonical_bytes()) for ns_id, ns in found.items()])
            self._namespaces.update(found)
            log.info("kvtier disk tier %s: %d namespaces recovered from block headers", self.path, len(found))

    def namespaces(self) -> list[Namespace]:
        """The namespaces saved with this tier (:meth:`save_namespace`) or recovered at open."""
        with self._lock:
            return list(self._namespaces.values())

    def namespace(self, ns_id: bytes) -> Namespace | None:
        """The namespace ``ns_id`` if saved here (:meth:`namespaces`), else None."""
        with self._lock:
            return self._namespaces.get(ns_id)

    def save_namespace(self, ns: Namespace) -> bool:
        """Save ``ns`` with the metadata, so that it is known again after a restart.

        Returns:
            True when it was new here (written), False when it was saved already.

        Raises:
            StorageError: the tier is closed, or RocksDB refused the write.
        """
        with self._lock:
            self._check_open()
            if ns.ns_id in self._namespaces:
                return False
            self._meta.put_namespaces([(ns.ns_id, ns.canonical_bytes())])
            self._namespaces[ns.ns_id] = ns
            return True

    def _tally(self) -> tuple[int, int, int, set[int]]:
        """One pass over the entries (meta only): record bytes, records, file bytes, file ids.

        Raises:
            StorageError: a damaged table.
        """
        used = count = fbytes = 0
        live: set[int] = set()
        # In the same pass (a second one would double the start-up time of a large tier): a few
        # headers carrying ns_fields of each namespace that meta has not saved (_load_namespaces).
        self._namespaces = self._saved_namespaces()
        self._ns_candidates: dict[bytes, list[bytes]] = {}
        for key, loc in self._meta.entries():
            used += loc.length
            count += 1
            fbytes += loc.file_bytes
            live.add(loc.fid)
            ns_id = key[:NS_ID_LEN]
            if ns_id not in self._namespaces:
                headers = self._ns_candidates.setdefault(ns_id, [])
                if len(headers) < _NS_CANDIDATES and b"ns_fields" in loc.header:
                    headers.append(loc.header)
        return used, count, fbytes, live

    def _count_check(self, tally: tuple[int, int, int, set[int]], free: set[int] | None) -> str | None:
        """Why the block files show the metadata damaged (None: they do not)."""
        if not self._meta.fresh and free is None:
            return None  # after a crash the free files are not known: nothing to count against
        count, live = tally[1], tally[3]
        files = self._files.scan()
        if self._meta.fresh and files:
            return f"the metadata is new but {len(files)} block files exist"
        unlisted = [fid for fid, size in files.items()  # not counting partial files (a crash mid-write)
                    if fid not in live and (free is None or fid not in free) and size and size % ALIGN == 0]
        if unlisted:
            return f"{len(unlisted)} block files are neither listed by the metadata ({count} entries) nor free"
        return None

    def _rebuild(self, reason: str, free: set[int] | None) -> None:
        """Move the damaged metadata aside and list again every valid record file (not the free
        ones where ``free`` names them); the newest file of a key wins."""
        meta_path = os.path.join(self.path, "meta")
        moved = f"{meta_path}.damaged-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        n = 1
        while os.path.exists(moved if n == 1 else f"{moved}-{n}"):
            n += 1
        moved = moved if n == 1 else f"{moved}-{n}"
        if os.path.exists(meta_path):
            os.rename(meta_path, moved)
        self._meta = self._open_db()
        try:
            best: dict[bytes, tuple[int, Location]] = {}
            skipped = 0
            for fid, size in sorted(self._files.scan().items()):
                found = None if free is not None and fid in free else self._read_record_head(fid, size)
                if found is None:
                    skipped += 1
                    continue
                key, loc = found
                if key in best:
                    skipped += 1  # an older file of the same key (overwritten): free
                best[key] = (fid, loc)
            puts = [(key, Location(loc.length, fid, loc.header)) for key, (fid, loc) in best.items()]
            for i in range(0, len(puts), _COMMIT_BATCH):
                self._meta.commit(puts[i:i + _COMMIT_BATCH])
            self._meta.flush()
        except BaseException:
            self._meta.close()
            raise
        self.repair = MetaRepair(" ".join(reason.split()), moved, len(puts), skipped)  # one line
        log.warning("kvtier disk tier %s: %s", self.path, self.repair.describe())

    def _read_record_head(self, fid: int, size: int) -> tuple[bytes, Location] | None:
        """The key and meta entry of block file ``fid`` from its header, if it holds a whole
        record of a valid header (the payload is verified when it is read)."""
        try:
            head = self._files.read_head(fid, ALIGN)
            if len(head) >= PREAMBLE_LEN:
                need = PREAMBLE_LEN + int.from_bytes(head[8:12], "little")
                if need > len(head) and need <= size:
                    head = self._files.read_head(fid, need)
            h, end = decode_header(head)
        except (OSError, KVTierError):
            return None
        if size != file_bytes(end, h.payload_len):
            return None  # a partial file (a crash while it was written), or foreign
        return make_key(h.ns_id, h.chain_hash), Location(end + h.payload_len, fid, bytes(head[:end]))

    def unlisted(self) -> list[Unlisted]:
        """The block files that the metadata does not list and that are not free, holding a valid
        record (one header read each). None exist unless something wrote files behind the tier."""
        with self._lock, storage_errors("scan"):
            self._check_open()
            # Free files trimmed beyond the cap are unlinked on the reaper thread: until it has,
            # they are neither live nor free and still hold their old record. Wait for it (no
            # new trim can start: deletes and writes take this lock), or an audit under load
            # reports a block deleted a moment ago as an orphan.
            self._files.drain()
            live = {loc.fid for _, loc in self._meta.entries()}
            free = self._files.free_ids()
            out = []
            for fid, size in sorted(self._files.scan().items()):
                if fid in live or fid in free:
                    continue
                found = self._read_record_head(fid, size)
                if found is not None:
                    out.append(Unlisted(fid, found[0], found[1].header))
            return out

    def adopt(self, files: Sequence[Unlisted]) -> list[bytes]:
        """List again the records of ``files`` (from :meth:`unlisted`) whose key has no entry;
        returns their keys. The others' files become free.

        Raises:
            StorageError: the meta write failed.
        """
        with self._lock, storage_errors("adopt"):
            self._check_open()
            free = self._files.free_ids()
            found: dict[bytes, Location] = {}
            drop: list[tuple[int, int]] = []
            for f, old in zip(files, self._meta.locate([f.key for f in files])):
                size = os.stat(self._files.path(f.fid)).st_size
                if old is not None or f.key in found or f.fid in free:
                    if f.fid not in free:
                        drop.append((f.fid, size))
                    continue
                found[f.key] = Location(len(f.header) + _payload_len(f.header), f.fid, f.header)
            self._meta.commit(list(found.items()))
            self._account(list(found.values()), [])
            self._files.release(drop)
            self._files.next_id = max([self._files.next_id] + [f.fid + 1 for f in files])
            return list(found)

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

    def free_files(self) -> tuple[int, int]:
        """Files kept free for reuse (no record names them), and their bytes."""
        return len(self._files.free_ids()), self._files.free_bytes

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
                try:
                    self._files.close()
                finally:
                    self._meta.close()
                # Last, once nothing can change: the free files, for the next open's count check.
                with storage_errors("close"):
                    self._files.save_free_list()
            finally:
                self._owner.release()

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


def _namespace_from(canonical: bytes) -> Namespace | None:
    """The namespace of canonical CBOR bytes (None: not a valid namespace)."""
    try:
        return Namespace.from_wire(cbor2.loads(canonical))
    except (KVTierError, ValueError, TypeError, cbor2.CBORDecodeError):
        return None


def _header_namespace(header: bytes) -> Namespace | None:
    """The namespace a record header carries in ``ns_fields`` (None: none, or not valid)."""
    try:
        fields = decode_header(header)[0].ns_fields
        return None if fields is None else Namespace.from_wire(fields)
    except KVTierError:
        return None


def _payload_len(header: bytes) -> int:
    return decode_header(header)[0].payload_len


def _free_space(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
