"""The real daemon as a subprocess, for the client's integration tests.

``kvtier serve`` once kvtier.cli registers it, else ``python -m kvtier.commands.serve``; the TCP
port is read from the daemon's ``listening tcp:HOST:PORT`` log line.
"""

from __future__ import annotations

import glob
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "NOTIFY_SOCKET"))},
       "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol")])}
_TCP = re.compile(r"listening tcp:(?P<host>[\d.]+):(?P<port>\d+)")


def serve_command() -> list[str]:
    """How to start the daemon in this checkout."""
    import kvtier.cli

    if "kvtier.commands.serve" in kvtier.cli.COMMANDS:
        return [sys.executable, "-m", "kvtier", "serve"]
    return [sys.executable, "-m", "kvtier.commands.serve"]


def free_port() -> int:
    """A TCP port nobody listens on right now (for a daemon that must come back on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """One ``kvtier serve`` process on ``directory`` (socket, token, disk tier, log)."""

    def __init__(self, directory: str, *, port: int = 0, socket_name: str | None = "kvtier.sock",
                 env: dict[str, str] | None = None) -> None:
        """``socket_name``: the unix socket's name in ``directory``; None: no ``--socket``, the
        daemon listens on its default socket (``env`` decides where: ``XDG_RUNTIME_DIR``).
        ``env``: added to the daemon's environment."""
        self.dir = Path(directory)
        self.socket = str(self.dir / socket_name) if socket_name is not None else None
        self.log_path = self.dir / "daemon.log"
        self.listen_port = port
        self.port = 0
        self.proc: subprocess.Popen | None = None
        # A unique segment prefix, so that what a killed daemon leaves in /dev/shm is found at stop;
        # no pre-faulting: it costs CPU the tests need and changes nothing they check.
        self.shm_prefix = f"kvtc{secrets.token_hex(4)}"
        self.env = {**ENV, "KVTIER_STORE__HOST_NAME_PREFIX": self.shm_prefix,
                    "KVTIER_STORE__HOST_PREFAULT": "0", **(env or {})}

    def start(self, timeout_s: float = 60.0) -> Daemon:
        args = [*serve_command(), "--data-dir", str(self.dir),
                *(["--socket", self.socket] if self.socket is not None else []),
                "--listen", f"127.0.0.1:{self.listen_port}", "--rest", "off", "--host-bytes", "64MiB",
                "--disk-bytes", "256MiB", "--token-file", str(self.dir / "token")]
        with open(self.log_path, "ab") as log:
            offset = log.tell()  # a restarted daemon appends: read only its own lines
            self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=ROOT, env=self.env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = _TCP.search(self.log_path.read_bytes()[offset:].decode(errors="replace"))
            if m:  # logged once both endpoints listen
                self.port = int(m["port"])
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"daemon not ready within {timeout_s}s:\n{self.log()}")

    @property
    def tcp(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        return (self.dir / "token").read_text().strip()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self) -> int | None:
        """SIGCONT (in case it is stopped), SIGTERM, wait; SIGKILL if it does not exit."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        for path in glob.glob(f"/dev/shm/{self.shm_prefix}-*"):  # left only by a killed daemon
            os.unlink(path)
        return proc.returncode


def demoting_blocks(seed: int, tag: bytes) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """80 chained raw bfloat16 block records of 1 MiB (keys, (key, record) pairs): more than a
    daemon's 64 MiB host tier holds, so saving them all demotes the first ones to disk."""
    import torch

    from kvtier_protocol.block import encode_block
    from tests.kvtier.client.clientkit import NS_ID, key

    g = torch.Generator().manual_seed(seed)
    keys = [key(i, tag) for i in range(80)]
    blocks = [(k, encode_block(torch.randn(32, 2, 8, 16, 64, generator=g).to(torch.bfloat16), ns_id=NS_ID,
                               chain_hash=k, parent_hash=keys[i - 1] if i else None, layout="canonical"))
              for i, k in enumerate(keys)]
    return keys, blocks
