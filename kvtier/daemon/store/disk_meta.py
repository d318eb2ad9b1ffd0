"""The disk tier's metadata in RocksDB (rocksdict): where each record's file is, and its header.

One column family, ``blocks``: ``key -> u64le record length || u64le file id || header bytes``;
the default family holds the layout version (``format``) and the namespaces registered with the
store (``ns:<ns_id> -> canonical namespace bytes``, SPEC.md §2.3), so that a restarted daemon
still knows the model and geometry of the blocks it keeps. Small values only: start-up reads this
and nothing else, and a RocksDB call (which keeps the GIL) never carries a payload.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from rocksdict import BlockBasedOptions, Cache, DBCompressionType, Options, Rdict, WriteBatch, WriteOptions

from kvtier_protocol.errors import KVTierError, StorageError

from kvtier.daemon.store.disk_io import file_bytes
from kvtier.daemon.store.owner import FILE_MODE, private_dir, tighten

log = logging.getLogger(__name__)
_LOC = struct.Struct("<QQ")  # record length, file id: the prefix of a meta value
_BLOCKS = "blocks"
_FORMAT_KEY, _FORMAT = b"format", b"kvtier-disk/2: a file per block, RocksDB meta"
_NS_PREFIX = b"ns:"  # default family: ns:<ns_id> -> canonical namespace bytes


@contextlib.contextmanager
def storage_errors(what: str) -> Iterator[None]:
    """Turn RocksDB and file system failures (plain ``Exception`` from rocksdict, OSError) into
    StorageError. Programming errors (TypeError, ValueError) pass through."""
    try:
        yield
    except (KVTierError, TypeError, ValueError):
        raise
    except Exception as e:
        raise StorageError(f"disk tier {what}: {e}") from e


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record is: its file, and what the meta entry knows of it."""

    length: int  # record bytes: header + payload
    fid: int  # the block file's id
    header: bytes

    @property
    def payload_len(self) -> int:
        return self.length - len(self.header)

    @property
    def file_bytes(self) -> int:
        return file_bytes(len(self.header), self.payload_len)

    def encode(self) -> bytes:
        return _LOC.pack(self.length, self.fid) + self.header

    @staticmethod
    def decode(value: bytes) -> Location:
        length, fid = _LOC.unpack_from(value)
        return Location(length, fid, value[_LOC.size:])


class MetaDB:
    """The ``meta`` RocksDB directory of a disk tier.

    A directory of the former layout (whole records in RocksDB directly in the tier's
    directory) is removed with one log line: the tier is a cache, its records are dropped.

    RocksDB runs with paranoid checks (a damaged MANIFEST, table or log fails the open) and
    :meth:`entries` raises on a damaged table instead of ending early; the owner
    (:class:`~kvtier.daemon.store.disk.DiskTier`) rebuilds the metadata from the block files then.
    ``fresh`` tells whether the database was just created (no layout marker found).

    Raises:
        StorageError: the database cannot be opened (bad path, permissions, corruption, locked).
    """

    def __init__(self, tier_path: str, *, sync: bool, max_background_jobs: int, write_buffer_bytes: int) -> None:
        opts = Options(raw_mode=True)
        opts.create_if_missing(True)
        opts.create_missing_column_families(True)
        opts.set_max_background_jobs(max_background_jobs)
        opts.set_keep_log_file_num(4)
        opts.set_max_total_wal_size(4 * write_buffer_bytes)
        opts.set_write_buffer_size(write_buffer_bytes)
        opts.set_compression_type(DBCompressionType.none())  # keys are hashes, headers small: no gain
        opts.set_paranoid_checks(True)
        # RocksDB's default block cache (32 MiB) fills with the blocks of every table file a read
        # touched, and compactions keep making new files: commits and reads of a few thousand
        # keys grew a process ~4 MiB per 20K commits until it was full, memory no bound on the
        # daemon counted. The metadata is a few hundred bytes a block, and a table read the cache
        # misses is a page-cache read: a cache the memtable's size (1-8 MiB, from the host tier
        # by disk_ram.ram_budget), shared by both families, is enough.
        table = BlockBasedOptions()
        table.set_block_cache(Cache(write_buffer_bytes))
        opts.set_block_based_table_factory(table)
        self.path = os.path.join(tier_path, "meta")
        self._write_opts = WriteOptions()
        self._write_opts.sync = sync
        with storage_errors(f"open {tier_path}"):
            private_dir(tier_path)
            _drop_old_layout(tier_path)
            private_dir(self.path)  # RocksDB would make it 0777 less the umask
            self._db = Rdict(self.path, opts, column_families={_BLOCKS: opts})
        self.fresh = False
        try:
            with storage_errors(f"open {tier_path}"):
                self._blocks = self._db.get_column_family(_BLOCKS)
                self._cf = self._db.get_column_family_handle(_BLOCKS)
                self._check_format()
                for name in os.listdir(self.path):  # RocksDB makes its files 0666 less the umask
                    with contextlib.suppress(FileNotFoundError):
                        if os.path.isfile(os.path.join(self.path, name)):
                            tighten(os.path.join(self.path, name), FILE_MODE)
        except BaseException:
            self.close()
            raise

    def get(self, key: bytes) -> Location | None:
        value = self._blocks.get(key)
        return None if value is None else Location.decode(value)

    def locate(self, keys: Sequence[bytes]) -> list[Location | None]:
        return [None if v is None else Location.decode(v) for v in self._blocks.get(list(keys))]

    def entries(self) -> Iterator[tuple[bytes, Location]]:
        """Every entry, in key order.

        Raises:
            StorageError: a table is damaged (rocksdict's ``items()`` would just stop there).
        """
        with storage_errors("scan"):
            it = self._blocks.iter()
            it.seek_to_first()
            while it.valid():
                yield it.key(), Location.decode(it.value())
                it.next()
            it.status()

    def namespaces(self) -> dict[bytes, bytes]:
        """The saved namespaces: ns_id -> canonical bytes (as saved; the caller checks them).

        Raises:
            StorageError: a table is damaged.
        """
        out: dict[bytes, bytes] = {}
        with storage_errors("scan namespaces"):
            it = self._db.iter()
            it.seek(_NS_PREFIX)
            while it.valid() and it.key().startswith(_NS_PREFIX):
                out[it.key()[len(_NS_PREFIX):]] = it.value()
                it.next()
            it.status()
        return out

    def put_namespaces(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        """Save ``(ns_id, canonical bytes)`` pairs in one atomic batch (synced with ``sync``)."""
        batch = WriteBatch(raw_mode=True)
        for ns_id, canonical in items:
            batch.put(_NS_PREFIX + ns_id, canonical)
        with storage_errors("save namespaces"):
            self._db.write(batch, self._write_opts)

    def commit(self, puts: Sequence[tuple[bytes, Location]], deletes: Sequence[bytes] = ()) -> None:
        """Apply puts and deletes in one atomic batch (synced with ``sync``)."""
        batch = WriteBatch(raw_mode=True)
        for key, loc in puts:
            batch.put(key, loc.encode(), self._cf)
        for key in deletes:
            batch.delete(key, self._cf)
        self._db.write(batch, self._write_opts)

    def flush(self) -> None:
        """Write the memtable to a table file and sync the log."""
        self._blocks.flush(True)
        self._db.flush(True)  # the default family: the saved namespaces
        self._db.flush_wal(True)

    def compact(self) -> None:
        self._blocks.compact_range(None, None)

    def disk_bytes(self) -> int:
        """Bytes of the database's tables and logs."""
        total = 0
        for name in os.listdir(self.path):
            if name.endswith((".sst", ".log")):
                with contextlib.suppress(FileNotFoundError):  # removed by a background job meanwhile
                    total += os.path.getsize(os.path.join(self.path, name))
        return total

    def close(self) -> None:
        """Close every handle (rocksdict keeps the database and its lock while any family object
        lives), even when an earlier one fails.

        Raises:
            StorageError: the first failure, after everything was released.
        """
        first: StorageError | None = None
        for what in (getattr(self, "_blocks", None), getattr(self, "_db", None)):
            if what is None:
                continue
            try:
                with storage_errors("close"):
                    what.close()
            except StorageError as e:
                first = first or e
        if hasattr(self, "_cf"):
            del self._cf  # a live family handle keeps the database (and its lock) open too
        if first is not None:
            raise first

    def _check_format(self) -> None:
        """Check the layout version (a marker written at creation); a foreign one is dropped."""
        found = self._db.get(_FORMAT_KEY)
        if found == _FORMAT:
            return
        self.fresh = found is None
        if found is not None:
            log.warning("kvtier disk tier: %s holds layout %r, not %r: dropping its records", self.path, found, _FORMAT)
            self.commit([], list(self._blocks.keys()))
        self._db.put(_FORMAT_KEY, _FORMAT, self._write_opts)


def _drop_old_layout(path: str) -> None:
    """Remove a database of the former layout (whole records in RocksDB directly in ``path``)."""
    if os.path.exists(os.path.join(path, "CURRENT")):
        log.warning("kvtier disk tier: %s holds records of the former RocksDB-records layout: dropping them", path)
        Rdict.destroy(path, Options(raw_mode=True))
