"""The block files of a disk tier: file ids, shard directories, direct I/O, and free files reused.

A block file is named by its id (16 hex digits) in the shard directory ``id & 0xff`` under the
data directory. A file whose record was deleted (its meta deletion committed) is not unlinked but
kept as a *free file* and written over by a later record of the same padded size: creating a file
and allocating its blocks costs ~1 ms per file on ext4 (measured 0.2 GB/s for 256 KiB blocks),
writing over an allocated one ~0.25 ms (1 GB/s), and unlink costs 2-8 ms of journal work. A cache
at capacity deletes what it writes, so in the steady state no file is created or unlinked.

Free files beyond ``keep_free_bytes`` are unlinked on a thread of their own, off the caller.
The map from keys to file ids is the disk tier's (:mod:`kvtier.daemon.store.disk`): a file that no meta
entry names is free, which is exactly what :meth:`BlockFiles.reclaim` rebuilds at open.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xxhash

from kvtier.daemon.store.disk_io import ALIGN, BufferPool, DirectFiles
from kvtier.daemon.store.owner import FILE_MODE, private_dir

log = logging.getLogger(__name__)
SHARDS = 256  # directories: keeps each small at millions of blocks
Payload = bytes | bytearray | memoryview
_HEX = frozenset("0123456789abcdef")
FREE_LIST = "free-ids"  # beside the data directory (which holds shards only): the free files at the last clean close
_FREE_MAGIC = b"KVTFREE1"


class BlockFiles:
    """Creates, reuses, reads and removes the block files under ``root``.

    Args:
        root: the data directory (created with its shards if missing).
        pool: aligned buffers for copies and bounce pages.
        keep_free_bytes: bytes of free files kept for reuse; more are unlinked (the owner may
            change it: it is read at each release).
        sync: fdatasync each file as it is written (and :meth:`sync_dirs` is then called).
        direct: use O_DIRECT (else, or where the file system refuses it, buffered I/O).
    """

    def __init__(self, root: str, pool: BufferPool, *, keep_free_bytes: int, sync: bool, direct: bool) -> None:
        self.root = root
        self.pool = pool
        self.keep_free_bytes = keep_free_bytes
        self.io = DirectFiles(sync, direct)
        self.next_id = 1
        self._free: dict[int, OrderedDict[int, None]] = {}  # file bytes -> free ids, oldest first
        self._age: OrderedDict[int, int] = OrderedDict()  # every free id -> its bytes, oldest first
        self.free_bytes = 0
        self._lock = threading.Lock()  # the free lists (callers come from several I/O threads)
        private_dir(root)
        for d in self._dirs():
            private_dir(d)
        self._reaper = ThreadPoolExecutor(1, thread_name_prefix="kvtier-unlink")
        # Writes files while the caller copies and hashes the next payload (write_many).
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kvtier-disk-write")

    def path(self, fid: int) -> str:
        return os.path.join(self.root, f"{fid & (SHARDS - 1):02x}", f"{fid:016x}")

    def reclaim(self, live: set[int]) -> None:
        """Make every file whose id is not in ``live`` free (data without meta: a crash between a
        file's write and its meta commit, or a deleted record's file); ids continue above all."""
        top = max(live, default=0)
        for d in self._dirs():
            for name in os.listdir(d):
                fid = int(name, 16) if len(name) == 16 and _HEX.issuperset(name) else None
                if fid is not None and self.path(fid) == os.path.join(d, name):
                    top = max(top, fid)
                    if fid in live:
                        continue
                    size = os.stat(os.path.join(d, name)).st_size
                    if size and size % ALIGN == 0:
                        self.release([(fid, size)])
                        continue
                os.unlink(os.path.join(d, name))  # not a block file (here), or a partial one of a crash
        self.next_id = top + 1
        self._trim()

    def scan(self) -> dict[int, int]:
        """``{id: bytes}`` of every file named as a block file in its shard (free ones included)."""
        out: dict[int, int] = {}
        for d in self._dirs():
            for name in os.listdir(d):
                fid = int(name, 16) if len(name) == 16 and _HEX.issuperset(name) else None
                if fid is not None and self.path(fid) == os.path.join(d, name):
                    with contextlib.suppress(FileNotFoundError):
                        out[fid] = os.stat(os.path.join(d, name)).st_size
        return out

    def read_head(self, fid: int, nbytes: int) -> bytes:
        """Up to ``nbytes`` from the start of file ``fid`` (buffered: a one-off read of a header).

        Raises:
            OSError: the file cannot be read.
        """
        fd = os.open(self.path(fid), os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, nbytes, 0)
        finally:
            os.close(fd)

    def free_ids(self) -> set[int]:
        """The ids of the free files now."""
        with self._lock:
            return set(self._age)

    def save_free_list(self) -> None:
        """Record the free files' ids (at a clean close, after :meth:`close`): the next open then
        knows that every other file is a record's, and a file that its metadata does not list is
        a sign of damaged metadata (see ``DiskTier``), not a free file."""
        ids = sorted(self.free_ids())
        body = _FREE_MAGIC + len(ids).to_bytes(8, "little") + b"".join(i.to_bytes(8, "little") for i in ids)
        body += xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")
        path = os.path.join(os.path.dirname(self.root), FREE_LIST)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def take_free_list(self) -> set[int] | None:
        """The ids :meth:`save_free_list` recorded, and remove the record (it describes only the
        close it was written at: after a crash there is none). None: no valid record."""
        path = os.path.join(os.path.dirname(self.root), FREE_LIST)
        try:
            with open(path, "rb") as f:
                body = f.read()
        except FileNotFoundError:
            return None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        n = int.from_bytes(body[8:16], "little") if len(body) >= 16 else -1
        if (not body.startswith(_FREE_MAGIC) or len(body) != 24 + 8 * n
                or xxhash.xxh3_64_intdigest(body[:-8]) != int.from_bytes(body[-8:], "little")):
            log.warning("kvtier disk tier: %s is damaged: ignored", path)
            return None
        return {int.from_bytes(body[16 + 8 * i:24 + 8 * i], "little") for i in range(n)}

    def write(self, header: bytes, payload: Payload, nbytes: int) -> int:
        """Write a record whose file takes ``nbytes``, over a free file of that size if there is
        one; returns the file's id. The caller serialises writes.

        Raises:
            OSError: the write failed; the file is free again (or removed, if it was new).
        """
        with self._lock:
            fid = self._take(nbytes)
        reused = fid is not None
        if fid is None:
            fid = self.next_id
            self.next_id += 1
        try:
            self.io.write(self.path(fid), header, payload, self.pool, create=not reused)
        except FileNotFoundError:
            raise  # a free file removed behind our back: gone, forget it
        except BaseException:
            if reused:
                self.release([(fid, nbytes)])  # still allocated, whatever it holds now: free again
            else:
                self._reaper.submit(_unlink_all, [self.path(fid)])  # a partial new file
            raise
        return fid

    def write_many(self, files: list[tuple[bytes, int]], payload_of: Callable[[int], Payload | None],
                   release: Callable[[memoryview], None] | None, written: list[tuple[int, int]]) -> None:
        """Write ``(header, file bytes)`` files in order, the payload of file i from
        ``payload_of(i)`` (None: skip it), appending ``(i, file id)`` to ``written``.

        With ``release`` (given each payload once written), each write runs on the writer thread
        (``pwritev`` releases the GIL) while the caller's thread makes the next payload (a copy
        and a hash); one write is in flight at a time, and none is left running on return.

        Raises:
            OSError: a write failed; the files in ``written`` are the caller's to release.
        """
        if release is None:
            for i, (header, nbytes) in enumerate(files):
                payload = payload_of(i)
                if payload is not None:
                    written.append((i, self.write(header, payload, nbytes)))
            return
        give_back = release
        inflight: tuple[int, Future[int], memoryview] | None = None

        def settle() -> None:
            """Wait for the write in flight, cleared first: a failed one is not waited for twice."""
            nonlocal inflight
            assert inflight is not None, "called with a write in flight"
            j, job, done = inflight
            inflight = None
            try:
                written.append((j, job.result()))
            finally:
                give_back(done)

        try:
            for i, (header, nbytes) in enumerate(files):
                payload = payload_of(i)  # while the previous write runs
                if inflight is not None:
                    settle()
                if payload is not None:
                    assert isinstance(payload, memoryview), "released payloads are pool views"
                    inflight = (i, self._writer.submit(self.write, header, payload, nbytes), payload)
            if inflight is not None:
                settle()
        except BaseException:
            if inflight is not None:  # a write must not outlive the call: wait for it, keep its file
                j, job, done = inflight
                with contextlib.suppress(Exception):
                    written.append((j, job.result()))
                release(done)
            raise

    def read_into(self, fid: int, header_len: int, dest: memoryview) -> bytes:
        """See :meth:`DirectFiles.read_into`."""
        return self.io.read_into(self.path(fid), header_len, dest, self.pool)

    def release(self, files: list[tuple[int, int]]) -> None:
        """Make ``(id, file bytes)`` free, once the meta deletion that dropped them is committed;
        then unlink the oldest free files beyond ``keep_free_bytes``."""
        with self._lock:
            for fid, size in files:
                self._free.setdefault(size, OrderedDict())[fid] = None
                self._age[fid] = size
                self.free_bytes += size
        self._trim()  # also when nothing was freed: ``keep_free_bytes`` may have shrunk

    def new_bytes(self, sizes: list[int]) -> int:
        """Bytes that writes of files of ``sizes`` would allocate (those no free file covers)."""
        with self._lock:
            have = {size: len(ids) for size, ids in self._free.items()}
        need = 0
        for size in sizes:
            if have.get(size, 0) > 0:
                have[size] -= 1
            else:
                need += size
        return need

    def shed(self, keep_sizes: set[int]) -> None:
        """Unlink every free file of a size not in ``keep_sizes``, and wait (the disk is short)."""
        doomed: list[str] = []
        with self._lock:
            for size in [s for s in self._free if s not in keep_sizes]:
                while (fid := self._take(size)) is not None:
                    doomed.append(self.path(fid))
        _unlink_all(doomed)
        self.drain()  # and the unlinks queued before

    def drain(self) -> None:
        """Wait until every unlink requested is done."""
        self._reaper.submit(lambda: None).result()

    def sync_dirs(self, fids: list[int]) -> None:
        """fsync the directories of ``fids``, so that their new entries survive a power loss."""
        for d in {os.path.dirname(self.path(f)) for f in fids}:
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def sync_all(self) -> None:
        """syncfs(2) of the file system: one call commits the metadata of every file written
        (their data went down with O_DIRECT); ``sync`` where syncfs is missing."""
        fd = os.open(self.root, os.O_RDONLY)
        try:
            if _syncfs is None or _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def listing(self) -> list[str]:
        """Paths of every file in the shard directories (free ones included)."""
        return [os.path.join(d, n) for d in self._dirs() for n in os.listdir(d)]

    def close(self) -> None:
        """Finish the pending unlinks. Free files stay: the next open finds them free again."""
        self._writer.shutdown(wait=True)
        self._reaper.shutdown(wait=True)

    def _trim(self, keep: int | None = None) -> None:
        """Unlink the oldest free files (on the reaper) beyond ``keep`` (default: the cap)."""
        keep = self.keep_free_bytes if keep is None else keep
        doomed: list[str] = []
        with self._lock:
            while self.free_bytes > keep:
                fid, size = next(iter(self._age.items()))  # the oldest free file, of any size
                self._take(size, fid)
                doomed.append(self.path(fid))
        if doomed:
            self._reaper.submit(_unlink_all, doomed)

    def _take(self, size: int, fid: int | None = None) -> int | None:
        """Remove a free file of ``size`` (the oldest, or ``fid``) from the free lists; None if none."""
        ids = self._free.get(size)
        if not ids:
            return None
        if fid is None:
            fid = next(iter(ids))
        del ids[fid]
        if not ids:
            del self._free[size]
        del self._age[fid]
        self.free_bytes -= size
        return fid

    def _dirs(self) -> list[str]:
        return [os.path.join(self.root, f"{s:02x}") for s in range(SHARDS)]


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
        except OSError as e:  # left behind: free again at the next open
            log.warning("kvtier disk tier: cannot remove %s: %s", p, e)


try:
    _syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    _syncfs.argtypes = (ctypes.c_int,)
except (OSError, AttributeError):
    _syncfs = None
