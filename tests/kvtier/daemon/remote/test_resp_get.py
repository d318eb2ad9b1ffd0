"""The remote tier's fast GET path: the RESP2 reply reader fed every way the socket can cut the
bytes, and :class:`FastGets` against a real ``redis-server`` on loopback (values of every size,
missing keys, ACL users and refusals, a pipeline cancelled mid-value, connection reuse)."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import subprocess
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import exceptions as rx

from kvtier.daemon.remote.resp_get import FastGets, GetReplies, ProtocolViolation, RespAuth, pack


def feed(proto: GetReplies, data: bytes, cuts: list[int]) -> None:
    """Deliver ``data`` as asyncio would, in reads that end at ``cuts`` (and at each buffer's end)."""
    pos = 0
    bounds = sorted(set(c for c in cuts if 0 < c < len(data))) + [len(data)]
    for end in bounds:
        while pos < end:
            buf = proto.get_buffer(-1)
            n = min(len(buf), end - pos)
            assert n > 0
            memoryview(buf)[:n] = data[pos:pos + n]
            proto.buffer_updated(n)
            pos += n


def bulk(v: bytes | None) -> bytes:
    return b"$-1\r\n" if v is None else b"$%d\r\n%s\r\n" % (len(v), v)


VALUES = [b"", b"x", None, os.urandom(100_000), b"\r\n$3\r\nabc", None, os.urandom(200_003)]


@pytest.mark.parametrize("seed", range(12))
def test_replies_parse_however_the_bytes_are_cut(seed: int) -> None:
    rng = random.Random(seed)
    data = b"".join(bulk(v) for v in VALUES) + b"-NOPERM this user has no permissions\r\n+OK\r\n:42\r\n"
    cuts = [rng.randrange(len(data)) for _ in range(rng.choice([0, 3, 40, 400]))]
    if seed == 0:
        cuts = list(range(len(data)))  # one byte at a time

    async def go() -> list:
        proto = GetReplies()
        fut = proto.expect(len(VALUES) + 3)
        feed(proto, data, cuts)
        return await fut

    got = asyncio.run(go())
    assert got[:len(VALUES)] == VALUES
    assert all(isinstance(g, bytearray) for g, v in zip(got, VALUES) if v is not None)
    assert isinstance(got[-3], rx.NoPermissionError)
    assert got[-2:] == [b"OK", 42]


@pytest.mark.parametrize("data, why", [
    (b"*1\r\n$1\r\na\r\n", "reply of type"),
    (b"$3\r\nabcXY", "not followed by CRLF"),
    (b"$x\r\n", "not a number"),
    (b"$1\r\na\r\n$1\r\nb\r\n", "nobody asked for"),
])
def test_what_a_get_cannot_answer_breaks_the_connection(data: bytes, why: str) -> None:
    async def go() -> GetReplies:
        proto = GetReplies()
        fut = proto.expect(1)
        feed(proto, data, [])
        if why == "nobody asked for":  # the first reply was delivered; the extra one breaks it
            assert await fut == [bytearray(b"a")]
        else:
            with pytest.raises(ProtocolViolation, match=why):
                await fut
        return proto

    assert asyncio.run(go()).broken


def test_a_lost_connection_fails_the_pipeline() -> None:
    async def go() -> None:
        proto = GetReplies()
        fut = proto.expect(2)
        feed(proto, bulk(b"abc") + b"$10\r\nabc", [])
        proto.connection_lost(None)
        with pytest.raises(rx.ConnectionError):
            await fut

    asyncio.run(go())


def test_a_command_packs_as_resp2() -> None:
    assert pack(b"GET", b"k:1") == b"*2\r\n$3\r\nGET\r\n$3\r\nk:1\r\n"


# --- against a real redis-server ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed")
    work: Path = tmp_path_factory.mktemp("resp-get")
    port = _free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(work), "--logfile", str(work / "redis.log")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        cli = shutil.which("redis-cli") or "redis-cli"
        while subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
            assert proc.poll() is None, (work / "redis.log").read_text()
        subprocess.run([cli, "-p", str(port), "ACL", "SETUSER", "alice", "on", ">s3cret", "~a:*", "+@all"],
                       check=True, capture_output=True)
        yield "127.0.0.1", port
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, None]], None]:
    """Run a coroutine on asyncio's loop or on uvloop's (the daemon's where installed: its
    transports are no asyncio.Transport subclasses)."""
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.run
    return asyncio.run


async def _set(node: tuple[str, int], items: dict[bytes, bytes]) -> None:
    reader, writer = await asyncio.open_connection(*node)
    writer.write(b"".join(pack(b"SET", k, v) for k, v in items.items()))
    for _ in items:
        assert await reader.readline() == b"+OK\r\n"
    writer.close()
    await writer.wait_closed()


def test_values_of_every_size_and_missing_keys(server: tuple[str, int], run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    items = {b"a:%d" % i: os.urandom(n) for i, n in enumerate([0, 1, 2, 65535, 65536, 65537, 3 << 20, 9 << 20])}
    keys = [b"a:missing", *items, b"b:missing"]

    async def go() -> None:
        await _set(server, items)
        fast = FastGets(RespAuth())
        try:
            for _ in range(2):  # the second round reuses the connection
                got = await fast.get(server, keys)
                assert got == [None, *items.values(), None]
            assert len(fast._idle[server]) == 1
        finally:
            fast.close()

    run(go())


def test_acl_users_and_refusals(server: tuple[str, int], run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    async def go() -> None:
        await _set(server, {b"a:x": b"mine", b"b:x": b"theirs"})
        alice = FastGets(RespAuth(user="alice", password="s3cret"))
        try:
            ok, refused = await alice.get(server, [b"a:x", b"b:x"])
            assert ok == b"mine"
            assert isinstance(refused, rx.NoPermissionError)
        finally:
            alice.close()
        wrong = FastGets(RespAuth(user="alice", password="nope"))
        with pytest.raises(rx.AuthenticationError):
            await wrong.get(server, [b"a:x"])
        assert not wrong._idle

    run(go())


def test_a_pipeline_cancelled_mid_value_leaves_no_stale_bytes(server: tuple[str, int], run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    big = os.urandom(64 << 20)

    async def go() -> None:
        await _set(server, {b"a:big": big, b"a:small": b"small"})
        fast = FastGets(RespAuth())
        try:
            task = asyncio.ensure_future(fast.get(server, [b"a:big", b"a:small"]))
            while not any(c.receiving_value for c in fast.busy):  # part of the big value is in
                assert not task.done()
                await asyncio.sleep(0)  # a yield to the loop, not a wait
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert not fast._idle.get(server)  # the cancelled connection was closed, not pooled
            assert await fast.get(server, [b"a:small", b"a:big"]) == [b"small", big]
        finally:
            fast.close()

    run(go())

