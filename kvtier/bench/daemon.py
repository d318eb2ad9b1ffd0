"""`kvtier serve` as a subprocess for the benchmark suites that measure through a real daemon."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import kvtier
import kvtier_protocol
from kvtier.bench.report import progress

_TCP = re.compile(r"listening tcp:(?P<host>[^\s:]+):(?P<port>\d+)")
_READY = "kvtierd ready"


def child_env() -> dict[str, str]:
    """The environment of a process a bench starts (the daemon, workers, writers): it imports the
    same kvtier and kvtier_protocol as this process, installed or not, and none of the caller's
    KVTIER_* settings (the bench fixes every one it needs)."""
    roots = [str(Path(m.__file__).resolve().parents[1]) for m in (kvtier, kvtier_protocol)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    env["PYTHONPATH"] = os.pathsep.join([*roots, os.environ.get("PYTHONPATH", "")])
    return env


class BenchDaemon:
    """``kvtier serve`` with its data dir, socket and log (``daemon.log``) in ``work``.

    Args:
        work: a private directory for this daemon.
        flags: extra ``kvtier serve`` flags (tier sizes, ``--listen``, ``--rest`` ...).
        suite: the suite's name, for progress lines.
        profile: run the daemon under cProfile, writing its stats here at exit.
    """

    def __init__(self, work: Path, flags: Sequence[str], *, suite: str, profile: str | None = None) -> None:
        self.work = work
        self.flags = list(flags)
        self.suite = suite
        self.profile = profile
        self.socket = str(work / "kvtier.sock")
        self.address = f"unix:{self.socket}"
        self.tcp = ""  # "tcp://HOST:PORT" once started, when --listen was given
        self.log_path = work / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._cpu_tasks: dict[str, int] = {}  # thread id -> its CPU ns at the last reading
        self._cpu_ended = 0  # CPU ns of the threads gone since, as last read

    def start(self, timeout_s: float = 60.0) -> None:
        """Start it and wait for its ready line; RuntimeError with its log if it exits or stalls."""
        prefix = [sys.executable]
        if self.profile:
            prefix += ["-m", "cProfile", "-o", str(Path(self.profile).resolve())]
        cmd = [*prefix, "-m", "kvtier", "serve", "--data-dir", str(self.work), "--socket", self.socket,
               "--log-level", "info", *self.flags]
        env = child_env()
        progress(f"{self.suite}: starting the daemon in {self.work}: {' '.join(self.flags)}")
        with open(self.log_path, "wb") as log:
            self._cpu_tasks, self._cpu_ended = {}, 0  # readings of this process start over
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if _READY in text:
                m = _TCP.search(text)
                self.tcp = f"tcp://{m['host']}:{m['port']}" if m else ""
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log_tail()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the daemon was not ready within {timeout_s:.0f} s:\n{self.log_tail()}")

    @contextmanager
    def running(self) -> Iterator[BenchDaemon]:
        """Start it for the ``with`` block. A failure inside is reported with the tail of the
        daemon's log; the daemon is stopped and ``work`` removed however the block ends."""
        try:
            self.start()
            yield self
        except Exception:
            progress(f"{self.suite}: failed; the daemon's log ends with:\n{self.log_tail()}")
            raise
        finally:
            self.stop()
            shutil.rmtree(self.work, ignore_errors=True)

    def token(self) -> str:
        """The token the daemon generated into its data dir (needed over TCP)."""
        return (self.work / "token").read_text().strip()

    def cpu_seconds(self) -> float | None:
        """CPU time the daemon's threads have run so far (Linux ``/proc/PID/task/*/schedstat``,
        nanosecond resolution); None where it cannot be read.

        Never less than an earlier reading: a thread that ended (the daemon's start-up prefault,
        a pool's idle worker) keeps counting with the time it had at the last reading that saw
        it. What it ran after that reading is missed, so a window in which a thread ends can
        read a little low, never negative.
        """
        if self.proc is None:
            return None
        pid = self.proc.pid
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return None
        seen: dict[str, int] = {}
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    seen[tid] = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                continue  # a thread that ended meanwhile: counted as gone below
        for tid, ns in self._cpu_tasks.items():
            if seen.get(tid, -1) < ns:  # gone, or its id reused by a newer thread
                self._cpu_ended += ns
        self._cpu_tasks = seen
        return (self._cpu_ended + sum(seen.values())) / 1e9

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM and wait (it drains, unlinks its shared memory and, under cProfile, writes its
        stats); SIGKILL if stuck. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            progress(f"{self.suite}: the daemon did not stop within 30 s; killing it")
            proc.kill()
            proc.wait(10)
