"""Direct I/O of one block file: page-aligned buffers, O_DIRECT writes and reads, a buffered fallback.

A block file is the block's record, laid out so that its payload starts on a page::

    0           header_len        align(header_len)               + payload_len      align(...)
    | header    | zero pad        | payload                         | zero pad         |

so any holder decodes it from the file alone (the header's preamble gives its length and the
payload's), and the payload can move between the device and a page-aligned host slot by DMA.

O_DIRECT needs the buffer address, the file offset and the length to be multiples of the logical
block size; :data:`ALIGN` (4096, the page) covers every common device. A payload is moved in
place for its aligned body; the header and the last partial page of the payload go through small
aligned bounce pages. A payload that is not page-aligned in memory (``bytes``) is first copied
into an aligned buffer of the :class:`BufferPool`. ``os.pwritev`` / ``os.preadv`` release the GIL.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
import weakref

log = logging.getLogger(__name__)

ALIGN = max(4096, mmap.PAGESIZE)
_MMAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def file_bytes(header_len: int, payload_len: int) -> int:
    """Bytes of the block file of a record (both parts padded to :data:`ALIGN`)."""
    return align_up(header_len) + align_up(payload_len)


def copy_into(dest: memoryview, src: memoryview) -> None:
    """``dest[:] = src`` without holding the GIL (ctypes calls release it), so that the writer
    thread runs while a snapshot is copied. Read-only or non-contiguous sources copy in Python."""
    if dest.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dest.nbytes}")
    if src.readonly or not src.c_contiguous or not dest.c_contiguous or src.nbytes == 0:
        dest[:] = src
        return
    ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(dest)), ctypes.addressof(ctypes.c_char.from_buffer(src)),
                   src.nbytes)


def is_aligned(buf: memoryview) -> bool:
    """Whether a contiguous view starts on an :data:`ALIGN` boundary (False for read-only ones:
    ctypes cannot take their address, and they are copied anyway)."""
    if buf.readonly or not buf.c_contiguous or buf.nbytes == 0:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(buf)) % ALIGN == 0


class BufferPool:
    """Page-aligned buffers (anonymous mappings) for snapshots and bounce pages, reused.

    ``get`` hands out a view of exactly the bytes asked for, over a mapping of at least
    ``align_up(nbytes)`` bytes; ``give_back`` returns it for reuse. Up to ``keep_bytes`` of
    returned mappings are kept; a view that is never given back is freed with its last reference.
    """

    def __init__(self, keep_bytes: int = 64 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        self._idle: set[int] = set()  # id() of each mapping in _free: a second give_back is a no-op in O(1)
        self._kept = 0
        self._lock = threading.Lock()
        self._mine: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # never adopt a caller's mapping

    def get(self, nbytes: int) -> memoryview:
        """A writable, page-aligned view of ``nbytes`` bytes (old contents: zero or stale)."""
        size = align_up(max(1, nbytes))
        with self._lock:
            stack = self._free.get(size)
            if stack:
                self._kept -= size
                mm = stack.pop()
                self._idle.discard(id(mm))
                return memoryview(mm)[:nbytes]
        # MAP_POPULATE: fault the pages in at once, not one fault per page as they are copied into.
        mm = mmap.mmap(-1, size, flags=_MMAP_FLAGS)
        with self._lock:
            self._mine.add(mm)
        return memoryview(mm)[:nbytes]

    def give_back(self, view: memoryview) -> None:
        """Return a view from :meth:`get` (other objects are ignored). The caller drops it."""
        mm = view.obj if isinstance(view, memoryview) else None
        if not isinstance(mm, mmap.mmap):
            return
        size = len(mm)
        with self._lock:
            if mm not in self._mine or id(mm) in self._idle:
                return
            if self._kept + size <= self.keep_bytes:
                self._free.setdefault(size, []).append(mm)
                self._idle.add(id(mm))
                self._kept += size


class DirectFiles:
    """Opens block files with O_DIRECT, or buffered where the file system refuses it (logged once).
    New files are 0600 (the umask may only remove bits): a block file holds a user's KV cache."""

    def __init__(self, sync: bool, direct: bool = True) -> None:
        self.sync = sync
        self.direct = direct and hasattr(os, "O_DIRECT")

    def open(self, path: str, flags: int) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False
                log.warning("kvtier disk tier: %s refuses O_DIRECT; using buffered I/O", os.path.dirname(path))
        return os.open(path, flags, 0o600)

    def write(self, path: str, header: bytes, payload: bytes | bytearray | memoryview, pool: BufferPool,
              *, create: bool = True) -> None:
        """Write the record into ``path``: a new file (``create``), or over a free file of exactly
        its size (no allocation: measured 3-4x faster than creating one). fdatasync with ``sync``.

        Raises:
            OSError: the file system failed (ENOSPC, EIO); a partial file may be left.
        """
        body = memoryview(payload).cast("B")
        copy = None
        if not is_aligned(body):
            copy = pool.get(len(body))
            copy[:] = body
            body = copy
        n = len(body)
        cut = n - n % ALIGN
        head = pool.get(align_up(len(header)))
        head[:len(header)] = header
        head[len(header):] = bytes(len(head) - len(header))
        iov = [head, body[:cut]] if cut else [head]
        tail = None
        if cut < n:
            tail = pool.get(ALIGN)
            tail[:n - cut] = body[cut:]
            tail[n - cut:] = bytes(ALIGN - (n - cut))
            iov.append(tail)
        total = sum(len(v) for v in iov)
        try:
            fd = self.open(path, os.O_WRONLY | (os.O_CREAT | os.O_EXCL if create else 0))
            try:
                done = os.pwritev(fd, iov, 0)
                if done != total:
                    raise OSError(errno.ENOSPC, f"short write of {path}: {done} of {total} bytes")
                if self.sync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
        finally:
            for v in (head, tail, copy):
                if v is not None:
                    pool.give_back(v)

    def read_into(self, path: str, header_len: int, dest: memoryview, pool: BufferPool) -> bytes:
        """Read a block file: the payload into ``dest`` (its exact length), the header returned.

        Raises:
            FileNotFoundError: no such file.
            OSError: the file is shorter than its record (EIO) or cannot be read.
        """
        dest = dest.cast("B") if dest.format != "B" else dest
        n = len(dest)
        body = dest if is_aligned(dest) else pool.get(n)
        cut = n - n % ALIGN
        head = pool.get(align_up(header_len))
        iov = [head, body[:cut]] if cut else [head]
        tail = pool.get(ALIGN) if cut < n else None
        if tail is not None:
            iov.append(tail)
        total = sum(len(v) for v in iov)
        try:
            fd = self.open(path, os.O_RDONLY)
            try:
                got = os.preadv(fd, iov, 0)
            finally:
                os.close(fd)
            if got != total:
                raise OSError(errno.EIO, f"{path} holds {got} of the record's {total} bytes")
            if tail is not None:
                body[cut:] = tail[:n - cut]
            if body is not dest:
                dest[:] = body
            return bytes(head[:header_len])
        finally:
            for v in (head, tail, None if body is dest else body):
                if v is not None:
                    pool.give_back(v)
