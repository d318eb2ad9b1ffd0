"""A private ``redis-server`` for the peers suite: a free loopback port, persistence off, stopped after.

The bench starts Debian's ``redis-server`` itself (never a server it finds running) so the
baseline is a known configuration on every machine: no RDB snapshots (``--save ""``), no AOF
(``--appendonly no``), no memory limit or eviction, its working directory a private temp dir.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from kvtier.bench.report import progress


class RedisUnavailable(RuntimeError):
    """redis-server or redis-py is missing here, or the server would not start; the message says which."""


def _free_port() -> int:
    """A port the kernel has just handed out on loopback (closed again; redis binds it next).

    Another process may grab it in between; :meth:`RedisServer.start` then fails with the log.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_client() -> str:
    """redis-py's version and reply parser (hiredis, in C, when installed; else pure Python: it
    decides how fast large GETs come back); RedisUnavailable when redis-py is not importable."""
    try:
        import redis
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError as exc:
        raise RedisUnavailable(f"redis-py is not importable ({exc}); pip install 'redis>=5'") from exc
    return f"{redis.__version__}, {'hiredis' if HIREDIS_AVAILABLE else 'Python'} parser"


class RedisServer:
    """``redis-server`` on ``127.0.0.1:<free port>`` with persistence off.

    Args:
        binary: the server executable (looked up on PATH when not a path).
        work_parent: parent of its private working directory (default $TMPDIR).
    """

    def __init__(self, binary: str = "redis-server", work_parent: str | None = None) -> None:
        self.binary = binary
        self.work_parent = work_parent
        self.port = 0
        self.version = ""
        self.client_version = ""
        self.work: Path | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        """Start it and wait until it answers PING.

        Raises:
            RedisUnavailable: no redis-server on PATH, no redis-py, or the server did not come up
                (with the end of its log).
        """
        path = shutil.which(self.binary)
        if path is None:
            raise RedisUnavailable(f"{self.binary} not found on PATH (Debian: apt-get install redis-server)")
        self.client_version = _check_client()
        self.version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                      timeout=10).stdout.strip()
        self.work = Path(tempfile.mkdtemp(prefix="kvtier-bench-redis-", dir=self.work_parent))
        self.port = _free_port()
        cmd = [path, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", str(self.work), "--daemonize", "no", "--protected-mode", "yes",
               "--maxmemory", "0", "--logfile", str(self.work / "redis.log")]
        progress(f"peers: starting {path} on 127.0.0.1:{self.port} (persistence off)")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # One attempt per probe: this loop is the retry. redis-py 8 retries a refused connection
        # for ~4.5 s by default, long enough to hide an exited server behind a PING timeout.
        once = Retry(NoBackoff(), 0)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                tail = self.log_tail()
                self.stop()
                raise RedisUnavailable(f"redis-server exited with {rc}:\n{tail}")
            try:
                with redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0, retry=once) as r:
                    if r.ping():
                        return
            except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise RedisUnavailable(f"redis-server did not answer PING within {timeout_s:.0f} s:\n{tail}")

    def server_version(self) -> str:
        """``7.0.15`` out of ``Redis server v=7.0.15 sha=...`` (the whole line if it reads otherwise)."""
        m = re.search(r"\bv=(\S+)", self.version)
        return m[1] if m else self.version

    def log_tail(self) -> str:
        log = self.work / "redis.log" if self.work else None
        return log.read_text(errors="replace")[-3000:] if log and log.exists() else ""

    def stop(self) -> None:
        """SIGTERM (with persistence off it saves nothing) and wait; SIGKILL if stuck; remove its
        directory. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    progress("peers: redis-server did not stop within 20 s; killing it")
                    proc.kill()
                    proc.wait(10)
        if self.work is not None:
            shutil.rmtree(self.work, ignore_errors=True)
            self.work = None
