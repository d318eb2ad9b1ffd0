"""An asyncio data-plane connection: many requests in flight, matched to responses by id.

::

    call() ──frame(id=n)──► writer          reader task ──► pending[n].set_result(frame)
       └──────── await future[n] ◄───────────────┘

The hello runs on the raw socket before the streams take it over, because asyncio's streams
cannot receive descriptors: on a unix socket the first bytes of the hello response are read with
``recvmsg`` (``socket.recv_fds``), which also receives the segment descriptors (SPEC.md §7.4).
Frames are read by :func:`kvtier_protocol.frame_stream.read_frame` (large payloads received in place into
reused buffers) and written as their header and payload buffers in one ``writelines`` where the
transport sends them as they are (uvloop, Python 3.12+: ``writev``, nothing copied); on Python
3.11's own transport, which would join them, large frames go out slice by slice, never joined. When the connection
breaks, every waiting call fails with :class:`ConnectionLost` and the segments are unmapped. A
call cancelled after the daemon granted it a lease (acquire, reserve) gets that lease released,
so an abandoned request does not pin blocks until the lease expires.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import socket
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.errors import FrameError, KVTierError, ProtocolError
from kvtier_protocol.frames import (DEFAULT_LIMITS, Buffer, Frame, FrameDecoder, Response, encode_frame,
                                    encode_frame_bytes, parse_response, raise_for_error)

from kvtier_protocol.buffers import PayloadBuffers
from kvtier_protocol.address import Address
from kvtier.client.errors import ConnectionLost, TimedOut, Unreachable
from kvtier.client.behind import LateErrors
from kvtier.client.steps import IO, Call, Receive, Send, granted_lease
from kvtier.client.options import ClientOptions
from kvtier.client.session import MAX_FDS, Session, hangup_probe, hello_keys, open_session, release_keys
from kvtier_protocol.frame_stream import FrameStream, read_frame, writes_gathered

_FIRST_READ = 64 << 10
STREAM_LIMIT = 4 << 20  # bytes received ahead of the reader before reading pauses
JOIN_WRITE_BYTES = 1 << 20  # frames up to this size are written as one joined buffer (where writelines joins)
WRITE_SLICE_BYTES = 1 << 20
"""Larger frames are handed to the transport this much at a time, each slice once the previous
one left the transport's buffer. asyncio's transport sends what the socket takes at once and
copies the rest into one growing bytearray: a 64 MiB put frame written whole cost ~35 ms of
``bytearray.extend`` (reallocations and fresh pages), half the async client's TCP put time. Slices
keep that buffer small and the copy to what the socket did not take straight away."""
PAYLOAD_KEEP_BYTES = 256 << 20  # most bytes of large-payload buffers a connection keeps


def _fresh(exc: BaseException) -> BaseException:
    """A new instance of ``exc``'s error for each waiter (one instance shared by many tasks would
    collect all their tracebacks)."""
    return type(exc)(exc.message) if isinstance(exc, KVTierError) else ConnectionLost(str(exc))


async def _recv_fds(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[bytes, list[int]]:
    while True:
        try:
            data, fds, flags, _ = socket.recv_fds(sock, _FIRST_READ, MAX_FDS)
        except BlockingIOError:
            ready = loop.create_future()
            loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
            try:
                await ready
            finally:
                loop.remove_reader(sock.fileno())
            continue
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError("segment descriptors of the hello response were truncated")
        return data, fds


async def _unix_hello(address: Address, hello: bytes) -> tuple[socket.socket, Frame, list[int]]:
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    fds: list[int] = []
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, address.path)
        await loop.sock_sendall(sock, hello)
        data, fds = await _recv_fds(loop, sock)
        decoder = FrameDecoder(DEFAULT_LIMITS)
        frames = decoder.feed(data)
        while not frames:
            if not data:
                raise ConnectionLost(f"daemon at {address} closed the connection during hello")
            data = await loop.sock_recv(sock, _FIRST_READ)
            frames = decoder.feed(data)
        if len(frames) > 1 or decoder.buffered:
            raise FrameError("the daemon sent more than the hello response before the first request")
        return sock, frames[0], fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        sock.close()
        raise


@dataclass(frozen=True, slots=True)
class Sent:
    """A request on the wire: its op and the future of its answer frame."""

    op: str
    future: asyncio.Future[Frame]


class AsyncConnection:
    """One connection after a successful hello. Create with :meth:`open`."""

    def __init__(self, reader: FrameStream, writer: asyncio.StreamWriter, session: Session,
                 address: Address) -> None:
        self.session = session
        self._reader, self._writer, self._address = reader, writer, address
        self._buffers = PayloadBuffers(PAYLOAD_KEEP_BYTES)
        self._ids = itertools.count(2)  # 1 was the hello
        self._pending: dict[int, tuple[str, asyncio.Future[Frame]] | None] = {}
        self._slots = asyncio.Semaphore(session.limits.max_inflight)
        self._error: BaseException | None = None
        self._kept: list[Sent] = []  # write-behind commits whose answers are claimed later, oldest first
        self.late = LateErrors()  # what became of refused or lost write-behind commits
        # Held while a frame goes out in slices (awaiting between them), so that no other frame's
        # bytes land inside it; frames written in one go take it only when it is free.
        self._writing = asyncio.Lock()
        self._held_back: list[list[Buffer]] = []  # release frames that came up during such a frame
        # writelines sends the caller's buffers as they are (nothing joined, nothing copied)?
        self._gathers = writes_gathered(writer.transport)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def open(cls, address: Address, options: ClientOptions) -> AsyncConnection:
        """Connect and say hello within ``options.connect_timeout_s``.

        Raises:
            TimedOut, Unreachable, ConnectionLost: the daemon is silent, unreachable, or hung up.
            Unauthorized, UnsupportedVersion: the daemon refused the hello.
        """
        hello = encode_frame_bytes({"op": "hello", "id": 1, **hello_keys(options)})
        loop = asyncio.get_running_loop()
        writer: asyncio.StreamWriter | None = None
        try:
            async with asyncio.timeout(options.connect_timeout_s):
                if address.is_unix:
                    sock, frame, fds = await _unix_hello(address, hello)
                    try:
                        response = parse_response("hello", frame, limits=DEFAULT_LIMITS)
                        _, reader = await loop.create_unix_connection(lambda: FrameStream(STREAM_LIMIT), sock=sock)
                        writer = reader.writer
                    except BaseException:
                        for fd in fds:
                            os.close(fd)
                        sock.close()
                        raise
                else:
                    fds = []
                    _, reader = await loop.create_connection(lambda: FrameStream(STREAM_LIMIT),
                                                             address.host, address.port)
                    writer = reader.writer
                    assert writer is not None, "made with the transport"
                    writer.write(hello)
                    await writer.drain()
                    frame = await read_frame(reader, DEFAULT_LIMITS, PayloadBuffers(0))
                    if frame is None:
                        raise ConnectionLost(f"daemon at {address} closed the connection during hello")
                    response = parse_response("hello", frame, limits=DEFAULT_LIMITS)
                session = open_session(response, fds, options)  # type: ignore[arg-type]
                if session.grants is not None:  # slots held across calls: check the daemon before copying
                    transport = writer.transport
                    session.peer_gone = hangup_probe(transport.get_extra_info("socket").fileno(), transport.is_closing)
        except BaseException as exc:
            if writer is not None:
                writer.transport.abort()
            if isinstance(exc, TimeoutError):
                raise TimedOut(f"no hello answer from {address} within "
                               f"{options.connect_timeout_s}s") from None
            if isinstance(exc, OSError):
                raise Unreachable(f"cannot connect to {address}: {exc}") from exc
            if isinstance(exc, asyncio.IncompleteReadError):
                raise ConnectionLost(f"daemon at {address} closed the connection during hello") from exc
            raise
        assert writer is not None
        return cls(reader, writer, session, address)

    @property
    def closed(self) -> bool:
        """True once the connection broke or was closed."""
        return self._error is not None

    @property
    def kept(self) -> int:
        """Write-behind commits whose answers are still to be claimed."""
        return len(self._kept)

    def keep(self, sent: Sent) -> None:
        """Claim the answer of write-behind commit ``sent`` later, in :meth:`settle`."""
        if self._error is None:
            self._kept.append(sent)

    async def settle(self, keep_last: int = 0) -> None:
        """Claim the answers of the kept commits, all but the newest ``keep_last``; a refused
        one is recorded in :attr:`late`.

        Raises:
            ConnectionLost: the connection broke (the commits not answered are recorded in
                :attr:`late` as unknown).
        """
        while len(self._kept) > keep_last:
            sent = self._kept.pop(0)
            try:
                await self.receive(sent)
            except KVTierError as exc:
                broken = self._error is not None  # else the daemon refused this commit, the stream is fine
                self.late.answer_failed(exc, broken=broken, after=len(self._kept))
                if broken:
                    self._kept.clear()
                    raise

    async def perform(self, io: IO) -> tuple[Any, KVTierError | None]:
        """One I/O a flow's run asks for (kvtier.client.steps.FlowRun), done: ``(its result,
        None)``, or ``(None, the error)`` for the run to take in."""
        try:
            if isinstance(io, Receive):
                return await self.receive(io.handle), None
            if isinstance(io, Send):
                return await self.send(io.call), None
            await self.settle(io.keep_last)
        except KVTierError as exc:
            return None, exc
        return None, None

    def finish(self, keep: list[Sent], forget: list[Sent]) -> None:
        """After a flow: claim the answers of ``keep`` later (write-behind commits); drop those
        of ``forget``, releasing the leases they grant."""
        for sent in keep:
            self.keep(sent)
        for sent in forget:
            self.forget(sent)

    async def call(self, call: Call) -> Response:
        """Send one request and await its typed response.

        Raises:
            ConnectionLost: the connection broke (before or while waiting).
            KVTierError: the error the daemon answered, or a malformed response.
        """
        return await self.receive(await self.send(call))

    async def send(self, call: Call) -> Sent:
        """Send one request (once one of ``max_inflight`` places is free); returns the handle
        to :meth:`receive` or :meth:`forget` its answer. Waits for room in the socket buffer only
        for requests that are waited for (``call.wait``): the others are small.

        Raises:
            ConnectionLost: the connection is broken.
        """
        if call.op == "release" and not call.wait and self.session.quiet_release:  # nothing waits for it
            return self._send_quiet(call.keys["lease"])
        await self._slots.acquire()
        try:
            if self._error is not None:
                raise _fresh(self._error)
            ident = next(self._ids)
            buffers = encode_frame({"op": call.op, "id": ident, **call.keys}, call.payload,
                                   limits=self.session.limits)
        except BaseException:
            self._slots.release()
            raise
        future: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: self._slots.release())  # answered, failed or cancelled
        self._pending[ident] = (call.op, future)
        sent = Sent(call.op, future)
        try:
            async with self._writing:
                if self._gathers or sum(len(b) for b in buffers) <= JOIN_WRITE_BYTES:
                    self._writer.writelines(buffers)
                else:  # Python 3.11's writelines joins its buffers: a copy of the whole payload
                    await self._write_sliced(buffers)
            if call.wait:
                await self._writer.drain()
        except OSError as exc:
            self.abort(ConnectionLost(f"connection to {self._address} broke: {exc}"))
        except asyncio.CancelledError:
            self.forget(sent)
            raise
        return sent

    def _send_quiet(self, lease: int) -> Sent:
        """A quiet release (SPEC 7.4): written with nothing to wait for, no place in flight taken.
        Its handle is done already, with nothing to claim; forgetting it is a no-op."""
        if self._error is not None:
            raise _fresh(self._error)
        self._write_unwaited(encode_frame({"op": "release", "id": next(self._ids), **release_keys(self.session, lease)}))
        future: asyncio.Future[Frame | None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return Sent("release", future)  # type: ignore[arg-type]

    async def _write_sliced(self, buffers: list[Buffer]) -> None:
        """Write one large frame :data:`WRITE_SLICE_BYTES` at a time (under ``_writing``). A
        frame cut short (cancelled, or the connection broke) leaves the stream mid-frame, so the
        connection is aborted then: the daemon sees a closed connection, never a torn frame."""
        writer = self._writer
        done = False
        try:
            for buf in buffers:
                with memoryview(buf) as raw, raw.cast("B") as view:  # slices of bytes, whatever the format
                    for start in range(0, len(view), WRITE_SLICE_BYTES):
                        writer.write(view[start:start + WRITE_SLICE_BYTES])
                        if writer.transport.get_write_buffer_size():
                            await writer.drain()
            done = True
            for frame in self._held_back:
                writer.writelines(frame)
            self._held_back.clear()
        finally:
            if not done:
                self.abort(ConnectionLost(f"a request to {self._address} was cut short mid-frame"))

    async def receive(self, sent: Sent) -> Response:
        """The typed response of a request :meth:`send` sent (each once).

        Raises:
            As :meth:`call`.
        """
        future = sent.future
        try:
            frame = await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._abandoned(sent.op, future.result())
            raise
        assert frame is not None, "a quiet release has no answer: nothing waits for one"
        raise_for_error(frame.header)
        try:
            return parse_response(sent.op, frame, limits=self.session.limits)
        except KVTierError as exc:
            self.abort(exc)  # the daemon broke the schema: do not trust the stream any more
            raise

    def forget(self, sent: Sent) -> None:
        """Never claim the answer of ``sent``: it is dropped, and a lease it grants released."""
        future = sent.future
        if not future.done():
            future.cancel()  # the reader finds it done and hands the answer to _abandoned
        elif not future.cancelled() and future.exception() is None and future.result() is not None:
            self._abandoned(sent.op, future.result())

    def _abandoned(self, op: str, frame: Frame) -> None:
        """Release the lease of a response nobody waits for any more."""
        lease = granted_lease(op, frame.header)
        if lease:
            if self._error is None:
                ident = next(self._ids)
                if not self.session.quiet_release:
                    self._pending[ident] = None  # its answer is read and dropped
                self._write_unwaited(encode_frame({"op": "release", "id": ident, **release_keys(self.session, lease)}))

    def _write_unwaited(self, frame: list[Buffer]) -> None:
        """Write a small frame nothing waits to send (a release): at once, or after the large
        frame going out in slices (under ``_writing``), never inside it."""
        if self._writing.locked():
            self._held_back.append(frame)
        else:
            self._writer.writelines(frame)

    async def _read_loop(self) -> None:
        error: BaseException = ConnectionLost(f"daemon at {self._address} closed the connection")
        try:
            while True:
                frame = await read_frame(self._reader, self.session.limits, self._buffers)
                if frame is None:
                    break
                entry = self._pending.pop(frame.id, False)
                if entry is False:
                    if frame.id == 0:  # a connection-level error; the daemon closes after it
                        raise_for_error(frame.header)
                    raise FrameError(f"response id {frame.id} answers no request in flight")
                if entry is None:
                    continue
                op, future = entry
                if future.done():
                    self._abandoned(op, frame)
                else:
                    future.set_result(frame)
        except (OSError, asyncio.IncompleteReadError) as exc:
            error = ConnectionLost(f"connection to {self._address} broke: {exc}")
        except ProtocolError as exc:
            # Truncated (the stream ended inside a frame) is a lost connection; others are a
            # broken daemon, reported as they are
            error = ConnectionLost(exc.message) if exc.code == "truncated" else exc
        except KVTierError as exc:
            error = exc
        finally:
            self.abort(error)

    def abort(self, error: BaseException) -> None:
        """Break the connection: fail every waiting call with ``error``, close, unmap (idempotent)."""
        if self._error is not None:
            return
        self._error = error
        if self._kept:  # answers nobody will claim now: those commits may or may not have landed
            lost = _fresh(error)
            assert isinstance(lost, KVTierError), "_fresh makes kvtier errors"
            self.late.lost(lost, len(self._kept))
            self._kept.clear()
        pending, self._pending = self._pending, {}
        for entry in pending.values():
            if entry is not None and not entry[1].done():
                entry[1].set_exception(_fresh(error))
        # abort, not close: close would wait to flush what a stuck daemon never reads
        self._writer.transport.abort()
        self.session.close()
        self._buffers.close()
        if self._task is not asyncio.current_task():
            self._task.cancel()

    async def close(self) -> None:
        """Close the connection and wait for its reader to end."""
        self.abort(ConnectionLost(f"connection to {self._address} is closed"))
        await asyncio.gather(self._task, return_exceptions=True)
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # the peer was gone already: closed is closed

