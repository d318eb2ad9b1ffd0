"""The byte stream of one data-plane connection: frame payloads read straight into their buffers.

Used by the daemon (every connection, kvtier.daemon.server.connection) and by the asyncio client
(kvtier.client.aio_transport). Stdlib and kvtier_protocol only.

asyncio's ``StreamReader`` copies every byte it receives three times before a frame has it: into
the transport's read buffer, onto the end of its own ``bytearray``, and out again per ``read``.
For the small parts of a frame (preamble, header map) that does not matter; for inline payloads
(TCP ``put``: up to 256 MiB of records) it cost more than everything else the daemon does with
them (``kvtier bench dataplane``: ``tcp put`` at 0.07x memcpy, py-spy: 80 % of the event loop in
``feed_data``/``read``). :class:`FrameStream` is an :class:`asyncio.BufferedProtocol`: the
transport receives into a buffer the protocol hands out, which is, while a payload is being
read, that payload's own buffer::

    socket ──recv_into──► scratch (64 KiB) ──► small reads (preamble, header)     readexactly()
           └─recv_into──► payload buffer, in place, until it is full              read_into()

The writing side is an ordinary :class:`asyncio.StreamWriter` over the same transport (the
protocol provides its flow control). Where the transport sends a list of buffers as they are
(:func:`writes_gathered`: uvloop's, and asyncio's from Python 3.12), a frame's header and payload
buffers are handed over in one ``writelines`` and nothing is copied; Python 3.11's own transport
joins them, so its writers write large frames buffer by buffer instead.
"""

from __future__ import annotations

import asyncio
import collections
import sys
from collections.abc import Callable
from typing import Any

from kvtier_protocol.frames import Frame, Limits
from kvtier_protocol.frames import read_frame as _read_frame

from kvtier_protocol.buffers import POOLED_PAYLOAD_BYTES, PayloadBuffers

SCRATCH_BYTES = 64 << 10
"""Receive buffer for everything but payloads being read in place."""
WOKEN_READ_AHEAD_BYTES = 64 << 10
"""Bytes buffered, once the reader has been woken and before it runs, after which reading pauses
until it reads (:meth:`FrameStream.buffer_updated`): what follows a frame header then lands in
place, and a woken reader is never behind by more than about this plus one receive."""
IN_PLACE_PAYLOAD_BYTES = 64 << 10
"""Payloads above this are received in place (:func:`read_payload`). Read out of the scratch
buffer instead, a payload is copied three times in Python (onto the end of the buffered bytes,
out as a slice, into ``bytes``) and the reader is woken for every 64 KiB that arrives: a
512 KiB payload (a put of two 256 KiB blocks) cost the reading thread ~165 us that way against
~135 us in place, of which the kernel's copy is most (uvloop, socketpair, this project's 2-core
VM). Payloads up to :data:`~kvtier_protocol.buffers.POOLED_PAYLOAD_BYTES` use the pool too: a
mapping of it is reused as it is, where a fresh ``bytearray`` would be zeroed first."""
_NO_SCRATCH = memoryview(bytearray())  # a released stream's: it receives nothing any more


class FrameStream(asyncio.BufferedProtocol):
    """Reading end (``readexactly``, ``read_into``) and flow control of one connection.

    Args:
        limit: bytes buffered beyond what the reader asked for before the transport is paused.
        on_connect: called with ``(stream, writer)`` once the transport is made (the daemon's
            listener: it starts the connection's task, to which the protocol keeps a reference).

    Attributes:
        writer: the writing end, once the transport is made.
    """

    def __init__(self, limit: int,
                 on_connect: Callable[[FrameStream, asyncio.StreamWriter], Any] | None = None) -> None:
        self._limit = limit
        self._on_connect = on_connect
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._buf = bytearray()  # received, not yet read
        self._scratch = memoryview(bytearray(SCRATCH_BYTES))
        self._target: memoryview | None = None  # the payload buffer being filled in place
        self._filled = 0
        self._waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self._read_paused = False
        self._write_paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = self._loop.create_future()
        self.task: asyncio.Task[Any] | None = None
        self.writer: asyncio.StreamWriter | None = None

    # --- protocol callbacks ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport subclasses
        self.writer = asyncio.StreamWriter(transport, self, None, self._loop)  # type: ignore[arg-type]
        if self._on_connect is not None:
            self.task = self._loop.create_task(self._on_connect(self, self.writer))

    @property
    def limit(self) -> int:
        """Bytes buffered ahead of the reader before the transport is paused."""
        return self._limit

    def set_limit(self, limit: int) -> None:
        """Change :attr:`limit` (the daemon: small until the hello succeeds, then the full one)."""
        assert limit > 0, "a byte count"
        self._limit = limit
        if len(self._buf) > limit and not self._read_paused and self._transport is not None:
            self._read_paused = True
            self._transport.pause_reading()
        self._maybe_resume()

    @property
    def buffered(self) -> int:
        """Bytes received and not yet read (the payload being filled in place not counted)."""
        return len(self._buf)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._target is not None:
            return self._target[self._filled:]
        return self._scratch

    def buffer_updated(self, nbytes: int) -> None:
        if self._target is not None:
            self._filled += nbytes
            if self._filled == len(self._target):
                self._target = None  # full: what comes next (the next frame) goes to the scratch
                self._wake()
            return
        self._buf += self._scratch[:nbytes]
        self._wake()
        if self._read_paused or self._transport is None:
            return
        # A reader woken already and not yet run (its waiter is still set) may be about to read a
        # payload in place (read_into): pause now rather than buffer more of it here, where each
        # byte is copied twice more and the buffer grows into fresh pages (a 4 MiB put's payload
        # read ahead whole cost the daemon ~4x the bytes' copy). The reader resumes as it reads.
        if len(self._buf) > self._limit or (self._waiter is not None and len(self._buf) > WOKEN_READ_AHEAD_BYTES):
            self._read_paused = True
            self._transport.pause_reading()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return False  # close the transport

    def connection_lost(self, exc: BaseException | None) -> None:
        self._eof = True
        if exc is not None:
            self._error = exc
        self._wake()
        for waiter in self._drain_waiters:
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)

    # --- what asyncio.StreamWriter asks of its protocol ------------------------------------------

    async def _drain_helper(self) -> None:
        if self._closed.done():
            raise ConnectionResetError("Connection lost")
        if not self._write_paused:
            return
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        try:
            await waiter
        finally:
            self._drain_waiters.remove(waiter)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed

    # --- reading ---------------------------------------------------------------------------------

    async def readexactly(self, n: int) -> bytes:
        """The next ``n`` bytes.

        Raises:
            asyncio.IncompleteReadError: the stream ended first (``partial`` holds what came).
            ConnectionError: the connection broke.
        """
        while len(self._buf) < n:
            if self._error is not None:
                raise self._error
            if self._eof:
                partial = bytes(self._buf)
                self._buf.clear()
                raise asyncio.IncompleteReadError(partial, n)
            await self._wait()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        self._maybe_resume()
        return data

    def read_now(self, n: int) -> bytes | None:
        """The next ``n`` bytes if they are buffered already, else None (nothing consumed): what
        :meth:`readexactly` returns without waiting, without a coroutine per call (a frame's
        preamble and header usually arrive together, often with the frames after them)."""
        buf = self._buf
        if len(buf) < n:
            return None
        data = bytes(buf[:n])
        del buf[:n]
        if self._read_paused:
            self._maybe_resume()
        return data

    async def read_into(self, view: memoryview) -> None:
        """Fill ``view`` with the next ``len(view)`` bytes: what is buffered already, then the
        rest received by the transport straight into ``view``.

        Raises:
            asyncio.IncompleteReadError: the stream ended first.
            ConnectionError: the connection broke.
        """
        n = len(view)
        have = min(n, len(self._buf))
        if have:
            with memoryview(self._buf) as buffered:  # no slice copy; released before the del
                view[:have] = buffered[:have]
            del self._buf[:have]
        if have == n:
            self._maybe_resume()
            return
        assert not self._buf, "everything buffered went into the view"
        self._target, self._filled = view, have
        try:
            if self._read_paused and self._transport is not None:
                self._read_paused = False
                self._transport.resume_reading()
            while self._filled < n:
                if self._error is not None:
                    raise self._error
                if self._eof:
                    raise asyncio.IncompleteReadError(b"", n)
                await self._wait()
        finally:
            self._target = None

    def release(self) -> None:
        """Let go of the connection's buffers and of the references that tie the protocol, its
        writer, its transport and its task into a cycle. For a caller that is done with the
        connection (the daemon, once it has served it): its objects are then freed by reference
        counting at once. Without it they wait for the cyclic collector, which skips what the
        daemon froze while it was alive (kvtier.daemon.server.collector): every closed
        connection kept its 64 KiB scratch buffer and more until the hourly full collection.
        What is buffered and the connection's end (EOF, error, close waiters) stay readable."""
        self._scratch = _NO_SCRATCH
        self._target = None
        self._transport = None
        self._on_connect = None
        self.task = None
        self.writer = None

    def exception(self) -> BaseException | None:
        """The error the connection broke with, if any."""
        return self._error

    async def _wait(self) -> None:
        assert self._waiter is None, "one reader at a time"
        self._maybe_resume()  # a reader that waits needs bytes: lift a pause made while it was woken
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _maybe_resume(self) -> None:
        if self._read_paused and len(self._buf) <= self._limit and self._transport is not None:
            self._read_paused = False
            self._transport.resume_reading()


def writes_gathered(transport: asyncio.BaseTransport) -> bool:
    """Whether ``transport.writelines`` hands its buffers to the socket as they are (``writev``;
    what the socket does not take at once is kept as views of them, nothing copied): uvloop's
    transports, and asyncio's from Python 3.12. Python 3.11's own joins them into one bytes
    object first: a copy of every payload written that way."""
    return type(transport).__module__.startswith("uvloop") or sys.version_info >= (3, 12)


async def read_frame(stream: FrameStream, limits: Limits, buffers: PayloadBuffers) -> Frame | None:
    """:func:`kvtier_protocol.frames.read_frame` on a :class:`FrameStream`: a payload above
    :data:`IN_PLACE_PAYLOAD_BYTES` is received in place into a buffer of ``buffers``, handed back
    at once (it is reused only once the frame's views of it are gone).

    Returns:
        The frame, or None when the stream ended cleanly before the first byte of a frame.

    Raises:
        Truncated: the stream ended inside a frame. ProtocolError: a malformed frame (lengths are
        checked before anything more is read). ConnectionError: the connection broke.
    """
    return await _read_frame(stream, limits, lambda n: read_payload(stream, n, buffers))  # type: ignore[arg-type]


async def read_payload(stream: FrameStream, n: int, buffers: PayloadBuffers) -> bytes | memoryview:
    """The next ``n`` bytes (a frame's payload): above :data:`IN_PLACE_PAYLOAD_BYTES` received in
    place into a view of ``buffers`` (:meth:`PayloadBuffers.view`), else read as they come.

    A new mapping is not populated: its pages are faulted in as bytes arrive, so memory grows
    with what the peer actually sends, not with the length it announced.

    Raises:
        asyncio.IncompleteReadError: the stream ended first. ConnectionError: it broke.
    """
    if n <= IN_PLACE_PAYLOAD_BYTES:
        return await stream.readexactly(n)
    body = buffers.view(n, populate=False)
    await stream.read_into(body)
    return body


__all__ = ["IN_PLACE_PAYLOAD_BYTES", "POOLED_PAYLOAD_BYTES", "SCRATCH_BYTES", "WOKEN_READ_AHEAD_BYTES", "FrameStream", "read_frame", "read_payload", "writes_gathered"]
