"""The blocking client over TCP against a real daemon (uvloop, as deployed): get records are sent
from the daemon's host slots and put payloads received in place, so many clients saving and
loading blocks of many sizes at once must each get exactly their bytes back, and every get's
lease must end once its bytes have left."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvtier.client import Client
from tests.kvtier.client.clientkit import NS_ID, make_blocks
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.waitkit import PATIENCE_S, wait_until

MiB = 1 << 20
SIZES = (4096, 256 << 10, MiB, 9 * MiB)  # 9 MiB: one block's record beyond the socket buffers


@pytest.fixture
def daemon(tmp_path: Path):
    d = KvtierDaemon(tmp_path, host_bytes="192MiB", disk_bytes="64MiB", extra_args=("--listen", "127.0.0.1:0"))
    try:
        yield d.start()
    finally:
        d.cleanup()


def test_concurrent_tcp_clients_get_exactly_their_blocks(daemon: KvtierDaemon) -> None:
    address, token = daemon.tcp_address(), daemon.token
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            with Client.connect(address, token=token, timeout_s=PATIENCE_S) as kv:
                for size in SIZES:
                    blocks = make_blocks(3, size, tag=b"w%d-%d" % (worker, size))
                    keys = [k for k, _ in blocks]
                    assert kv.save(NS_ID, blocks) == ["stored"] * 3
                    assert kv.load(NS_ID, keys, degrade=False) == [r for _, r in blocks]
                    dests = [bytearray(size) for _ in keys]
                    assert len(kv.load_into(NS_ID, keys, dests, degrade=False)) == 3
                    assert [bytes(d) for d in dests] == [r[len(r) - size:] for _, r in blocks]
                    assert kv.delete(NS_ID, keys) == 3
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    with Client.connect(address, token=token) as kv:
        wait_until(lambda: kv.stats()["leases"] == 0, what="every lease ended")
