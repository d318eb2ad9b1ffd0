"""A daemon restarted under an engine in the middle of a load: the load ends short, without an
error, and the engine recomputes; the connector serves again after the restart."""

from __future__ import annotations

import fcntl
import struct
import termios
import threading

import torch

from kvtier.connector.core import KVConnectorCore
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.connector.connkit import make_caches, make_ns, tokens
from tests.kvtier.waitkit import PATIENCE_S, wait_until


def unread_by_daemon(core: KVConnectorCore) -> int:
    """Bytes ``core``'s client sent on its connection that the daemon has not read yet (SIOCOUTQ
    of a unix socket: what sits in the daemon's receive queue)."""
    conn = core.client._conn
    if conn is None or conn._sock is None:
        return 0
    return struct.unpack("i", fcntl.ioctl(conn._sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def test_a_daemon_killed_and_restarted_mid_load_means_recompute_not_an_error(kvtier_daemon: KvtierDaemon):
    ns = make_ns()
    caches = make_caches(ns, "vllm-flash", num_pages=8, seed=1)
    blank = make_caches(ns, "vllm-flash", num_pages=8, seed=None)
    # Calls that must succeed get a timeout no busy machine comes near; the load that fails does
    # so because its daemon is killed under it, not by waiting.
    with KVConnectorCore(ns, address=kvtier_daemon.address, timeout_s=60.0) as writer, \
            KVConnectorCore(ns, address=kvtier_daemon.address, timeout_s=60.0) as engine:
        writer.bind_kv_caches(caches)
        engine.bind_kv_caches(blank)
        hashes = writer.block_hashes(tokens(8 * ns.block_tokens))
        assert writer.save(hashes, list(range(8))) == 8
        assert engine.lookup(hashes) == 8

        kvtier_daemon.pause()  # the load's acquire is sent and waits for an answer
        outcome: list[object] = []
        loading = threading.Thread(target=lambda: outcome.append(_load(engine, hashes)))
        loading.start()
        wait_until(lambda: unread_by_daemon(engine) > 0, what="the load's acquire reaching the stopped daemon")
        kvtier_daemon.process.kill()  # SIGKILL while the load is in flight, then a fresh daemon
        kvtier_daemon.process.wait()
        kvtier_daemon.restart()
        loading.join(PATIENCE_S)
        assert not loading.is_alive()
        assert outcome and isinstance(outcome[0], int) and outcome[0] < 8, f"no error, fewer blocks: {outcome}"

        # The engine recomputes what it could not load; its next save and load go through again.
        writer.stats.take()
        writer.save(hashes, list(range(8)))
        saved = writer.stats.take()
        # stored again, or found already stored: the daemon writes blocks through to its disk
        # tier, and those written before the kill are still there after the restart
        assert saved["saved_blocks"] + saved["skipped_blocks"] == 8 and saved["failed_calls"] == 0, saved
        # the engine's client may be in its hold-down (its failed load found no daemon to retry
        # on): loads are misses until it ends, then served
        wait_until(lambda: engine.load(hashes, list(range(8))) == 8, interval_s=0.1,
                   what="the engine's load being served again")
        for got, want in zip(blank, caches):
            assert torch.equal(got, want)


def _load(core: KVConnectorCore, hashes: list[bytes]) -> int | BaseException:
    try:
        return core.load(hashes, list(range(len(hashes))))
    except BaseException as exc:  # reported to the test thread: an error is the failure here
        return exc
