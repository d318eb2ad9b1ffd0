"""Who owns a tier's directory: private modes for what the daemon creates, and an owner lock.

Private modes: every directory the daemon makes is 0700 and every file 0600, whatever the umask
(an ``open``/``mkdir`` mode is filtered by the umask, which may only remove bits, so a mode of
0600/0700 is never exceeded; :func:`private_dir` chmods what it made and tightens a directory we
own that exists already). Block files hold users' KV caches: prompts can be recovered from them.

The owner lock: a ``flock`` on ``<dir>/owner.lock``, held for the life of the process that opened
the directory. The kernel releases it when that process exits, however it exits (SIGKILL, OOM
killer), before the process is even reaped, so it answers "is the previous owner alive?" exactly
where ``kill(pid, 0)`` does not (it succeeds on a zombie). The file records the holder's pid, so:

* a second process on the same directory is refused with one line naming the holder (its pid, and
  its listening unix socket where /proc tells it), instead of RocksDB's raw "LOCK: Resource
  temporarily unavailable";
* the pid recorded by the previous holder, whose lock is free now, is a process that is gone:
  its shared-memory segments can be removed at once (:func:`kvtier.daemon.store.shm.reclaim_stale`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time

from kvtier_protocol.errors import StorageError

DIR_MODE = 0o700
FILE_MODE = 0o600
LOCK_NAME = "owner.lock"
DYING_WAIT_S = 5.0  # how long a lock held by an exited process (its last threads closing files) is waited for


class DirectoryBusy(StorageError):
    """Another live process holds the directory's owner lock."""


def private_dir(path: str | os.PathLike[str]) -> str:
    """Create ``path`` and its missing parents with mode 0700 (whatever the umask); a directory
    that exists and that this user owns is tightened to 0700. Returns the path.

    Raises:
        OSError: a directory cannot be made (permissions, a file in the way).
    """
    path = os.path.abspath(os.fspath(path))
    missing = []
    p = path
    while not os.path.isdir(p):
        missing.append(p)
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    for d in reversed(missing):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another thread or process
            os.mkdir(d, DIR_MODE)
        os.chmod(d, DIR_MODE)  # the umask may have removed bits of the owner's own
    tighten(path)
    return path


def tighten(path: str, mode: int = DIR_MODE) -> None:
    """chmod ``path`` to ``mode`` if this user owns it and it allows other bits. Left alone: what
    another user owns, a sticky directory (shared by design: /tmp), and ``/`` or a directory right
    under it (a daemon run as root owns /var and /tmp: a data dir set to one must not close it)."""
    st = os.stat(path)
    if st.st_uid != os.geteuid() or st.st_mode & 0o777 == mode or st.st_mode & stat.S_ISVTX:
        return
    if os.path.dirname(os.path.abspath(path)) in ("/", os.path.abspath(path)):
        return
    os.chmod(path, mode)


def private_umask() -> None:
    """Add 0077 to the process's umask (keeping what it removes already), so that the files other
    code creates later (RocksDB's tables and logs) are private too. For a daemon's start-up."""
    current = _read_umask()
    os.umask((current if current is not None else 0) | 0o077)


def _read_umask() -> int | None:
    """The umask without changing it (Linux >= 4.7 shows it in /proc/self/status)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return None


class OwnerLock:
    """The owner lock of a directory (see the module docstring). Release it with :meth:`release`
    (or let the process exit).

    Attributes:
        path: the lock file.
        previous_pid: the pid the last holder recorded (None: none, or it released the lock
            cleanly); that process is gone, since its lock was free.
    """

    def __init__(self, path: str, fd: int, previous_pid: int | None) -> None:
        self.path = path
        self._fd: int | None = fd
        self.previous_pid = previous_pid

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> OwnerLock:
        """Take the lock of ``directory`` (made private if missing) and record this process's pid.

        Raises:
            DirectoryBusy: a live process holds it (the message names its pid).
            StorageError: the lock file cannot be made.
        """
        directory = os.fspath(directory)
        path = os.path.join(directory, LOCK_NAME)
        try:
            private_dir(directory)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        except OSError as e:
            raise StorageError(f"cannot open the owner lock {path}: {e}") from e
        try:
            tighten(path, FILE_MODE)
            if not _lock(fd, _recorded_pid(fd)):
                raise DirectoryBusy(f"{directory} is in use by another process, {_describe(_recorded_pid(fd))}: "
                                    "stop it first, or give this one another directory")
            previous = _recorded_pid(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as e:
            os.close(fd)
            raise StorageError(f"cannot take the owner lock {path}: {e}") from e
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, previous if previous != os.getpid() else None)

    def release(self) -> None:
        """Forget this process's pid and drop the lock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):  # a pid left behind only costs a check at the next open
                os.ftruncate(fd, 0)
        finally:
            os.close(fd)  # releases the flock

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self) -> None:
        # Dropped unreleased (an owner that was never closed): let go as an exiting process would,
        # keeping the recorded pid.
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _lock(fd: int, holder: int | None) -> bool:
    """Take the flock; False if a live process holds it. A holder that is dying (a zombie whose
    other threads still exit, and close its files last) is waited for, a few seconds at most."""
    deadline = time.monotonic() + DYING_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if holder is None or not _dying(holder) or time.monotonic() > deadline:
                return False
        time.sleep(0.01)  # the kernel offers no wait on another process's exit but this lock's own


def _dying(pid: int) -> bool:
    """Whether ``pid`` has exited (state Z or X) or is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return data[data.rfind(b")") + 2:data.rfind(b")") + 3] in (b"Z", b"X")


def _recorded_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        return int(text) if text.isdigit() and int(text) > 0 else None
    except (OSError, ValueError):
        return None


def _describe(pid: int | None) -> str:
    """``kvtierd pid 1234 (socket /run/kvtier/kvtier.sock)``, as much of it as is known."""
    if pid is None:
        return "another process (pid not recorded yet)"
    sockets = listening_unix_sockets(pid)
    return f"pid {pid}" + (f" (socket {', '.join(sockets)})" if sockets else "")


def listening_unix_sockets(pid: int) -> list[str]:
    """Paths of the unix sockets ``pid`` listens on, from /proc (empty where /proc does not tell:
    another user's process, another system)."""
    try:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        paths = []
        with open(f"/proc/{pid}/net/unix", encoding="utf-8", errors="replace") as f:
            next(f, None)  # the column names
            for line in f:
                cols = line.split()
                # Num RefCount Protocol Flags Type St Inode Path; flag 0x10000: listening
                if len(cols) >= 8 and cols[6] in inodes and int(cols[3], 16) & 0x10000 and cols[7][0] != "@":
                    paths.append(_now_named(cols[7]))
        return sorted({p for p in paths if p is not None})
    except (OSError, ValueError):
        return []


def _now_named(bound: str) -> str | None:
    """The path a socket bound at ``bound`` has now: the daemon binds under a temporary name and
    links it to its real one (then unlinks the first), and /proc shows the name it was bound at.
    Then the only socket in that directory is it (None when there are several: unknown)."""
    try:
        if stat.S_ISSOCK(os.stat(bound).st_mode):
            return bound
    except OSError:
        pass
    directory = os.path.dirname(bound)
    try:
        found = [os.path.join(directory, n) for n in os.listdir(directory)
                 if stat.S_ISSOCK(os.lstat(os.path.join(directory, n)).st_mode)]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None
