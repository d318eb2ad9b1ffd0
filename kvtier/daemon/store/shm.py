"""Named POSIX shared-memory segments: create, map (from any process), pre-fault, unlink. Stdlib only.

The host tier's memory lives in files under ``/dev/shm`` (what ``shm_open`` uses on Linux),
created with ``O_CREAT | O_EXCL`` and mode 0600. We do not use ``multiprocessing.shared_memory``:
its resource tracker unlinks segments behind the owner's back and warns at exit.

A client (an engine's connector) maps a segment either by name or, preferably, through a file
descriptor the daemon sends over the unix socket (SCM_RIGHTS), then reads and writes slots in it::

    fds = socket.recv_fds(sock, 1024, maxfds=8)[1]       # or: name from the daemon
    mm = map_segment(fds[0], size)                         # any process, same host
    memoryview(mm)[slot.offset : slot.offset + slot.length]

This module must stay importable by clients: no torch, no daemon dependencies.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import secrets
import threading

from kvtier_protocol.errors import InvalidRequest, StorageError

SHM_DIR = "/dev/shm"
PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not exported by Python's mmap module
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")
_CHUNK = 64 << 20  # pre-fault granularity: how often a stop request is noticed


_RANDOM_BYTES = 6  # of a segment name, after the pid (hex: twice as many characters)


def unique_name(prefix: str) -> str:
    """A fresh segment name: ``prefix-pid-random`` (random so a restarted daemon never collides)."""
    return check_name(f"{prefix}-{os.getpid()}-{secrets.token_hex(_RANDOM_BYTES)}")


def reclaim_stale(prefix: str, gone: frozenset[int] = frozenset(),
                  keep: frozenset[str] = frozenset()) -> list[tuple[str, int]]:
    """Unlink the segments named ``prefix-PID-…`` (:func:`unique_name`) whose process is gone.

    A daemon killed with SIGKILL (the OOM killer, say) cannot unlink its segments, and /dev/shm is
    memory: gigabytes stay taken until the files go, and a restart allocates as much again. A
    segment whose pid is alive is left alone, whoever that pid now is. A pid is gone when it is in
    ``gone`` (known dead: the caller took the owner lock that process held, see
    :mod:`kvtier.daemon.store.owner`), or no process has it, or its process is a zombie (dead, not
    yet reaped: ``kill(pid, 0)`` still succeeds on it). Unlinking is also harmless
    if a pid were misjudged (another PID namespace sharing /dev/shm): the segments are handed out
    as descriptors, and the mappings and descriptors already held stay valid.

    Returns:
        ``(name, bytes)`` of each segment removed.
    """
    # unique_name's, and the journal (and its rewrite's temp file) named after a segment
    pattern = re.compile(re.escape(prefix) + rf"-(\d+)-[0-9a-f]{{{2 * _RANDOM_BYTES}}}(\.journal(\.tmp)?)?")
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        m = pattern.fullmatch(name)
        if m is None or name in keep or (int(m.group(1)) not in gone and _alive(int(m.group(1)))):
            continue
        path = os.path.join(SHM_DIR, name)
        try:
            size = os.stat(path).st_blocks * 512  # what it holds, not its nominal size
            os.unlink(path)
        except OSError:  # gone already, or not ours to remove
            continue
        removed.append((name, size))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # not a pid this module wrote: leave it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has exited and waits to be reaped (state Z in /proc; False where unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")".
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"Z", b"X")


def check_name(name: str) -> str:
    """Return ``name`` if it is a plain segment name (no path separators), else raise InvalidRequest."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (".", ".."):
        raise InvalidRequest(f"bad shared-memory segment name {name!r}")
    return name


def segment_path(name: str) -> str:
    """The file that backs segment ``name``."""
    return os.path.join(SHM_DIR, check_name(name))


def create_segment(name: str, size: int) -> int:
    """Create segment ``name`` of ``size`` bytes (mode 0600, must not exist); returns its fd.

    Raises:
        StorageError: the segment exists already, or /dev/shm refused it.
    """
    path = segment_path(name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StorageError(f"cannot create shared-memory segment {path}: {e}") from e
    try:
        os.fchmod(fd, 0o600)  # the umask may only remove bits, but be explicit about the mode
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        unlink_segment(name)
        raise StorageError(f"cannot size shared-memory segment {path} to {size} bytes: {e}") from e
    return fd


def create_file(name: str) -> int:
    """Create or truncate the small file ``name`` in /dev/shm (mode 0600); returns its fd.

    Raises:
        OSError: /dev/shm refused it.
    """
    fd = os.open(segment_path(name), os.O_CREAT | os.O_TRUNC | os.O_RDWR | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def rename_segment(old: str, new: str) -> None:
    """Rename a segment's file (atomic on tmpfs); descriptors and mappings stay valid.

    Raises:
        OSError: ``old`` is missing.
    """
    os.rename(segment_path(old), segment_path(new))


def open_segment(name: str) -> tuple[int, int]:
    """Open an existing segment read-write: ``(fd, size)``.

    Raises:
        OSError: it does not exist or cannot be opened.
    """
    fd = os.open(segment_path(name), os.O_RDWR | os.O_CLOEXEC)
    try:
        return fd, os.fstat(fd).st_size
    except OSError:
        os.close(fd)
        raise


def unlink_segment(name: str) -> None:
    """Remove segment ``name``'s file; mappings and open descriptors stay valid. Missing is fine."""
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass


def map_segment(name_or_fd: str | int, size: int, *, writable: bool = True) -> mmap.mmap:
    """Map a segment, by name or by a file descriptor (e.g. received over SCM_RIGHTS).

    An fd passed in stays owned by the caller (the mapping keeps its own reference), so it may be
    closed right after.

    Raises:
        InvalidRequest: a bad name or size.
        StorageError: the segment does not exist, is smaller than ``size``, or cannot be mapped.
    """
    if size <= 0:
        raise InvalidRequest(f"segment size must be positive, got {size}")
    own_fd = isinstance(name_or_fd, str)
    try:
        fd = os.open(segment_path(name_or_fd), os.O_RDWR if writable else os.O_RDONLY) if own_fd else name_or_fd
    except OSError as e:
        raise StorageError(f"cannot open shared-memory segment {name_or_fd!r}: {e}") from e
    try:
        if os.fstat(fd).st_size < size:
            raise StorageError(f"segment {name_or_fd!r} is smaller than {size} bytes")
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    except (OSError, ValueError) as e:
        raise StorageError(f"cannot map segment {name_or_fd!r}: {e}") from e
    finally:
        if own_fd:
            os.close(fd)


def address_of(mm: mmap.mmap) -> tuple[int, ctypes.Array]:
    """The base address of a writable mapping, and the ctypes object that holds it.

    The returned object keeps a buffer export on ``mm`` (so the mapping cannot be closed under a
    user of the address); drop it before ``mm.close()``.
    """
    anchor = (ctypes.c_char * len(mm)).from_buffer(mm)
    return ctypes.addressof(anchor), anchor


def populate(fd: int, address: int, size: int, stop: threading.Event | None = None) -> None:
    """Pre-fault ``size`` bytes of a shared mapping at ``address`` (backed by ``fd``) without
    changing its contents, so first writes do not pay page faults. Releases the GIL while it works.

    Steps: ``posix_fallocate`` reserves the pages in /dev/shm (a full /dev/shm shows up here as
    ENOSPC instead of a SIGBUS on first write), then ``madvise(MADV_POPULATE_WRITE)`` maps them
    into this process's page tables; on kernels without it, each page is read once.

    Raises:
        StorageError: /dev/shm cannot hold the segment.
    """
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise StorageError(f"cannot reserve {size} bytes of shared memory: {e}") from e
    populate_write = True
    for start in range(0, size, _CHUNK):
        if stop is not None and stop.is_set():
            return
        length = min(_CHUNK, size - start)
        if populate_write:
            err = _madvise(address + start, length, MADV_POPULATE_WRITE)
            if err == errno.EINVAL:
                populate_write = False  # an older kernel: fall back to touching pages
            elif err:
                raise StorageError(f"cannot pre-fault shared memory: {os.strerror(err)}")
        if not populate_write:
            # Read (never write: a client may be writing this range already) one byte per page.
            view = (ctypes.c_char * length).from_address(address + start)
            for off in range(0, length, PAGE):
                view[off]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _madvise(address: int, length: int, advice: int) -> int:
    """madvise() through ctypes, which drops the GIL for the call (mmap.madvise keeps it). Returns errno or 0."""
    return 0 if _libc.madvise(address, length, advice) == 0 else ctypes.get_errno()
