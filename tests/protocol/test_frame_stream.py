"""protocol/kvtier_protocol/frame_stream.py: the reading end of a data-plane connection over real connected sockets (a socketpair
accepted by the running loop, as the listener's connections are): small reads out of the scratch
buffer, payloads received in place, flow control, and the ways a stream ends."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvtier_protocol.buffers import PayloadBuffers
from kvtier_protocol.frame_stream import (IN_PLACE_PAYLOAD_BYTES, POOLED_PAYLOAD_BYTES, SCRATCH_BYTES,
                                          WOKEN_READ_AHEAD_BYTES, FrameStream, read_frame)
from kvtier_protocol import frames as fr
from kvtier_protocol.errors import Truncated

LIMIT = 256 << 10


@asynccontextmanager
async def stream_pair() -> AsyncIterator[tuple[FrameStream, asyncio.StreamWriter, socket.socket]]:
    """A FrameStream on one end of a socketpair, and the other end (blocking) for the test."""
    ours, theirs = socket.socketpair()
    made: asyncio.Future[tuple[FrameStream, asyncio.StreamWriter]] = asyncio.get_running_loop().create_future()

    async def on_connect(stream: FrameStream, writer: asyncio.StreamWriter) -> None:
        made.set_result((stream, writer))

    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(lambda: FrameStream(LIMIT, on_connect), ours)
    stream, writer = await made
    try:
        yield stream, writer, theirs
    finally:
        writer.close()
        theirs.close()


async def _send(sock: socket.socket, data: bytes) -> None:
    await asyncio.to_thread(sock.sendall, data)


async def test_small_reads_come_out_of_the_buffer_across_arrivals() -> None:
    async with stream_pair() as (stream, _, peer):
        await _send(peer, b"abc")
        read = asyncio.create_task(stream.readexactly(5))
        await asyncio.sleep(0.01)
        assert not read.done()  # waits for the rest
        await _send(peer, b"defgh")
        assert await read == b"abcde"
        assert await stream.readexactly(3) == b"fgh"


async def test_a_payload_is_received_in_place_after_what_was_buffered_ahead() -> None:
    payload = os.urandom(3 * SCRATCH_BYTES + 17)
    async with stream_pair() as (stream, _, peer):
        sender = asyncio.create_task(_send(peer, b"HEAD" + payload + b"NEXT"))
        assert await stream.readexactly(4) == b"HEAD"
        body = bytearray(len(payload))
        await stream.read_into(memoryview(body))
        assert body == payload
        assert await stream.readexactly(4) == b"NEXT"  # the next frame's bytes were not swallowed
        await sender


async def test_read_now_takes_only_what_is_buffered() -> None:
    async with stream_pair() as (stream, _, peer):
        assert stream.read_now(1) is None  # nothing yet: nothing consumed, no wait
        await _send(peer, b"abcdef")
        assert await stream.readexactly(1) == b"a"  # "bcdef" buffered by now, one arrival
        assert stream.read_now(6) is None
        assert stream.read_now(2) == b"bc"
        assert stream.read_now(0) == b""
        assert stream.buffered == 3
        assert await stream.readexactly(3) == b"def"


async def test_read_now_resumes_a_paused_transport() -> None:
    data = os.urandom(2 * LIMIT)
    async with stream_pair() as (stream, _, peer):
        sending = asyncio.create_task(_send(peer, data))
        received = bytearray(await stream.readexactly(1))
        while stream.buffered <= LIMIT:  # until reading pauses, the limit exceeded
            await asyncio.sleep(0.001)
        # Drained by read_now: were the transport left paused, the wait on an empty buffer
        # would never end (the guard turns that into a failure).
        async with asyncio.timeout(60):
            while len(received) < len(data):
                received += stream.read_now(stream.buffered) if stream.buffered else await stream.readexactly(1)
        await sending
        assert received == data


async def test_a_payload_bigger_than_the_limit_while_the_reader_is_slow() -> None:
    payload = os.urandom(8 * LIMIT)
    async with stream_pair() as (stream, _, peer):
        sender = asyncio.create_task(_send(peer, payload))
        await asyncio.sleep(0.05)  # the reader is late: reading pauses past LIMIT buffered
        assert len(stream._buf) <= LIMIT + SCRATCH_BYTES
        body = bytearray(len(payload))
        await stream.read_into(memoryview(body))  # resumes, receives the rest in place
        assert body == payload
        await sender


def test_a_woken_reader_finds_little_read_ahead_and_the_rest_lands_in_place() -> None:
    # On uvloop, as the daemon runs: libuv reads a readable socket again and again in one
    # callback (up to 32 receives) before the woken reader runs, where asyncio's loop reads once.
    uvloop = pytest.importorskip("uvloop")
    # Fits the socket's send buffer (sent below without the loop running), and is more than the
    # woken reader's read-ahead plus one receive.
    payload = os.urandom(2 * SCRATCH_BYTES + (32 << 10))

    async def main() -> None:
        async with stream_pair() as (stream, _, peer):
            async def reader() -> tuple[bytes, int, bytearray]:
                head = await stream.readexactly(4)
                found = stream.buffered  # as the daemon's read loop finds it, about to read in place
                body = bytearray(len(payload))
                await stream.read_into(memoryview(body))
                return head, found, body

            reading = asyncio.create_task(reader())
            await asyncio.sleep(0)  # the reader waits for its bytes
            peer.sendall(b"HEAD" + payload)  # all of it in the socket before the loop reads any
            head, found, body = await reading
            # Reading paused once the woken reader was a little behind (without the pause, every
            # byte would have been buffered); the rest was received in place.
            assert head == b"HEAD" and found <= WOKEN_READ_AHEAD_BYTES + SCRATCH_BYTES
            assert body == payload

    uvloop.run(main())


async def test_a_read_longer_than_the_woken_read_ahead_completes() -> None:
    data = os.urandom(4 * WOKEN_READ_AHEAD_BYTES + 5)  # a large header: read through the pauses
    async with stream_pair() as (stream, _, peer):
        sender = asyncio.create_task(_send(peer, data))
        async with asyncio.timeout(60):
            assert await stream.readexactly(len(data)) == data
        await sender


async def test_a_stream_ending_inside_a_read_is_an_incomplete_read() -> None:
    async with stream_pair() as (stream, _, peer):
        await _send(peer, b"12")
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await stream.readexactly(4)
        assert info.value.partial == b"12"
    async with stream_pair() as (stream, _, peer):
        await _send(peer, b"x" * 1000)
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(asyncio.IncompleteReadError):
            await stream.read_into(memoryview(bytearray(SCRATCH_BYTES * 2)))
    async with stream_pair() as (stream, _, peer):
        peer.shutdown(socket.SHUT_WR)
        with pytest.raises(asyncio.IncompleteReadError) as info:
            await stream.readexactly(1)
        assert info.value.partial == b""  # ended between frames


async def test_a_reset_connection_raises_its_error() -> None:
    async with stream_pair() as (stream, _, peer):
        read = asyncio.create_task(stream.read_into(memoryview(bytearray(1 << 20))))
        await _send(peer, b"partial")
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        peer.close()  # RST (linger 0): on a unix socketpair an ordinary close
        with pytest.raises((ConnectionError, asyncio.IncompleteReadError)):
            await read


async def test_the_writer_writes_and_drains_through_the_same_transport() -> None:
    async with stream_pair() as (stream, writer, peer):
        big = os.urandom(4 << 20)  # more than the socket buffers: drain waits for the reader
        writer.write(big)
        received = asyncio.create_task(asyncio.to_thread(_recv_all, peer, len(big)))
        await writer.drain()
        assert await received == big
        writer.close()
        await writer.wait_closed()


def _recv_all(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        assert chunk, "closed early"
        out += chunk
    return bytes(out)


async def test_read_frame_takes_small_payloads_as_they_come_and_large_ones_in_place() -> None:
    big = os.urandom(POOLED_PAYLOAD_BYTES + 5)
    frames = [fr.encode_frame_bytes({"op": "ping", "id": 1}),
              fr.encode_frame_bytes({"op": "put", "id": 2}, b"small"),
              fr.encode_frame_bytes({"op": "put", "id": 3}, big)]
    limits = fr.Limits(max_payload_len=1 << 30)
    pool = PayloadBuffers(keep_bytes=16 << 20)
    async with stream_pair() as (stream, _, peer):
        sender = asyncio.create_task(_send(peer, b"".join(frames)))  # more than the socket buffers
        got = [await read_frame(stream, limits, pool) for _ in frames]
        await sender
        assert [f.header["id"] for f in got] == [1, 2, 3]
        assert got[0].payload is None and bytes(got[1].payload) == b"small" and bytes(got[2].payload) == big
        assert pool.made == 1  # only the large one took a pooled buffer
        sender = asyncio.create_task(_send(peer, frames[2][:-7]))
        with pytest.raises(Truncated):
            await asyncio.gather(read_frame(stream, limits, pool), _shut_after(sender, peer))
        assert bytes(got[2].payload) == big  # the earlier frame's buffer was not handed out again


async def _shut_after(sender: asyncio.Task[None], sock: socket.socket) -> None:
    await sender
    sock.shutdown(socket.SHUT_WR)


async def test_payloads_above_a_few_pages_are_received_in_place_and_their_buffers_reused() -> None:
    """A 512 KiB payload (two 256 KiB blocks) below POOLED_PAYLOAD_BYTES is received straight
    into a buffer of the pool, not read out of the scratch buffer; the next frames of that size
    reuse it once the last one's views are gone. At the threshold it is still read as it comes."""
    mid = [os.urandom(512 << 10) for _ in range(3)]
    edge = os.urandom(IN_PLACE_PAYLOAD_BYTES)
    frames = [fr.encode_frame_bytes({"op": "put", "id": i}, p) for i, p in enumerate(mid, 1)]
    frames.append(fr.encode_frame_bytes({"op": "put", "id": 4}, edge))
    limits = fr.Limits(max_payload_len=1 << 30)
    pool = PayloadBuffers(keep_bytes=16 << 20)
    async with stream_pair() as (stream, _, peer):
        sender = asyncio.create_task(_send(peer, b"".join(frames)))  # more than the socket buffers
        for i, payload in enumerate(mid, 1):
            frame = await read_frame(stream, limits, pool)
            assert frame is not None and frame.header["id"] == i and bytes(frame.payload) == payload
            frame = None  # its buffer is free for the next frame
        last = await read_frame(stream, limits, pool)
        await sender
        assert last is not None and bytes(last.payload) == edge
        assert (pool.made, pool.reused) == (1, 2)  # one buffer for the three, none for the last
