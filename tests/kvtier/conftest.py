"""The ``kvtier_daemon`` fixture: a real ``python -m kvtier serve`` process for any test under tests/kvtier/.

The daemon's data directory lives under ``tmp_path``; its unix socket lives in a short directory
under /tmp because socket paths are limited to 107 bytes and pytest's ``tmp_path`` can be longer.
Its log goes to a file (no pipe to drain, so a paused or chatty daemon never blocks on stderr).
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"kvtierd ready in [0-9.]+ s")


class KvtierDaemon:
    """One ``kvtier serve`` process: start, stop, restart on the same data dir and socket, pause.

    Attributes:
        data_dir: the daemon's ``--data-dir`` (disk tier, token file).
        socket: path of the unix data-plane socket.
        address: ``"unix:<socket>"``, what :class:`kvtier.client.Client` connects to.
        log_path: the daemon's stderr, appended across restarts.
        process: the running :class:`subprocess.Popen`, or None while stopped.
    """

    def __init__(self, tmp_path: Path, *, host_bytes: str = "256MiB", disk_bytes: str = "512MiB",
                 extra_args: tuple[str, ...] = ()) -> None:
        self.data_dir = tmp_path / "kvtier-data"
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
        self.socket = self._sock_dir / "kvtier.sock"
        self.address = f"unix:{self.socket}"
        self.log_path = tmp_path / "kvtierd.log"
        self.process: subprocess.Popen[bytes] | None = None
        # A unique shared-memory prefix: helpers and test runs share /dev/shm, and a killed daemon's
        # segments must be found (and unlinked) by name at teardown.
        self.prefix = f"kvtt{secrets.token_hex(4)}"
        self._args = ["--data-dir", str(self.data_dir), "--socket", str(self.socket), "--rest", "off",
                      "--host-bytes", host_bytes, "--disk-bytes", disk_bytes, "--log-level", "info",
                      *extra_args]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "NOTIFY_SOCKET"))}
        self._env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol"),
                                                             str(ROOT / "connectors")]),
                     "KVTIER_STORE__HOST_NAME_PREFIX": self.prefix,
                     # Touching every host page at start costs CPU the tests need; correctness is the same.
                     "KVTIER_STORE__HOST_PREFAULT": "0"}

    def start(self, timeout_s: float = 60.0) -> KvtierDaemon:
        """Start the process and wait for its "kvtierd ready" log line.

        Raises:
            RuntimeError: the daemon exited or did not become ready within ``timeout_s``.
        """
        assert self.process is None, "already running"
        with open(self.log_path, "ab") as log:
            offset = log.tell()  # a restarted daemon appends: look only at its own lines
            self.process = subprocess.Popen([sys.executable, "-m", "kvtier", "serve", *self._args], cwd=ROOT,
                                            env=self._env, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if READY.search(self._log_since(offset)):
                return self
            if self.process.poll() is not None:
                rc = self.process.returncode
                self.process = None
                raise RuntimeError(f"kvtierd exited with {rc}:\n{self.log()}")
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"kvtierd not ready within {timeout_s} s:\n{self.log()}")

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGCONT (in case it is paused), SIGTERM, wait; SIGKILL after ``timeout_s``. Returns the exit status."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def restart(self, timeout_s: float = 60.0) -> KvtierDaemon:
        """Stop the daemon and start it again on the same data directory and socket."""
        self.stop()
        return self.start(timeout_s)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but answers nothing (a "slow daemon")."""
        assert self.process is not None and self.process.poll() is None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after :meth:`pause`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def tcp_address(self) -> str:
        """``"tcp://HOST:PORT"`` of the TCP data plane (start with ``extra_args=("--listen", "127.0.0.1:0")``).

        Raises:
            RuntimeError: the daemon logged no TCP endpoint.
        """
        found = re.findall(r"kvtierd listening tcp:(\S+)", self._log_since(0))
        if not found:
            raise RuntimeError(f"kvtierd listens on no TCP port:\n{self.log()}")
        return f"tcp://{found[-1]}"  # the latest start's port

    @property
    def token(self) -> str:
        """The data-plane token the daemon generated in its data directory."""
        return (self.data_dir / "token").read_text().strip()

    def log(self) -> str:
        """The tail of the daemon's log (for failure messages)."""
        return self._log_since(0)[-6000:]

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def cleanup(self) -> None:
        """Stop the process and remove what a killed daemon leaves behind (shm segments, socket dir)."""
        self.stop()
        for path in glob.glob(f"/dev/shm/{self.prefix}-*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        shutil.rmtree(self._sock_dir, ignore_errors=True)


@pytest.fixture
def kvtier_daemon(tmp_path: Path) -> Iterator[KvtierDaemon]:
    """A started kvtier daemon (unix socket, REST off, 256 MiB host + 512 MiB disk), stopped at teardown.

    Function scope: use it for tests that stop, pause or restart the daemon.
    """
    daemon = KvtierDaemon(tmp_path)
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()


@pytest.fixture(scope="module")
def kvtier_daemon_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierDaemon]:
    """One daemon shared by the tests of a module (saves a start per test).

    Tests sharing it must not stop, pause or restart it, and should use their own namespace
    (e.g. a unique model name) so that blocks of one test are never hits of another.
    """
    daemon = KvtierDaemon(tmp_path_factory.mktemp("kvtierd"))
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.cleanup()
