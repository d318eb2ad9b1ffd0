"""A kvtier daemon on a simulated host: ``ip netns exec hN python -m kvtier serve --remote ...``.

The daemon's network (the cluster, and REST, which is off) lives in its host's namespace; its
unix socket is a file, so the test process (or an engine in it) reaches it from anywhere. Its log
goes to a file; its shared-memory segments carry a prefix of their own, unlinked at :meth:`stop`
(a killed daemon leaves them).
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
from pathlib import Path
from typing import Any

from kvtier.client import Client
from tests.manyhosts import Host

ROOT = Path(__file__).resolve().parents[4]
READY = re.compile(r"kvtierd ready in [0-9.]+ s")
REST = re.compile(r"kvtierd rest (http://\S+)")


class HostDaemon:
    """One daemon on ``host`` with ``--remote url``; no disk tier (every restart starts empty).

    Args:
        env: extra ``KVTIER_*`` settings (a lookup budget, a user, a write mode, ...).
        rest: ``--rest``: "off", or an address of the host's own (its loopback: the daemon binds
            it inside its namespace); :attr:`rest_url` is where it listens once started.
    """

    def __init__(self, host: Host, workdir: Path, url: str, *, env: dict[str, str] | None = None,
                 host_bytes: str = "64MiB", rest: str = "off") -> None:
        self.host = host
        self._sock_dir = Path(tempfile.mkdtemp(prefix="kvr-", dir="/tmp"))
        self.socket = self._sock_dir / "kvtier.sock"
        self.address = f"unix:{self.socket}"
        self.log_path = workdir / f"kvtierd-{host.name}-{secrets.token_hex(3)}.log"
        self.data_dir = workdir / f"data-{host.name}-{secrets.token_hex(3)}"
        self.process: subprocess.Popen[bytes] | None = None
        self.rest_url: str | None = None
        self.prefix = f"kvtr{secrets.token_hex(4)}"
        self._args = [sys.executable, "-m", "kvtier", "serve", "--remote", url, "--socket", str(self.socket),
                      "--rest", rest, "--data-dir", str(self.data_dir), "--host-bytes", host_bytes,
                      "--disk-bytes", "0", "--log-level", "info"]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "NOTIFY_SOCKET"))}
        self.env = {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol"),
                                                             str(ROOT / "connectors")]),
                     "KVTIER_STORE__HOST_NAME_PREFIX": self.prefix, "KVTIER_STORE__HOST_PREFAULT": "0",
                     # Generous on a loaded 2-core machine; the fault tests rely on timeouts, not on it.
                     "KVTIER_REMOTE__LOOKUP_BUDGET_MS": "1000", **(env or {})}

    def start(self, timeout_s: float = 60.0) -> HostDaemon:
        """Start it inside its host and wait for its "ready" line.

        Raises:
            RuntimeError: it exited or was not ready within ``timeout_s``.
        """
        assert self.process is None, "already running"
        with open(self.log_path, "ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(self.host.argv(*self._args), cwd=ROOT, env=self.env,
                                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")[offset:]
            if READY.search(text):
                found = REST.search(text)
                self.rest_url = found.group(1) if found else None
                return self
            if self.process.poll() is not None:
                rc, self.process = self.process.returncode, None
                raise RuntimeError(f"kvtierd on {self.host.name} exited with {rc}:\n{self.log()}")
            time.sleep(0.05)  # polling the log for the ready line
        self.stop()
        raise RuntimeError(f"kvtierd on {self.host.name} not ready within {timeout_s} s:\n{self.log()}")

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGTERM (it uploads what is queued and closes), SIGKILL after ``timeout_s``."""
        proc, self.process = self.process, None
        rc = None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
            rc = proc.returncode
        self._unlink_segments()
        return rc

    def kill(self) -> None:
        """SIGKILL: the host's daemon is gone at once (its shared memory is unlinked here)."""
        proc, self.process = self.process, None
        if proc is not None:
            proc.kill()
            proc.wait(10)
        self._unlink_segments()

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def _unlink_segments(self) -> None:
        for path in glob.glob(f"/dev/shm/{self.prefix}*"):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def client(self) -> Client:
        """A data-plane client of this daemon (the caller closes it)."""
        return Client(self.address, timeout_s=30.0)

    def remote(self) -> dict[str, Any]:
        """The ``remote`` map of the daemon's stats."""
        with self.client() as c:
            return c.stats()["remote"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:] if self.log_path.exists() else ""
