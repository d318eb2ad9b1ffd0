"""Simulated hosts on one machine: Linux network namespaces joined by a bridge (needs root and `ip`).

A :class:`Fabric` makes one bridge namespace and, per host, a namespace with one veth (``eth0``)
whose peer is a port of the bridge. Addresses come from a private /24 (:data:`SUBNET`) that exists
only inside these namespaces: the machine's own namespace gets no interface, no address and no
route, and no host gets a default route, so nothing here can reach (or be reached from) any other
address. Everything is removed by :meth:`Fabric.close`, on failure too, and namespaces left over by
a killed run are removed by the next one.

A test talks from a host of its own through :class:`NetnsLoop`: an asyncio loop on a thread that
entered that host's namespace (a network namespace is a per-thread attribute in Linux, so every
socket that thread opens lives in the host; the rest of the test process stays where it was).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import itertools
import os
import re
import shutil
import subprocess
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

SUBNET = "10.213.7"  # /24; hosts are .1, .2, ...; it exists only inside the fabric's namespaces
REQUIRE_ENV = "KVTIER_REQUIRE_NETNS"
NETNS_DIR = Path("/run/netns")
NAME_PREFIX = "kvtnet"  # namespaces are named kvtnet<pid>x<n>-br, kvtnet<pid>x<n>-h1, ...
CLONE_NEWNET = 0x40000000

T = TypeVar("T")
_FABRICS = itertools.count()


class NetnsUnavailable(Exception):
    """This machine or user cannot make network namespaces (the reason is the message)."""


def skip_or_fail(reason: str) -> None:
    """Skip the test for ``reason``, or fail it when ``KVTIER_REQUIRE_NETNS=1`` (CI: a namespace
    test must run, never pass by skipping)."""
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but network namespaces are unavailable: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


def check_prerequisites(*programs: str) -> None:
    """Raises NetnsUnavailable unless we are root and ``ip`` and ``programs`` are on PATH."""
    if os.geteuid() != 0:
        raise NetnsUnavailable("not root (network namespaces need CAP_SYS_ADMIN)")
    for prog in ("ip", *programs):
        if shutil.which(prog) is None:
            raise NetnsUnavailable(f"{prog!r} is not installed")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def remove_stale() -> None:
    """Delete fabric namespaces whose creating process is gone (a run killed before teardown)."""
    if not NETNS_DIR.is_dir():
        return
    for path in NETNS_DIR.iterdir():
        m = re.fullmatch(rf"{NAME_PREFIX}(\d+)x\d+-\w+", path.name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _kill_in(path.name)
            _ip("netns", "del", path.name, check=False)


def _kill_in(netns: str) -> None:
    """SIGKILL every process still inside ``netns`` (so deleting it really frees it)."""
    out = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in out:
        try:
            os.kill(int(pid), 9)
        except (ProcessLookupError, ValueError):
            pass


@dataclass
class Host:
    """One simulated host: a network namespace with ``eth0`` on the fabric's bridge.

    Attributes:
        name: short name (``h1``...).
        netns: the namespace's name (for ``ip netns exec``).
        address: its IPv4 address on the fabric.
    """

    name: str
    netns: str
    address: str

    def argv(self, *argv: str) -> list[str]:
        """``argv`` prefixed to run inside this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command inside this host; its output as text."""
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, check=check, timeout=timeout)

    def popen(self, argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
        """Start a long-running command inside this host, its output appended to ``log``.

        ``ip netns exec`` execs the command, so the Popen's pid is the command's own."""
        with open(log, "ab") as out:
            return subprocess.Popen(self.argv(*argv), stdin=subprocess.DEVNULL, stdout=out, stderr=out)

    def link_down(self) -> None:
        """Cut this host off the fabric (its cable pulled: peers see silence, not resets)."""
        _ip("-n", self.netns, "link", "set", "eth0", "down")

    def link_up(self) -> None:
        """Plug this host back in."""
        _ip("-n", self.netns, "link", "set", "eth0", "up")


class Fabric:
    """A bridge namespace and ``n`` hosts on it. Use as a context manager, or call :meth:`close`.

    Raises (construction): NetnsUnavailable when a namespace cannot be made; what was made by
    then is removed.
    """

    def __init__(self, n: int) -> None:
        check_prerequisites()
        remove_stale()
        tag = f"{NAME_PREFIX}{os.getpid()}x{next(_FABRICS)}"  # two fabrics of one process never clash
        self.bridge_ns = f"{tag}-br"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            # STP off (the default): a port forwards as soon as it is up.
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(1, n + 1):
                host = Host(f"h{i}", f"{tag}-h{i}", f"{SUBNET}.{i}")
                self._add_ns(host.netns)
                # Made inside the bridge namespace, the veth never appears in the machine's own.
                _ip("-n", self.bridge_ns, "link", "add", f"vh{i}", "type", "veth",
                    "peer", "name", "eth0", "netns", host.netns)
                _ip("-n", self.bridge_ns, "link", "set", f"vh{i}", "master", "br0", "up")
                _ip("-n", host.netns, "link", "set", "lo", "up")
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                self.hosts.append(host)
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        r = _ip("netns", "add", name, check=False)
        if r.returncode != 0:
            raise NetnsUnavailable(f"ip netns add {name}: {r.stderr.strip()}")
        self._namespaces.append(name)

    def close(self) -> None:
        """Kill whatever still runs inside the fabric and delete every namespace (idempotent)."""
        for name in reversed(self._namespaces):
            _kill_in(name)
            _ip("netns", "del", name, check=False)
        self._namespaces.clear()

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NetnsLoop:
    """An asyncio event loop on its own thread inside ``host``'s network namespace.

    :meth:`run` drives a coroutine there from the test's thread and returns its result (or raises
    its exception). Everything the coroutine connects to is reached from ``host``.
    """

    def __init__(self, host: Host) -> None:
        self.host = host
        self._ready: concurrent.futures.Future[asyncio.AbstractEventLoop] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name=f"netns-{host.name}", daemon=True)
        self._thread.start()
        self.loop = self._ready.result(timeout=30)

    def _main(self) -> None:
        try:
            fd = os.open(NETNS_DIR / self.host.netns, os.O_RDONLY)
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into {self.host.netns}: {os.strerror(err)}")
            finally:
                os.close(fd)
            loop = asyncio.new_event_loop()
        except BaseException as e:
            self._ready.set_exception(e)
            return
        asyncio.set_event_loop(loop)
        self._ready.set_result(loop)
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        """Run ``coro`` on the host's loop; its result. ``timeout`` only guards against a hang."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def close(self) -> None:
        """Stop the loop and its thread (idempotent)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=30)
