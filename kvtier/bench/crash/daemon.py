"""The daemon of `kvtier bench crash`: one ``kvtier serve`` per life, on one data directory, killed
at chosen moments, and watched through /proc for RocksDB's background work.

RocksDB names its background threads ``rocksdb:high`` (memtable flushes) and ``rocksdb:low``
(compactions of the metadata); a thread of either name that is running or in
uninterruptible I/O (state R or D in ``/proc/<pid>/task/<tid>/stat``) is doing that job now.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvtier.bench.daemon import BenchDaemon

COMPACTION_THREAD = "rocksdb:low"
FLUSH_THREAD = "rocksdb:high"
_REST = re.compile(r"kvtierd rest (http://\S+)")


class CrashDaemon:
    """``kvtier serve`` restarted again and again on ``work`` (data dir, socket, token).

    Args:
        work: the bench's directory; the daemon's data directory (RocksDB in ``work/disk``).
        prefix: the shared-memory name prefix (segments of a killed daemon are unlinked by it).
        disk_bytes: the disk tier's budget.
    """

    def __init__(self, work: Path, prefix: str, disk_bytes: int) -> None:
        self.work = work
        self.prefix = prefix
        self.disk_bytes = disk_bytes
        self.starts = 0
        self.rest = ""
        self._daemon: BenchDaemon | None = None

    @property
    def address(self) -> str:
        return f"unix:{self.work / 'kvtier.sock'}"

    @property
    def pid(self) -> int:
        assert self._daemon is not None and self._daemon.proc is not None, "the daemon runs"
        return self._daemon.proc.pid

    def token(self) -> str:
        return (self.work / "token").read_text().strip()

    def start(self, *, write_through: bool, host_bytes: int, watch: str | None = None,
              timeout_s: float = 60.0) -> bool:
        """Start a daemon life (write-through or write-back) and wait until it is ready.

        Args:
            watch: a thread name: SIGKILL the daemon the moment such a thread runs while it
                starts (RocksDB compacts at open when recovery left enough L0 files).

        Returns:
            True when ``watch`` caught the thread busy and the daemon was killed (it is not ready).

        Raises:
            RuntimeError: it exited or was not ready in time (with its log).
        """
        config = self.work / ("write-through.toml" if write_through else "write-back.toml")
        config.write_text(f'[store]\nwrite_through = {str(write_through).lower()}\nhost_prefault = false\n'
                          f'host_pin = false\nhost_name_prefix = "{self.prefix}"\n')
        flags = ["--config", str(config), "--host-bytes", str(host_bytes), "--disk-bytes", str(self.disk_bytes),
                 "--rest", "127.0.0.1:0"]
        daemon = BenchDaemon(self.work, flags, suite="crash")
        daemon.log_path = self.work / f"daemon-{self.starts:03d}.log"
        self.starts += 1
        self._daemon = daemon
        if watch is None:
            daemon.start(timeout_s)
        else:
            failed: list[BaseException] = []
            starter = threading.Thread(target=_start, args=(daemon, timeout_s, failed), name="crash-daemon-start")
            starter.start()
            caught = False
            while starter.is_alive() and not caught:
                proc = daemon.proc
                if proc is not None and watch in busy_threads(proc.pid):
                    os.kill(proc.pid, signal.SIGKILL)
                    caught = True
                time.sleep(0.0005)
            starter.join()
            if caught:
                self.reap()
                return True
            if failed:
                raise failed[0]
        found = _REST.search(daemon.log_path.read_text(errors="replace"))
        self.rest = found.group(1) if found else ""
        return False

    def log_tail(self) -> str:
        return self._daemon.log_tail() if self._daemon is not None else ""

    def alive(self) -> bool:
        return self._daemon is not None and self._daemon.proc is not None and self._daemon.proc.poll() is None

    def kill(self) -> bool:
        """SIGKILL now (if alive) and reap; True when a live daemon was killed."""
        was_alive = self.alive()
        if was_alive:
            os.kill(self.pid, signal.SIGKILL)
        self.reap()
        return was_alive

    def reap(self, timeout_s: float = 30.0) -> int | None:
        """Wait for the process to end; returns its exit status."""
        daemon, self._daemon = self._daemon, None
        if daemon is None or daemon.proc is None:
            return None
        # The shared memory a killed daemon leaves stays: the next life adopts it (the host tier
        # survives a crash) or removes it; cleanup() removes what the last life left.
        return daemon.proc.wait(timeout_s)

    def cleanup(self) -> None:
        """Remove the shared memory of every life (the end of a run; a live daemon is killed first)."""
        self.kill()
        for path in glob.glob(f"/dev/shm/{self.prefix}-*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def stop(self) -> None:
        """A clean stop (SIGTERM: drain, flush memory blocks, close RocksDB)."""
        if self._daemon is not None:
            self._daemon.stop()
            self.reap()

    def terminate_then_kill(self, delay_s: float) -> tuple[bool, float, set[str]]:
        """SIGTERM, then SIGKILL ``delay_s`` later unless it exited first.

        Returns:
            (killed, seconds from SIGTERM to the exit or the kill, RocksDB threads busy at the kill).
        """
        pid = self.pid
        proc = self._daemon.proc  # type: ignore[union-attr]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGTERM)
        while time.perf_counter() - t0 < delay_s:
            if proc.poll() is not None:
                elapsed = time.perf_counter() - t0
                self.reap()
                return False, elapsed, set()
            time.sleep(0.001)
        busy = busy_threads(pid)
        killed = self.kill()
        return killed, time.perf_counter() - t0, busy

    def kill_when_busy(self, thread: str, timeout_s: float, *, keep_going: Callable[[], bool] = lambda: True) -> bool:
        """Poll /proc and SIGKILL the moment a thread named ``thread`` is running, for up to
        ``timeout_s`` (or while ``keep_going()``); True when it was caught (the daemon is dead then)."""
        pid = self.pid
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and keep_going() and self.alive():
            if thread in busy_threads(pid):
                os.kill(pid, signal.SIGKILL)
                self.reap()
                return True
            time.sleep(0.0005)
        return False


def _start(daemon: BenchDaemon, timeout_s: float, failed: list[BaseException]) -> None:
    try:
        daemon.start(timeout_s)
    except RuntimeError as exc:
        failed.append(exc)


def busy_threads(pid: int) -> set[str]:
    """Names of the threads of ``pid`` that are running or waiting on I/O right now."""
    out = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "tid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ")".
        close = stat.rfind(b")")
        if close > 0 and stat[close + 2:close + 3] in (b"R", b"D"):
            out.add(stat[stat.find(b"(") + 1:close].decode(errors="replace"))
    return out
