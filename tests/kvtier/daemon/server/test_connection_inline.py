"""Requests served in the read loop (kvtier.daemon.server.connection: Connection._start).

A grant, place, acquire, release or ping is started inside the connection's read loop, not in a
task of its own, and answered there when it finishes without waiting; one that waits goes on in
a task from where it stopped (``_resume``). These tests hold that to a task's semantics (results,
errors and cancellation reach the handler as they would in a task) and that answers written
straight to the transport still stop the connection's reading when the peer reads nothing.
"""

from __future__ import annotations

import asyncio

import pytest
from kvtier_protocol import frames as fr

from kvtier.daemon.server.connection import _resume
from tests.kvtier.daemon.server.planekit import TOKEN, eventually, open_plane


async def _started(coro):
    """``coro`` run by hand to its first suspension, as Connection._start does."""
    return coro, coro.send(None)


async def test_resume_passes_a_later_result_in():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    async def handler():
        return await fut + 1

    coro, waiting = await _started(handler())
    assert waiting is fut
    task = asyncio.create_task(_resume(coro, waiting))
    await asyncio.sleep(0)  # the task now waits on the future the handler yielded
    assert not task.done()
    fut.set_result(41)
    assert await task == 42


async def test_resume_waits_on_a_worker_thread_and_a_bare_yield():
    release = asyncio.Event()

    async def handler():
        await asyncio.sleep(0)  # yields None
        got = await asyncio.to_thread(lambda: 7)
        await release.wait()
        return got * 2

    coro, waiting = await _started(handler())
    assert waiting is None
    task = asyncio.create_task(_resume(coro, waiting))
    await eventually(lambda: bool(release._waiters))  # past the thread, waiting on the event
    release.set()
    assert await task == 14


async def test_resume_raises_the_awaited_error_inside_the_handler():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    async def handler():
        try:
            await fut
        except KeyError as exc:
            return f"caught {exc.args[0]}"
        return "no error"

    coro, waiting = await _started(handler())
    task = asyncio.create_task(_resume(coro, waiting))
    await asyncio.sleep(0)
    fut.set_exception(KeyError("k"))
    assert await task == "caught k"


async def test_resume_cancels_the_handler_with_its_task():
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    cleaned = []

    async def handler():
        try:
            await fut
        finally:
            cleaned.append(True)

    coro, waiting = await _started(handler())
    task = asyncio.create_task(_resume(coro, waiting))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == [True] and fut.cancelled()


async def test_answers_a_peer_does_not_read_stop_the_reading(tmp_path):
    n = 40_000  # ~1 MiB of pings and of answers: far more than a unix socket's buffer holds unread
    async with open_plane(tmp_path, max_inflight=4) as p:
        peer = await p.connect(p.unix, token=TOKEN)
        (conn,) = p.plane._conns
        sending = asyncio.create_task(peer.send_bytes(
            b"".join(fr.encode_frame_bytes({"op": "ping", "id": i}) for i in range(1, n + 1))))
        # Nothing read: the answers fill the socket, then wait for it, and so does the reading.
        await eventually(lambda: conn._writers > 0 and conn._write_lock.locked() and len(conn._tasks) >= 4)
        # Stalled with requests unread: in the stream's buffer (it reads ahead up to its
        # limit, 4 MiB, so the peer's sending may well be done) or still in the socket.
        assert conn.reader.buffered > 0 or not sending.done()
        assert len(conn._tasks) <= 4 + 1  # max_inflight, and the writer draining
        assert conn._transport.get_write_buffer_size() < 1 << 10  # a frame at most, not the answers
        replies = await asyncio.to_thread(lambda: [peer.raw.recv() for _ in range(n)])
        await sending
        assert sorted(r.id for r in replies) == list(range(1, n + 1))
        assert {r.header["err"]["code"] for r in replies if not r.header["ok"]} <= {"busy"}
        assert (await peer.call("ping")).header["ok"]
