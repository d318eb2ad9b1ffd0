"""Both clients against the real daemon (``kvtier serve`` as a subprocess), over its unix socket
and TCP: byte-identical round trips, blocks shared between processes, a client killed between
reserve and commit, a stopped and restarted daemon, and the TCP token."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from kvtier.client import NO_HITS, AsyncClient, Client, LookupResult
from kvtier_protocol.errors import Unauthorized, Unavailable
from tests.kvtier.client.clientkit import NS_ID, make_blocks, short_timeout
from tests.kvtier.client.daemonkit import ENV, ROOT, Daemon, free_port
from tests.kvtier.waitkit import PATIENCE_S, ManualClock, wait_until

MiB = 1 << 20

SAVE_IN_SUBPROCESS = """
import sys
from kvtier.client import Client
from tests.kvtier.client.clientkit import NS_ID, make_blocks
with Client(sys.argv[1]) as kv:
    print(",".join(kv.save(NS_ID, make_blocks(3, 2 << 20, tag=b"shared"))))
"""

RESERVE_THEN_HANG = """
import sys, threading, time
from kvtier.client import ClientOptions, parse_address
from kvtier.client.save import save_flow
from kvtier.client.records import prepare_records
from kvtier.client.transport import BlockingConnection
from tests.kvtier.client.clientkit import NS_ID, make_blocks
conn = BlockingConnection.open(parse_address(sys.argv[1]), ClientOptions(grant_bytes=0), time.monotonic() + 60)
records = prepare_records(NS_ID, make_blocks(2, 1 << 20, tag=b"killed"))
flow = save_flow(conn.session, NS_ID, records, None, None, 0)
reserve = next(flow)
ident = conn.send(reserve, time.monotonic() + 60)
claim = flow.send(1)  # the reserve's ticket: the flow claims its answer next
commit = flow.send(conn.receive(ident, time.monotonic() + 60))  # payloads are in the slots now
assert commit.op == "commit"
print("reserved", flush=True)
threading.Event().wait()  # hangs until the test kills it
"""

GRANT_THEN_HANG = """
import sys, threading, time
from kvtier.client import Client
from kvtier.client.save import save_flow
from kvtier.client.records import prepare_records
from tests.kvtier.client.clientkit import NS_ID, make_blocks
kv = Client(sys.argv[1], timeout_s=60.0)
assert kv.save(NS_ID, make_blocks(2, 1 << 20, tag=b"granted-first")) == ["stored"] * 2  # fills the pool
conn = kv._conn
records = prepare_records(NS_ID, make_blocks(2, 1 << 20, tag=b"killed-granted"))
flow = save_flow(conn.session, NS_ID, records, None, None, 0)
# The pool had these two slots: the payloads are in them now, and the place (never sent) asks
# for the next save's slots too (SPEC 7.4 place grant_sizes, announced as place_grant).
place = next(flow)
assert place.op == "place" and place.keys["grant_sizes"] == [1 << 20] * 2, place
print("copied", flush=True)
threading.Event().wait()  # hangs until the test kills it
"""



def run_python(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=ENV)


@pytest.mark.parametrize("path", ["unix", "tcp"])
def test_save_load_byte_identical(daemon: Daemon, path: str) -> None:
    tag = path.encode()
    chains = [make_blocks(2, 2 * MiB, tag=tag + b"2"), make_blocks(2, 8 * MiB, tag=tag + b"8")]
    address = daemon.socket if path == "unix" else daemon.tcp
    with Client.connect(address, token=daemon.token) as kv:
        assert (kv.session.shm is not None) == (path == "unix")
        for blocks in chains:
            keys = [k for k, _ in blocks]
            assert kv.save(NS_ID, blocks) == ["stored", "stored"]
            assert kv.lookup(NS_ID, keys).num_hits == 2
            assert kv.load(NS_ID, keys) == [r for _, r in blocks]
            assert kv.save(NS_ID, blocks) == ["exists", "exists"]

    async def load_async() -> list[list[bytes]]:
        async with AsyncClient(address, token=daemon.token) as akv:
            return await asyncio.gather(*[akv.load(NS_ID, [k for k, _ in b]) for b in chains * 2])

    assert asyncio.run(load_async()) == [[r for _, r in b] for b in chains * 2]


def test_two_processes_share_blocks(daemon: Daemon) -> None:
    saver = run_python(SAVE_IN_SUBPROCESS, daemon.socket)
    out, err = saver.communicate(timeout=60)
    assert saver.returncode == 0, err
    assert out.strip() == "stored,stored,stored"
    blocks = make_blocks(3, 2 * MiB, tag=b"shared")
    keys = [k for k, _ in blocks]
    for address in (daemon.socket, daemon.tcp):
        with Client(address, token=daemon.token) as kv:
            assert kv.lookup(NS_ID, keys) == LookupResult(3, ("host",) * 3)
            assert kv.load(NS_ID, keys) == [r for _, r in blocks]


@pytest.mark.parametrize("script, said, tag", [(RESERVE_THEN_HANG, "reserved", b"killed"),
                                               (GRANT_THEN_HANG, "copied", b"killed-granted")],
                         ids=["reserve-then-commit", "grant-copy-then-place"])
def test_client_killed_between_writing_its_slots_and_publishing_them(daemon: Daemon, script: str, said: str,
                                                                     tag: bytes) -> None:
    blocks = make_blocks(2, MiB, tag=tag)
    keys = [k for k, _ in blocks]
    writer = run_python(script, daemon.socket)
    try:
        assert writer.stdout.readline().strip() == said, writer.stderr.read()
        with Client(daemon.socket) as kv:
            assert kv.lookup(NS_ID, keys) is NO_HITS  # written into its slots, never published
            assert kv.stats()["leases"] >= 1
            writer.send_signal(signal.SIGKILL)
            writer.wait(10)
            wait_until(lambda: kv.stats()["leases"] == 0, interval_s=0.05,
                       what="the dead client's reservation or grants being reclaimed")
            assert kv.stats()["pending"] == 0
            assert kv.lookup(NS_ID, keys) is NO_HITS and kv.load(NS_ID, keys) == []
            assert kv.save(NS_ID, blocks) == ["stored", "stored"]
            assert kv.load(NS_ID, keys) == [r for _, r in blocks]
    finally:
        writer.kill()
        writer.communicate()


def test_async_tcp_put_frames_go_out_in_slices_never_interleaved(daemon: Daemon) -> None:
    # Four saves of 9 MiB put frames at once on one connection, with lookups in between: each
    # large frame is written a slice at a time (aio_transport.WRITE_SLICE_BYTES), awaiting the
    # socket between slices, and no other frame's bytes may land inside it.
    chains = [make_blocks(3, 3 * MiB, tag=b"slices%d" % i) for i in range(4)]

    async def run() -> tuple[list[object], list[list[bytes]]]:
        async with AsyncClient(daemon.tcp, token=daemon.token) as akv:
            saved = await asyncio.gather(*[akv.save(NS_ID, b) for b in chains],
                                         *[akv.lookup(NS_ID, [k for k, _ in b]) for b in chains])
            loaded = await asyncio.gather(*[akv.load(NS_ID, [k for k, _ in b]) for b in chains])
            return saved, loaded

    saved, loaded = asyncio.run(run())
    assert saved[:4] == [["stored"] * 3] * 4
    assert loaded == [[r for _, r in b] for b in chains]


def test_async_tcp_put_cancelled_mid_frame_drops_only_its_connection(daemon: Daemon) -> None:
    # Cancelled between two slices of its put frame, a save leaves the stream mid-frame: the client
    # aborts that connection (the daemon sees it close, never a torn frame), nothing of it is
    # stored, and the next call reconnects.
    blocks = make_blocks(2, 32 * MiB, tag=b"cut")
    keys = [k for k, _ in blocks]

    async def run() -> tuple[LookupResult, list[str]]:
        async with AsyncClient(daemon.tcp, token=daemon.token) as akv:
            await akv.ping()
            conn = akv._conn
            assert conn is not None
            save = asyncio.create_task(akv.save(NS_ID, blocks))
            deadline = time.monotonic() + PATIENCE_S
            while not conn._writing.locked():  # the frame is going out, awaiting the socket
                assert time.monotonic() < deadline and not save.done(), "the put frame never went out in slices"
                await asyncio.sleep(0)
            save.cancel()
            with pytest.raises(asyncio.CancelledError):
                await save
            assert conn.closed
            found = await akv.lookup(NS_ID, keys)  # a new connection
            return found, await akv.save(NS_ID, blocks)

    found, saved = asyncio.run(run())
    assert found is NO_HITS
    assert saved == ["stored", "stored"]
    with Client.connect(daemon.socket) as kv:
        assert kv.load(NS_ID, keys) == [r for _, r in blocks]


def test_tcp_needs_the_token(daemon: Daemon) -> None:
    for token in (None, "not-the-token"):
        with pytest.raises(Unauthorized):
            Client.connect(daemon.tcp, token=token)
        with Client(daemon.tcp, token=token) as kv, pytest.raises(Unauthorized):
            kv.lookup(NS_ID, [b"k" * 32])  # never degraded into misses

        async def refused(token: str | None = token) -> None:
            async with AsyncClient(daemon.tcp, token=token) as akv:
                await akv.lookup(NS_ID, [b"k" * 32])

        with pytest.raises(Unauthorized):
            asyncio.run(refused())
    with Client.connect(daemon.tcp, token=daemon.token) as kv:
        assert kv.ping() > 0
    with Client.connect(daemon.socket) as kv:  # the socket needs no token by default
        assert kv.ping() > 0


def test_stopped_daemon_gives_misses_and_restart_is_transparent() -> None:
    directory = tempfile.mkdtemp(prefix="kvd-", dir="/tmp")
    d = Daemon(directory, port=free_port()).start()
    blocks = make_blocks(2, 64 << 10, tag=b"stop")
    after = make_blocks(2, 64 << 10, tag=b"after-restart")
    keys = [k for k, _ in blocks]
    clock = ManualClock()  # the hold-down's clock: "within" and "after" it are the test's to say
    try:
        # Calls that must succeed get a timeout no busy machine comes near; the ones meant to
        # time out (the daemon is SIGSTOPped) run under a short one.
        kv = Client(d.socket, timeout_s=60.0, holddown_s=5.0, clock=clock)
        akv = AsyncClient(d.tcp, token=d.token, timeout_s=60.0, holddown_s=5.0, clock=clock)
        assert kv.save(NS_ID, blocks) == ["stored", "stored"]

        async def lookup_and_load() -> tuple[LookupResult, list[bytes]]:
            return await asyncio.gather(akv.lookup(NS_ID, keys), akv.load(NS_ID, keys))

        async def round_trip() -> tuple[list[str], list[bytes]]:
            return await akv.save(NS_ID, after), await akv.load(NS_ID, [k for k, _ in after])

        loop = asyncio.new_event_loop()
        try:
            assert loop.run_until_complete(lookup_and_load())[0].num_hits == 2
            d.signal(signal.SIGSTOP)
            with short_timeout(kv):
                assert kv.lookup(NS_ID, keys) is NO_HITS  # waits its timeout for the silent daemon
            assert kv.load(NS_ID, keys) == []  # hold-down: answered at once, without asking
            with pytest.raises(Unavailable, match="moments ago"):
                kv.load(NS_ID, keys, degrade=False)
            with short_timeout(akv):
                assert loop.run_until_complete(lookup_and_load()) == [NO_HITS, []]
            with pytest.raises(Unavailable, match="moments ago"):
                loop.run_until_complete(akv.lookup(NS_ID, keys, degrade=False))
            d.stop()
            d.start()
            clock.advance(5.0)  # the hold-down is over
            assert kv.ping() > 0  # reconnected by itself (the socket path stayed, the segments changed)
            saved, loaded = loop.run_until_complete(round_trip())  # TCP: the daemon came back on its port
            assert saved == ["stored", "stored"] and loaded == [r for _, r in after]
            assert kv.load(NS_ID, [k for k, _ in after]) == [r for _, r in after]
            loop.run_until_complete(akv.close())
        finally:
            loop.close()
        kv.close()
    finally:
        d.stop()
        shutil.rmtree(directory, ignore_errors=True)
