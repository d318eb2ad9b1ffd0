"""One data-plane connection: frames in, hello and descriptor passing, requests in flight, frames out.

::

    read loop ─► frame ─► before hello: served inline, one at a time
                       └► after hello:  a store call (grant, place, acquire, release, ...) is
                                        started in the read loop; one that finishes at once is
                                        answered there, straight to the transport when nothing
                                        is queued before it; one that waits goes on in a task;
                                        the others (put, get, delete, ...) get a task each
                                        (tasks: at most max_inflight, else `busy`)
    tasks ─► RequestHandler ─► response ─► write lock ─► socket     (responses in any order)

A frame that cannot be decoded leaves the stream out of sync: it is answered with an error whose
``id`` is 0 and the connection is closed (SPEC.md §7.1). A request that decodes but is wrong, or
fails, is answered with an error carrying its ``id``; the connection stays. When the connection
ends, for whatever reason, its in-flight requests finish and every lease it still holds is
released, so a client killed between reserve and commit leaves no visible block behind.

Payload bytes cross the process once each way and are never copied in Python: a put's payload is
received in place (:mod:`kvtier_protocol.frame_stream`), and a get's records are handed to the
transport as the leased slots themselves (``writev``; :func:`kvtier.daemon.server.inline.record_views`).
The transport's write buffer has a high-water mark of 0, so a write's drain returns once its last
byte is in the kernel; only then is the get's lease released (``Session.after_send``). A response
whose bytes cannot all leave (the peer stopped reading, shutdown) aborts the connection before
its lease is released: the slots' bytes are never sent once they may be reused.

Before its hello succeeds a connection is a stranger's, and costs the daemon next to nothing: it
must say hello within ``hello_timeout_s``, frames bigger than a hello (:data:`HELLO_MAX_BYTES`)
or with a payload close it, and its stream buffers at most :data:`HELLO_STREAM_LIMIT` ahead.
After the hello, a frame's payload is charged to the connection's and the daemon's byte budgets
(``max_connection_buffer_bytes``, ``max_buffer_bytes``) from its preamble until its request
ends; a frame that does not fit waits, unread, so the peer's sending stalls instead of the
daemon's memory growing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import time
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import (Busy, InvalidRequest, KVTierError, LimitExceeded, ProtocolError, Truncated,
                                    Unauthorized, UnsupportedVersion)

from kvtier_protocol.buffers import ByteBudget, PayloadBuffers
from kvtier.daemon.server.handlers import RequestHandler, Session
from kvtier_protocol.frame_stream import FrameStream, read_payload, writes_gathered
from kvtier.daemon.server.tenancy import hello_scope

if TYPE_CHECKING:
    from kvtier.daemon.server.auth import Auth
    from kvtier.daemon.server.context import DaemonContext

log = logging.getLogger(__name__)

MUTATING_OPS = ("delete", "clear")  # need the token over TCP (SPEC §7.4)
FDS_SEND_TIMEOUT_S = 5.0  # how long the hello response may wait for room in the socket buffer
_FEATURES = (fr.PLACE_GRANT, fr.QUIET_RELEASE)
"""What this daemon announces in its hello response (SPEC 7.4 ``features``)."""
JOIN_WRITE_BYTES = 1 << 20  # frames up to this size are written with one joined buffer (where writelines joins)
HELLO_MAX_BYTES = 16 << 10  # largest frame header before the hello (a hello: token <= 1 KiB, names)
HELLO_STREAM_LIMIT = 64 << 10  # bytes buffered ahead of the reader before the hello (then the full limit)
_serial = itertools.count(1)  # connection numbers, for logs


class Connection:
    """Serves one client until it leaves, misbehaves, idles out, or the data plane stops.

    Args:
        ctx: the daemon's shared state.
        handler: the operations.
        limits: the limits announced in hello and applied to every frame.
        reader, writer: the stream (payloads are read in place, :mod:`kvtier_protocol.frame_stream`).
        tcp: a TCP connection (else a unix socket one).
        idle_timeout_s: silence after which the connection is closed.
        buffers: the daemon's pool of inline payload buffers.
        hello_timeout_s: time from acceptance to a successful hello, else the connection is closed.
        budget: the daemon's byte budget for received payloads (shared by every connection).
        connection_budget_bytes: this connection's own budget for them.
        stream_limit: the stream's read-ahead once the hello succeeded.
        on_hello: called once the hello succeeded (the data plane counts unauthenticated
            connections).
    """

    def __init__(self, ctx: DaemonContext, handler: RequestHandler, limits: fr.Limits,
                 reader: FrameStream, writer: asyncio.StreamWriter, *, tcp: bool,
                 idle_timeout_s: float, socket_requires_token: bool, buffers: PayloadBuffers,
                 hello_timeout_s: float = 10.0, budget: ByteBudget | None = None,
                 connection_budget_bytes: int | None = None, stream_limit: int | None = None,
                 on_hello: Callable[[], None] | None = None) -> None:
        self.ctx = ctx
        self.auth: Auth = ctx.auth
        self.handler = handler
        self.limits = limits
        self.reader = reader
        self.writer = writer
        self.buffers = buffers
        self.session = Session(tcp=tcp)
        self.idle_timeout_s = idle_timeout_s
        self.hello_timeout_s = hello_timeout_s
        self.budget = budget if budget is not None else ByteBudget(limits.max_payload_len)
        self.own_budget = ByteBudget(max(connection_budget_bytes or limits.max_payload_len, limits.max_payload_len))
        self._stream_limit = stream_limit or reader.limit
        self._on_hello = on_hello
        # Until the hello: a hello's worth of header, no payload (nothing larger is buffered).
        self._hello_limits = fr.Limits(max_header_len=min(HELLO_MAX_BYTES, limits.max_header_len),
                                       max_payload_len=1, max_batch=limits.max_batch,
                                       max_lease_ms=limits.max_lease_ms, max_inflight=limits.max_inflight)
        reader.set_limit(min(HELLO_STREAM_LIMIT, self._stream_limit))
        # Over TCP the token is always required when one exists; on the socket when configured.
        self.token_required = self.auth.required and (tcp or socket_requires_token)
        peer = writer.get_extra_info("peername") if tcp else None
        where = f"tcp {peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "unix"
        self.peer = f"connection {next(_serial)} ({where})"
        self._write_lock = asyncio.Lock()
        # drain() returns only once every byte written is in the kernel: a get's lease is held
        # until then (its payload is sent from the slots), and a write never buffers ahead
        writer.transport.set_write_buffer_limits(high=0)
        self._transport = writer.transport
        self._writers = 0  # writers in _write: holding the write lock or waiting for it
        self._gathers = writes_gathered(writer.transport)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop  # the running loop, from serve() on
        self._reading: asyncio.Task[None] | None = None
        self._closed = False
        # The idle timeout is one timer per connection, checked when it fires (_check_idle), not an
        # asyncio.timeout around every read: those cost a timer scheduled and cancelled each, two
        # per frame, a fifth of the daemon's time per small request.
        self._active_at = 0.0  # loop time of the last frame boundary (a frame begun or ended)
        self._in_frame = False  # between a frame's preamble and its last byte
        self._idled = False  # the read loop was cancelled by the idle timeout
        self._no_hello = False  # the read loop was cancelled by the hello deadline
        self._watchdog: asyncio.TimerHandle | None = None
        self._hello_timer: asyncio.TimerHandle | None = None

    async def serve(self) -> None:
        """Read and answer frames until the end of the connection, then clean up."""
        self._reading = asyncio.current_task()
        loop = self._loop = asyncio.get_running_loop()
        self._active_at = loop.time()
        self._watchdog = loop.call_at(self._active_at + self.idle_timeout_s, self._check_idle)
        self._hello_timer = loop.call_at(self._active_at + self.hello_timeout_s, self._check_hello)
        try:
            await self._read_loop()
        except asyncio.CancelledError:
            if self._no_hello:
                log.info("%s: closed, no hello within %.1f s", self.peer, self.hello_timeout_s)
            elif not self._idled:
                log.debug("%s: stopped reading (shutdown)", self.peer)
            elif self._in_frame:
                log.info("%s: closed, stalled %.1f s inside a frame", self.peer, self.idle_timeout_s)
            else:
                log.info("%s: closed after %.1f s idle", self.peer, self.idle_timeout_s)
        finally:
            self._reading = None
            if self._watchdog is not None:
                self._watchdog.cancel()
            if self._hello_timer is not None:
                self._hello_timer.cancel()
            await self._finish()

    def _check_hello(self) -> None:
        """The hello deadline: a connection that is still a stranger is closed (its place among
        the unauthenticated ones is freed for the next client)."""
        self._hello_timer = None
        if not self.session.hello_done and self._reading is not None:
            self._no_hello = True
            self._reading.cancel()

    def _check_idle(self) -> None:
        """The idle timer: close a connection silent for ``idle_timeout_s`` between frames with
        nothing in flight, or stalled that long inside a frame (the stream cannot be resumed)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = self._active_at + self.idle_timeout_s
        if now < due:  # a frame boundary since the timer was set
            self._watchdog = loop.call_at(due, self._check_idle)
            return
        if self._in_frame or not self._tasks:
            self._watchdog = None
            self._idled = True
            if self._reading is not None:
                self._reading.cancel()
            return
        # Requests still in flight: the silence is the daemon's, not the client's.
        self._active_at = now
        self._watchdog = loop.call_at(now + self.idle_timeout_s, self._check_idle)

    def stop_reading(self) -> None:
        """Take no further requests (shutdown); those in flight still get their answers."""
        if self._reading is not None:
            self._reading.cancel()

    def abort(self) -> None:
        """Cancel the requests still in flight (the drain time is over)."""
        for task in list(self._tasks):
            task.cancel()

    # --- reading -------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            try:
                frame, charged = await self._read_frame()
            except Truncated:
                log.info("%s: the stream ended inside a frame", self.peer)
                return
            except ProtocolError as exc:
                log.info("%s: malformed frame (%s): closing", self.peer, exc.message)
                self.ctx.metrics.observe_request("frame", exc.code, 0.0)
                await self._send(fr.error_response(fr.CONNECTION_ERROR_ID, exc))
                return
            except (ConnectionError, OSError):
                return
            if frame is None:
                return
            if not self.session.hello_done:
                await self._serve_one(frame)  # nothing overlaps the hello and its descriptors
                if self.session.hello_done:
                    self._hello_succeeded()
            elif len(self._tasks) >= self.limits.max_inflight and frame.op != "release":
                # (a release is never busy: it is answered at once, and it frees what others wait for)
                busy = Busy(f"more than {self.limits.max_inflight} requests in flight")
                self.ctx.metrics.observe_request(_op_label(frame.op), busy.code, 0.0)
                await self._send(fr.error_response(frame.id, busy, _known_op(frame.op)))
            else:
                task = self._start(frame)
                if task is not None:
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    if charged:  # the payload's bytes stay charged while its request may use them
                        task.add_done_callback(lambda _, n=charged: self._uncharge(n))
                        charged = 0
            frame = None  # the request owns it now: its payload buffer is reusable once that ends
            self._uncharge(charged)

    def _hello_succeeded(self) -> None:
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self.reader.set_limit(self._stream_limit)
        if self._on_hello is not None:
            on_hello, self._on_hello = self._on_hello, None
            on_hello()

    async def _charge(self, n: int) -> None:
        """Charge a payload of ``n`` bytes to this connection's budget and the daemon's, waiting
        for room (the peer's bytes stay unread meanwhile)."""
        await self.own_budget.take(n)
        try:
            await self.budget.take(n)
        except BaseException:
            self.own_budget.give(n)
            raise

    def _uncharge(self, n: int) -> None:
        if n:
            self.budget.give(n)
            self.own_budget.give(n)

    async def _read_frame(self) -> tuple[fr.Frame | None, int]:
        """The next frame, as :func:`kvtier_protocol.frame_stream.read_frame` reads it (a cancelled wait, by the
        idle timer or shutdown, consumes nothing before the preamble), and the payload bytes
        charged to the budgets for it (the caller releases them with :meth:`_uncharge`)."""
        reader = self.reader
        preamble = reader.read_now(fr.PREAMBLE_LEN)  # no coroutine where the bytes are here
        if preamble is None:
            try:
                preamble = await reader.readexactly(fr.PREAMBLE_LEN)
            except asyncio.IncompleteReadError as exc:
                if not exc.partial:
                    return None, 0
                raise Truncated("stream ended inside a frame preamble") from exc
        loop = self._loop
        self._active_at, self._in_frame = loop.time(), True
        # Both lengths are checked here, before anything more is read or allocated; before the
        # hello against a hello's size, so a stranger's announcement costs nothing.
        hello_done = self.session.hello_done
        header_len, payload_len, has_payload = fr.parse_preamble(
            preamble, self.limits if hello_done else self._hello_limits)
        if has_payload and not hello_done:
            raise LimitExceeded("a frame with a payload before hello")
        charged = payload_len if has_payload else 0
        if charged:
            await self._charge(charged)
        try:
            head = reader.read_now(header_len)
            if head is None:
                head = await reader.readexactly(header_len)
            body = await read_payload(reader, payload_len, self.buffers) if has_payload else None
            header = fr.decode_header(head)
        except asyncio.IncompleteReadError as exc:
            self._uncharge(charged)
            raise Truncated("stream ended inside a frame") from exc
        except BaseException:
            self._uncharge(charged)
            raise
        self._active_at, self._in_frame = loop.time(), False
        return fr.Frame(header, memoryview(body).toreadonly() if body is not None else None), charged

    # --- one request ---------------------------------------------------------------------------

    def _start(self, frame: fr.Frame) -> asyncio.Task[None] | None:
        """Serve a request after the hello: in the read loop itself as far as it goes without
        waiting, else in a task of its own, which is returned (None: answered already).

        A task per request cost more than most requests (a grant, a place, an acquire or a
        release is a few store calls): its creation, scheduling and steps, and a write lock and
        a drain per answer. So the handlers of :meth:`RequestHandler.runs_inline` requests are
        started here (``coro.send``); one that finishes is answered at once, written straight
        to the transport when nothing is queued before it (:meth:`_write_now`); one that
        suspends goes on in a task from where it stopped, as does an answer that has to wait
        for room in the socket. The next frame is read only after that, so requests are still
        started, and answered when they finish at once, in the order they came."""
        started = time.perf_counter()
        op = _known_op(frame.op)
        quiet = False
        try:
            req = fr.validate_request(frame, limits=self.limits)
            quiet = req.__class__ is fr.ReleaseRequest and req.quiet is True  # type: ignore[attr-defined]
            if isinstance(req, fr.HelloRequest) or not self.handler.runs_inline(req, self.session):
                return asyncio.create_task(self._serve_one(frame, req, started))
            self._check_allowed(req)
            coro = self.handler.handle(req, self.session)
            try:
                yielded = coro.send(None)
            except StopIteration as stop:
                response: fr.Message = stop.value
            else:  # it waits for something: the rest in a task, the first step done
                return asyncio.create_task(self._serve_one(frame, None, started, (coro, yielded)))
            try:
                bufs = fr.encode_message(response, limits=self.limits)
            except KVTierError as exc:  # e.g. a response header above max_header_len
                bufs = fr.encode_frame(fr.error_response(response.id, exc, response.OP), limits=self.limits)
            if id(response) in self.session.after_send:  # sent from slots (a get's): the task knows how
                return asyncio.create_task(self._serve_one(frame, None, started, response=response))
            status = "ok"
        except KVTierError as exc:
            status = exc.code
            bufs = fr.encode_frame(fr.error_response(frame.id, exc, op), limits=self.limits)
        except Exception as exc:  # a bug: answer `internal`, keep the connection (frame intact)
            status = "internal"
            log.exception("%s: %s request %d failed", self.peer, op or "unknown", frame.id)
            bufs = fr.encode_frame(fr.error_response(frame.id, exc, op), limits=self.limits)
        if quiet:  # SPEC 7.4 release: no answer, success or error; the metrics still count it
            if status != "ok":
                log.debug("%s: quiet release %d failed: %s", self.peer, frame.id, status)
            self.ctx.metrics.observe_request(_op_label(op), status, time.perf_counter() - started)
            return None
        written = self._write_now(bufs)
        self.ctx.metrics.observe_request(_op_label(op), status, time.perf_counter() - started)
        if written:
            return None
        self._writers += 1  # at once: no later answer is written before this one
        return asyncio.create_task(self._write(bufs, counted=True))  # after what is queued

    async def _serve_one(self, frame: fr.Frame, req: fr.Request | None = None, started: float | None = None,
                         resume: tuple[Coroutine[Any, Any, fr.Message], Any] | None = None,
                         response: fr.Message | None = None) -> None:
        """Serve ``frame`` in this task (validated as ``req``, if it was already; ``resume``: a
        handler started by :meth:`_start` and what it waits for; ``response``: its answer)."""
        started = time.perf_counter() if started is None else started
        op = _known_op(frame.op)
        status = "ok"
        try:
            if response is not None:
                pass
            elif resume is not None:
                response = await _resume(*resume)
            else:
                req = fr.validate_request(frame, limits=self.limits) if req is None else req
                if isinstance(req, fr.HelloRequest):
                    await self._hello(req)
                    return
                self._check_allowed(req)
                response = await self.handler.handle(req, self.session)
            try:
                await self._send_message(response)
            finally:
                after = self.session.after_send.pop(id(response), None)
                if after is not None:
                    self._after_send(after)
        except KVTierError as exc:
            status = exc.code
            await self._send(fr.error_response(frame.id, exc, op))
        except asyncio.CancelledError:  # shutdown after the drain timeout
            status = "unavailable"
            raise
        except ConnectionError as exc:  # the hello's descriptors could not be sent
            status = "unavailable"
            log.info("%s: %s; closing", self.peer, exc)
            self._closed = True
            self.writer.transport.abort()
        except Exception as exc:  # a bug: answer `internal`, keep the connection (frame intact)
            status = "internal"
            log.exception("%s: %s request %d failed", self.peer, op or "unknown", frame.id)
            await self._send(fr.error_response(frame.id, exc, op))
        finally:
            self.ctx.metrics.observe_request(_op_label(op), status, time.perf_counter() - started)

    def _after_send(self, after: Callable[[], object]) -> None:
        """Run what waited for a response's bytes to leave (release a get's lease). Bytes still
        in the transport then (the write was cut short: shutdown, cancellation) would be read from
        slots the lease no longer holds: the connection is aborted first, dropping them."""
        transport = self.writer.transport
        if transport.get_write_buffer_size() and not transport.is_closing():
            log.info("%s: a response sent from the host slots could not leave in time; closing", self.peer)
            self._closed = True
            transport.abort()
        elif transport.get_write_buffer_size():  # closing: the buffered bytes may still go out
            transport.abort()
        after()

    def _check_allowed(self, req: fr.Request) -> None:
        session = self.session
        if not session.hello_done:
            if self.token_required:
                raise Unauthorized(f"{req.OP} before hello: send hello with the token first")
            raise InvalidRequest(f"{req.OP} before hello: send hello first")
        if session.tcp and req.OP in MUTATING_OPS and not session.authenticated:
            raise Unauthorized(f"{req.OP} over TCP needs the token")

    async def _hello(self, req: fr.HelloRequest) -> None:
        if self.session.hello_done:
            raise InvalidRequest("hello was already done on this connection")
        if req.version != fr.FRAME_VERSION:
            raise UnsupportedVersion(f"protocol version {req.version} is not spoken here "
                                     f"(this daemon speaks {fr.FRAME_VERSION})")
        principal = self.auth.identify(req.token) if req.token is not None else None
        if req.token is not None and principal is None:
            raise Unauthorized("wrong token")  # refused even where no token is needed
        if self.token_required and req.token is None:
            raise Unauthorized("a valid token is required")
        # The token picks the store; a client receives only that store's segments, so a
        # tenant can map neither another tenant's blocks nor the default pool (docs/design.md §7).
        scope = hello_scope(self.ctx, principal, req.tenant)
        host = scope.store.host
        infos = host.segments if host is not None and not self.session.tcp else []
        segments = tuple(fr.Segment(s.name, s.size) for s in infos)
        response = fr.HelloResponse(req.id, fr.FRAME_VERSION, f"kvtierd {self.ctx.version}",
                                    self.limits, segments, len(segments), _FEATURES)
        bufs = fr.encode_message(response, limits=self.limits)
        if infos:
            await self._send_with_fds(b"".join(bufs), [s.fd for s in infos])
        else:
            await self._write(bufs)
        self.session.scope = scope
        self.session.hello_done = True
        self.session.has_segments = bool(infos)
        self.session.authenticated = principal is not None or not self.auth.required
        log.debug("%s: hello from %r (%s, %d segments)", self.peer, req.client,
                  f"tenant {scope.tenant}" if scope.tenant else "default store", len(segments))

    # --- writing -------------------------------------------------------------------------------

    async def _send_message(self, message: fr.Message) -> None:
        try:
            bufs = fr.encode_message(message, limits=self.limits)
        except KVTierError as exc:  # e.g. a response header above max_header_len
            await self._send(fr.error_response(message.id, exc, message.OP))
            return
        await self._write(bufs)

    async def _send(self, header: dict[str, Any]) -> None:
        await self._write(fr.encode_frame(header, limits=self.limits))

    def _write_now(self, bufs: list[fr.Buffer]) -> bool:
        """Write a frame without waiting, where nothing is queued before it: no writer holds or
        waits for the write lock, and the transport's buffer is empty. Returns True when that
        was so (the frame is written, or dropped on a closed connection), False when nothing was
        written (:meth:`_write` then). What the socket did not take at once is drained by a
        writer task that holds the lock meanwhile (:meth:`_write` of no buffers), as
        :meth:`_write` would have: later answers queue behind it, and a peer that reads nothing
        for ``idle_timeout_s`` loses the connection."""
        if self._closed or self._transport.is_closing():
            return True
        if self._writers or self._transport.get_write_buffer_size():
            return False
        if not self._put_bytes(bufs):
            return True
        if self._transport.get_write_buffer_size():  # the peer reads slowly: later frames queue
            self._writers += 1  # at once, before the task starts: nothing is written ahead of it
            task = asyncio.create_task(self._write([], counted=True))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    def _put_bytes(self, bufs: list[fr.Buffer]) -> bool:
        """Hand a frame's buffers to the transport; False when the connection broke."""
        transport = self._transport
        try:
            if len(bufs) == 1:
                transport.write(bufs[0])
            elif self._gathers or sum(len(b) for b in bufs) <= JOIN_WRITE_BYTES:
                transport.writelines(bufs)
            else:  # Python 3.11's writelines joins its buffers: one more copy of a payload
                for buf in bufs:
                    transport.write(buf)
        except (ConnectionError, OSError):
            self._closed = True
            return False
        return True

    async def _write(self, bufs: list[fr.Buffer], *, counted: bool = False) -> None:
        """Write a frame once the frames before it are out of the way (``counted``: the caller
        counted this writer in ``_writers`` already), and wait until the socket took it all."""
        if not counted:
            self._writers += 1
        try:
            await self._write_locked(bufs)
        finally:
            self._writers -= 1

    async def _write_locked(self, bufs: list[fr.Buffer]) -> None:
        async with self._write_lock:  # frames of concurrent responses never interleave
            if self._closed or self.writer.is_closing():
                return
            try:
                if bufs and not self._put_bytes(bufs):
                    return
                if self._transport.get_write_buffer_size():  # else the socket took it all: no wait
                    async with asyncio.timeout(self.idle_timeout_s):
                        await self.writer.drain()
            except TimeoutError:  # first: TimeoutError is an OSError
                # The peer stopped reading: its requests could never finish. Dropping the
                # connection ends the read loop, and the cleanup releases its leases.
                log.info("%s: peer read nothing for %.1f s; closing", self.peer, self.idle_timeout_s)
                self._closed = True
                self.writer.transport.abort()
            except (ConnectionError, OSError):
                self._closed = True

    async def _send_with_fds(self, data: bytes, fds: list[int]) -> None:
        """Send one frame with ``fds`` attached (SCM_RIGHTS), through the raw socket.

        The transport's own buffer must be empty first, or bytes queued earlier would arrive
        after the frame sent beside it.
        """
        self._writers += 1
        try:
            await self._send_fds_locked(data, fds)
        finally:
            self._writers -= 1

    async def _send_fds_locked(self, data: bytes, fds: list[int]) -> None:
        async with self._write_lock:
            transport = self.writer.transport
            deadline = time.monotonic() + FDS_SEND_TIMEOUT_S
            while transport.get_write_buffer_size():
                if transport.is_closing() or time.monotonic() > deadline:
                    raise ConnectionError("cannot flush the socket before the hello response")
                await self.writer.drain()
                await asyncio.sleep(0.001)
            raw = self.writer.get_extra_info("socket")
            # A duplicate descriptor of the transport's socket: same non-blocking socket, but a
            # socket object send_fds accepts; closing it leaves the transport's descriptor open.
            with socket.fromfd(raw.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                while True:
                    try:
                        sent = socket.send_fds(sock, [data], fds)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            raise ConnectionError("the socket buffer stayed full") from None
                        await asyncio.sleep(0.001)
                    except OSError as e:  # the peer went away (EPIPE, ECONNRESET)
                        raise ConnectionError(f"cannot send the hello response: {e.strerror}") from e
            if sent < len(data):
                self.writer.write(data[sent:])  # the descriptors went with the first byte
            await self.writer.drain()

    # --- end -----------------------------------------------------------------------------------

    async def _finish(self) -> None:
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        store = self.handler.scope(self.session).store
        for lease_id in list(self.session.leases):
            try:
                store.release(lease_id)  # a reservation is abandoned, never committed
            except Exception:
                log.exception("%s: releasing lease %d failed", self.peer, lease_id)
        self.session.leases.clear()
        self._closed = True
        self.writer.close()  # graceful: answers still buffered go out first ...
        try:
            async with asyncio.timeout(self.idle_timeout_s):
                await self.writer.wait_closed()
        except TimeoutError:  # ... unless the peer reads nothing (first: TimeoutError is an OSError)
            self.writer.transport.abort()
        except (ConnectionError, OSError):
            pass


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Run a coroutine that was started by hand (``coro.send(None)``) and suspended on
    ``waiting`` (what it yielded: a future, or None for a bare yield) to its end, in the
    calling task, as if that task had run it from the start: results and errors of what it
    waits for (the cancellation of this task included) are passed on to it.

    Returns:
        The coroutine's result (its errors are raised).
    """
    while True:
        try:
            if waiting is None:
                await asyncio.sleep(0)
            else:
                # What a task does with a future its coroutine yields: the coroutine has
                # yielded it already, and a future refuses to be awaited twice while blocking.
                waiting._asyncio_future_blocking = False
                await waiting
        except BaseException as exc:  # its own errors, or this task's cancellation: the coroutine's to handle
            try:
                waiting = coro.throw(exc)
            except StopIteration as stop:
                return stop.value
            continue
        try:
            waiting = coro.send(None)
        except StopIteration as stop:
            return stop.value


def _known_op(op: str | None) -> str | None:
    return op if op in fr.REQUESTS else None


def _op_label(op: str | None) -> str:
    # Bounded label values for metrics: a peer cannot mint new ones with made-up op names.
    return op if op in fr.REQUESTS else "unknown"


