"""A client given no address finds a daemon that ``kvtier serve`` started on its defaults: both
resolve ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock`` (kvtier_protocol.address), so
``kvtier.client.connect()`` works verbatim on such a machine."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import kvtier.client
from kvtier.client import AsyncClient, Client, LookupResult, parse_address
from kvtier_protocol.address import default_address
from tests.kvtier.client.clientkit import NS_ID, make_blocks
from tests.kvtier.client.daemonkit import Daemon

KiB = 1 << 10


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh ``XDG_RUNTIME_DIR`` (short, under /tmp: a unix socket path has ~108 bytes), and no
    variable that would name another address."""
    runtime = Path(tempfile.mkdtemp(prefix="kvrt-", dir="/tmp"))
    for name in ("KVTIER_ADDRESS", "KVTIER_SOCKET", "KVTIER_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    try:
        yield runtime
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_client_with_no_address_connects_to_the_daemons_default_socket(runtime_dir: Path) -> None:
    data_dir = runtime_dir / "data"
    data_dir.mkdir()
    daemon = Daemon(str(data_dir), socket_name=None, env={"XDG_RUNTIME_DIR": str(runtime_dir)}).start()
    try:
        socket = runtime_dir / "kvtier" / "kvtier.sock"
        assert socket.is_socket(), "kvtier serve listens on its default socket"
        assert default_address() == f"unix:{socket}"
        blocks = make_blocks(3, 64 * KiB, tag=b"default-address")
        keys = [k for k, _ in blocks]

        with kvtier.client.connect() as kv:  # verbatim: no address, no options
            assert kv.address == parse_address(str(socket))
            assert kv.session is not None and kv.session.shm is not None, "the shared-memory path"
            assert kv.save(NS_ID, blocks) == ["stored"] * 3
        with Client() as kv:  # the constructor too: it connects at the first call
            assert kv.load(NS_ID, keys, degrade=False) == [r for _, r in blocks]

        async def run() -> LookupResult:
            async with await AsyncClient.connect() as akv:
                return await akv.lookup(NS_ID, keys, degrade=False)
        assert asyncio.run(run()).num_hits == 3
    finally:
        daemon.stop()
