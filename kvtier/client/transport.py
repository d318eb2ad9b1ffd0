"""A blocking data-plane connection over a plain socket: requests sent, answers read when claimed.

A request is sent (:meth:`BlockingConnection.send`, returning its id) and its answer read when it
is claimed (:meth:`~BlockingConnection.receive`); answers to other requests read on the way are
kept until claimed, and those of forgotten requests are dropped (a lease they grant released).
:meth:`~BlockingConnection.call` is the two at once. Write-behind commits are *kept*
(:meth:`~BlockingConnection.keep`) and their answers claimed later (:meth:`~BlockingConnection.settle`).

No event loop: frames are written with ``sendmsg`` (header and payload buffers gathered, not
joined) and read with ``recv_into`` into buffers sized from the preamble, after its lengths were
checked against the limits. The payloads of a get sent with landing buffers (``load_into``,
:class:`~kvtier.client.steps.Landing`) are received straight into the caller's buffers instead,
hashed chunk by chunk as they land (still in cache), so the load copies nothing after the kernel::

    socket ──recv_into──► record header (payload buffer) ──► decode: payload length, fits?
           └─recv_into──► caller's buffer, 256 KiB at a time ──► xxh3 update ──► Landing.digests Every wait is bounded by the call's deadline. The hello response on
a unix socket is read with ``recvmsg`` (``socket.recv_fds``) so that the segment descriptors
attached to it arrive with its first bytes (SPEC.md §7.4).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

import xxhash

from kvtier_protocol.errors import FrameError, KVTierError
from kvtier_protocol.frames import (DEFAULT_LIMITS, PREAMBLE_LEN, Buffer, Frame, Limits,
                                    decode_header, encode_frame, parse_preamble, parse_response,
                                    raise_for_error)

from kvtier_protocol.buffers import POOLED_PAYLOAD_BYTES, PayloadBuffers
from kvtier_protocol.header import PREAMBLE as RECORD_PREAMBLE, decode_header as decode_record_header
from kvtier_protocol.address import Address
from kvtier.client.errors import ConnectionLost, TimedOut, Unreachable
from kvtier.client.behind import LateErrors
from kvtier.client.steps import IO, JUMP_OPS, Call, Landing, Receive, Send, granted_lease
from kvtier.client.options import ClientOptions
from kvtier.client.retry import remaining_s
from kvtier.client.session import MAX_FDS, Session, hangup_probe, hello_keys, open_session, release_keys

_IOV_MAX = 1024  # buffers per sendmsg (Linux UIO_MAXIOV)
_FIRST_READ = 64 << 10
_READ_AHEAD = 64 << 10  # bytes asked of each recv of frame headers
PAYLOAD_KEEP_BYTES = 256 << 20  # most bytes of such buffers a connection keeps between calls
LAND_CHUNK = 256 << 10  # bytes a landing payload is received (and hashed) at a time: still in cache


def _landable(lens: Any, landing: Landing, n: int) -> bool:
    """Whether a get response's ``lens`` (not yet checked by the schema) describes its payload of
    ``n`` bytes record by record, each with a landing buffer."""
    if type(lens) is not list or len(lens) > len(landing.dests) - landing.first:
        return False
    total = 0
    for length in lens:
        if length is not None:
            if type(length) is not int or length < 0:
                return False
            total += length
    return total == n


def connect_socket(address: Address, timeout: float) -> socket.socket:
    """A connected blocking socket to ``address``.

    Raises:
        TimedOut: the connection was not made within ``timeout``.
        Unreachable: refused, no such socket, or another OS error.
    """
    try:
        if address.is_unix:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.settimeout(timeout)
                sock.connect(address.path)
            except BaseException:
                sock.close()
                raise
        else:
            sock = socket.create_connection((address.host, address.port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except TimeoutError as exc:
        raise TimedOut(f"connecting to {address} timed out") from exc
    except OSError as exc:
        raise Unreachable(f"cannot connect to {address}: {exc.strerror or exc}") from exc
    return sock


class BlockingConnection:
    """One connection after a successful hello; not thread-safe (the client serializes calls)."""

    def __init__(self, sock: socket.socket, address: Address) -> None:
        self._sock: socket.socket | None = sock
        self._address = address
        self._ids = itertools.count(1)
        self._pending = bytearray()  # bytes read beyond the frames consumed so far
        self._inflight: dict[int, str] = {}  # id -> op of each request whose answer is not claimed
        self._arrived: dict[int, Frame] = {}  # answers read while waiting for another one
        self._forgotten: set[int] = set()  # ids whose answers are dropped when they arrive
        self._outbox: list[Buffer] = []  # frames of deferred requests, written with the next write
        self._held: set[int] = set()  # ids of the requests in _outbox
        self._held_quiet = 0  # how many of them are quiet releases (no answer to come)
        self._landings: dict[int, Landing] = {}  # id -> where the payloads of that get may land
        self._kept: list[int] = []  # write-behind commits whose answers are claimed later, oldest first
        self.late = LateErrors()  # what became of refused or lost write-behind commits
        self._buffers = PayloadBuffers(PAYLOAD_KEEP_BYTES)  # for large payloads (kvtier_protocol.buffers)
        self.session: Session | None = None

    @classmethod
    def open(cls, address: Address, options: ClientOptions, deadline: float) -> BlockingConnection:
        """Connect and say hello within ``connect_timeout_s`` (and before ``deadline``); on a unix
        socket, map the segments handed over.

        Raises:
            TimedOut, ConnectionLost: as :func:`connect_socket`, or during hello.
            Unauthorized, UnsupportedVersion: the daemon refused the hello.
        """
        deadline = min(deadline, time.monotonic() + options.connect_timeout_s)
        sock = connect_socket(address, remaining_s(deadline, "connect"))
        conn = cls(sock, address)
        try:
            conn._hello(options, deadline)
        except BaseException:
            conn.close()
            raise
        return conn

    @property
    def closed(self) -> bool:
        """True once the connection broke or was closed."""
        return self._sock is None

    @property
    def kept(self) -> int:
        """Write-behind commits whose answers are still to be claimed."""
        return len(self._kept)

    @property
    def holding(self) -> bool:
        """True while deferred requests wait to be written."""
        return bool(self._outbox)

    def _hello(self, options: ClientOptions, deadline: float) -> None:
        ident = next(self._ids)
        self._send(encode_frame({"op": "hello", "id": ident, **hello_keys(options)}), deadline)
        fds: list[int] = []
        try:
            if self._address.is_unix:
                fds = self._recv_with_fds(deadline)
            frame = self._recv_frame(DEFAULT_LIMITS, deadline)
            self._check_id(frame, ident)
            response = parse_response("hello", frame, limits=DEFAULT_LIMITS)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self.session = open_session(response, fds, options)  # type: ignore[arg-type]
        if self.session.grants is not None:  # slots held across calls: check the daemon before copying
            self.session.peer_gone = hangup_probe(self._live().fileno(), lambda: self._sock is None)

    def _recv_with_fds(self, deadline: float) -> list[int]:
        sock = self._live()
        try:
            sock.settimeout(remaining_s(deadline, "hello"))
            data, fds, flags, _ = socket.recv_fds(sock, _FIRST_READ, MAX_FDS)
        except TimeoutError as exc:
            raise TimedOut(f"no hello answer from {self._address}") from exc
        except OSError as exc:
            raise ConnectionLost(f"hello to {self._address} failed: {exc}") from exc
        if flags & socket.MSG_CTRUNC:
            for fd in fds:
                os.close(fd)
            raise FrameError("segment descriptors of the hello response were truncated")
        if not data:
            for fd in fds:
                os.close(fd)
            raise ConnectionLost(f"daemon at {self._address} closed the connection during hello")
        self._pending += data
        return fds

    def perform(self, io: IO, deadline: float) -> tuple[Any, KVTierError | None]:
        """Do one I/O of a flow's run (kvtier.client.steps.FlowRun) within ``deadline``: returns
        ``(what it gave, None)``, or ``(None, the error it met)`` for the run to take in."""
        try:
            if isinstance(io, Send):
                return self.send(io.call, deadline), None
            if isinstance(io, Receive):
                return self.receive(io.handle, deadline), None
            self.settle(deadline, io.keep_last)
        except KVTierError as exc:
            return None, exc
        return None, None

    def finish(self, keep: list[int], forget: list[int], deadline: float) -> None:
        """After a flow: keep the write-behind requests ``keep`` (held back a while: the next
        request takes them along), forget the others of ``forget``, and write what is deferred
        (releases, commits) unless something was kept, or all that is held back is quiet
        releases: those wait for the next request too (one write, one wake-up of the daemon for
        both; the client flushes them within ``behind.FLUSH_AFTER_S`` if none comes)."""
        for ident in keep:
            self.keep(ident)
        for ident in forget:
            self.forget(ident, deadline)
        if not self.closed and not keep and len(self._held) > self._held_quiet:
            try:
                self.flush(deadline)
            except KVTierError:
                pass  # closed by flush; a lost release expires, a lost commit was never answered

    def call(self, call: Call, deadline: float) -> object:
        """Send one request and return its typed response.

        Raises:
            ConnectionLost, TimedOut: the connection broke or stayed silent (it is closed then).
            KVTierError: the error the daemon answered, or a malformed response (connection
                closed then).
        """
        return self.receive(self.send(call, deadline), deadline)

    def send(self, call: Call, deadline: float) -> int:
        """Send one request (a deferred one, ``call.defer``, with the next write); returns its id,
        for :meth:`receive` or :meth:`forget`.

        Raises:
            ConnectionLost, TimedOut: as :meth:`call` (the connection is closed then).
        """
        session = self.session
        assert session is not None, "hello precedes every call"
        self._live()
        ident = next(self._ids)
        keys = call.keys
        quiet = call.op == "release" and not call.wait and session.quiet_release
        if quiet:  # nothing waits for it: answered with nothing, not in flight, forgetting it a no-op
            keys = release_keys(session, keys["lease"])
        # a request above the limits: the caller's error, raised before anything is queued
        frame = encode_frame({"op": call.op, "id": ident, **keys}, call.payload, limits=session.limits)
        if call.op in JUMP_OPS:
            self._outbox[:0] = frame  # ahead of held-back commits and releases (steps.JUMP_OPS)
        else:
            self._outbox += frame
        if not quiet:
            self._inflight[ident] = call.op
        if call.into is not None:
            self._landings[ident] = call.into
        if call.defer:
            self._held.add(ident)
            self._held_quiet += quiet
        else:
            self.flush(deadline)
        return ident

    def flush(self, deadline: float) -> None:
        """Write the deferred requests.

        Raises:
            ConnectionLost, TimedOut: as :meth:`call` (the connection is closed then).
        """
        if not self._outbox:
            return
        out, self._outbox = self._outbox, []
        self._held.clear()
        self._held_quiet = 0
        try:
            self._send(out, deadline)
        except BaseException:
            self.close()  # the stream may be mid-frame: never reuse it
            raise

    def receive(self, ident: int, deadline: float) -> object:
        """The typed response of request ``ident`` (sent, not yet received or forgotten).

        Raises:
            As :meth:`call`.
        """
        session = self.session
        assert session is not None, "hello precedes every call"
        self._live()  # closed since it was sent (another request broke the stream): lost
        assert ident in self._inflight, "a request sent and not yet claimed"
        try:
            frame = self._arrived.pop(ident, None)
            if frame is None:
                frame = self._read_until(ident, session.limits, deadline)
        except BaseException:
            self.close()  # the stream may be mid-frame: never reuse it
            raise
        op = self._inflight.pop(ident)
        raise_for_error(frame.header)
        try:
            return parse_response(op, frame, limits=session.limits)
        except KVTierError:
            self.close()  # the daemon broke the schema: do not trust the stream any more
            raise

    def forget(self, ident: int, deadline: float) -> None:
        """Never claim the answer of request ``ident``: drop it (now or when it arrives), and
        release the lease it grants (acquire, reserve). Best effort: a lease lost here expires."""
        if ident not in self._inflight or self._sock is None:
            return
        frame = self._arrived.pop(ident, None)
        if frame is None:
            self._forgotten.add(ident)
            self._landings.pop(ident, None)  # the flow that gave those buffers is done with them
            return
        try:
            self._drop(ident, frame, deadline)
        except KVTierError:
            self.close()

    def keep(self, ident: int) -> None:
        """Claim the answer of write-behind commit ``ident`` later, in :meth:`settle`."""
        if ident in self._inflight and self._sock is not None:
            self._kept.append(ident)

    def settle(self, deadline: float, keep_last: int = 0) -> None:
        """Claim the answers of the kept commits, all but the newest ``keep_last``; a refused
        one is recorded in :attr:`late`.

        Raises:
            ConnectionLost, TimedOut: the connection broke (it is closed then, and the commits
                not answered are recorded in :attr:`late` as unknown).
        """
        while len(self._kept) > keep_last:
            ident = self._kept.pop(0)
            try:
                self.receive(ident, deadline)
            except KVTierError as exc:
                broken = self._sock is None  # else the daemon refused this commit, the stream is fine
                self.late.answer_failed(exc, broken=broken, after=len(self._kept))
                if broken:
                    self._kept.clear()
                    raise

    def _read_until(self, ident: int, limits: Limits, deadline: float) -> Frame:
        if ident in self._held:  # never wait for an answer to a request still held back
            self.flush(deadline)
        # Only then: a request sent already is answered whatever follows it, so the held-back
        # ones (write-behind commits, releases) keep waiting for the next request to take them
        # along, also while an answer is late.
        while True:
            frame = self._recv_frame(limits, deadline)
            other = frame.id
            if other == ident:
                return frame
            if other in self._forgotten:
                self._drop(other, frame, deadline)
            elif other in self._inflight and other not in self._arrived:
                self._arrived[other] = frame
            else:
                self._check_id(frame, ident)  # raises: a connection-level error, or a stray id

    def _drop(self, ident: int, frame: Frame, deadline: float) -> None:
        self._forgotten.discard(ident)
        self._landings.pop(ident, None)
        op = self._inflight.pop(ident)
        lease = granted_lease(op, frame.header)
        if lease:
            release = next(self._ids)
            session = self.session
            assert session is not None, "hello precedes every call"
            self._send(encode_frame({"op": "release", "id": release, **release_keys(session, lease)}), deadline)
            if not session.quiet_release:  # its answer is read and dropped
                self._inflight[release] = "release"
                self._forgotten.add(release)

    def _check_id(self, frame: Frame, ident: int) -> None:
        if frame.id == ident:
            return
        if frame.id == 0:  # a connection-level error: the daemon closes the stream after it
            raise_for_error(frame.header)
        raise FrameError(f"response id {frame.id} answers no request in flight (expected {ident})")

    def _live(self) -> socket.socket:
        if self._sock is None:
            raise ConnectionLost(f"connection to {self._address} is closed")
        return self._sock

    def _send(self, buffers: Sequence[Buffer], deadline: float) -> None:
        sock = self._live()
        views = [memoryview(b).cast("B") for b in buffers if len(b)]
        try:
            while views:
                sock.settimeout(remaining_s(deadline, "send"))
                sent = sock.sendmsg(views[:_IOV_MAX], (), socket.MSG_NOSIGNAL)
                while sent:
                    if sent >= views[0].nbytes:
                        sent -= views.pop(0).nbytes
                    else:
                        views[0], sent = views[0][sent:], 0
        except TimeoutError as exc:
            raise TimedOut(f"sending to {self._address} timed out") from exc
        except OSError as exc:
            raise ConnectionLost(f"connection to {self._address} broke: {exc}") from exc

    def _recv_exact(self, n: int, deadline: float) -> bytearray | memoryview:
        # fresh pages cost as much as the copy: a large payload lands in a reused mapping
        buf = self._buffers.view(n) if n > POOLED_PAYLOAD_BYTES else bytearray(n)
        with memoryview(buf) as view:
            self._read_into(view, deadline)
        return buf

    def _read_into(self, view: memoryview, deadline: float, digest: Any = None) -> None:
        """Fill ``view`` with the next bytes of the stream: what was read ahead, then straight
        from the socket. ``digest`` (an xxh3 hasher): updated with each part right after it
        landed, :data:`LAND_CHUNK` at most at a time."""
        n = view.nbytes
        got = min(n, len(self._pending))
        if got:
            view[:got] = self._pending[:got]
            del self._pending[:got]
            if digest is not None:
                digest.update(view[:got])
        if got == n:
            return
        sock = self._live()
        with self._receive_errors():
            while got < n:
                sock.settimeout(remaining_s(deadline, "receive"))
                if digest is None:
                    k = sock.recv_into(view[got:])
                else:
                    k = sock.recv_into(view[got:got + LAND_CHUNK])
                    digest.update(view[got:got + k])
                if not k:
                    self._closed_by_daemon(False)
                got += k

    def _recv_landed(self, n: int, lens: Any, landing: Landing, deadline: float) -> bytearray | memoryview:
        """A get's payload of ``n`` bytes with the payloads of its first records received into
        their landing buffers (:meth:`_land`), up to the first miss or record that cannot land;
        the rest (headers, those records, all of it if ``lens`` does not describe the payload)
        into the frame's own buffer."""
        # not populated: the pages under landed payloads are never touched
        buf = self._buffers.view(n, populate=False) if n > POOLED_PAYLOAD_BYTES else bytearray(n)
        at = 0
        with memoryview(buf) as view:
            if _landable(lens, landing, n):
                for j, length in enumerate(lens):
                    if length is None:
                        break  # a miss ends the prefix: the buffers after it stay untouched
                    index = landing.first + j
                    digest = self._land(view[at:at + length], landing.dests[index], deadline)
                    at += length
                    if digest is None:
                        break  # so does a record that cannot land (the flow meets it as before)
                    landing.digests[index] = digest
            self._read_into(view[at:], deadline)
        return buf

    def _land(self, record: memoryview, dest: memoryview, deadline: float) -> int | None:
        """Receive one record: its header into ``record``, its payload into ``dest`` if the header
        decodes, says the record's length and fits ``dest``; returns the xxh3-64 of the bytes
        landed there. Else the whole record goes into ``record`` and None is returned: the flow
        then meets it as it always did (a miss, or a buffer too small)."""
        size, pre = record.nbytes, RECORD_PREAMBLE.size
        if size < pre:
            self._read_into(record, deadline)
            return None
        self._read_into(record[:pre], deadline)
        off = pre + RECORD_PREAMBLE.unpack_from(record)[3]  # header_len
        if off > size:
            self._read_into(record[pre:], deadline)
            return None
        self._read_into(record[pre:off], deadline)
        try:
            h, end = decode_record_header(record[:off])
        except KVTierError:
            h, end = None, -1
        if h is None or end != off or off + h.payload_len != size or dest.nbytes < h.payload_len:
            self._read_into(record[off:], deadline)
            return None
        digest = xxhash.xxh3_64()
        self._read_into(dest[:h.payload_len], deadline, digest)
        return digest.intdigest()

    def _fill(self, n: int, deadline: float, *, at_frame_start: bool = False) -> None:
        """Have at least ``n`` bytes in ``_pending``, reading whatever the socket holds (up to
        :data:`_READ_AHEAD` at a time): the small frames of answers sent together, as a pipelined
        flow's are, then cost one ``recv`` between them rather than two each."""
        pending = self._pending
        if len(pending) >= n:
            return
        sock = self._live()
        with self._receive_errors():
            while len(pending) < n:
                sock.settimeout(remaining_s(deadline, "receive"))
                data = sock.recv(max(n - len(pending), _READ_AHEAD))
                if not data:
                    self._closed_by_daemon(at_frame_start and not pending)
                pending += data

    @contextlib.contextmanager
    def _receive_errors(self) -> Iterator[None]:
        """A socket timeout or error while receiving, as the client's typed errors."""
        try:
            yield
        except TimeoutError as exc:
            raise TimedOut(f"no answer from {self._address} in time") from exc
        except OSError as exc:
            raise ConnectionLost(f"connection to {self._address} broke: {exc}") from exc

    def _closed_by_daemon(self, between_frames: bool) -> NoReturn:
        where = "between frames" if between_frames else "inside a frame"
        raise ConnectionLost(f"daemon at {self._address} closed the connection {where}")

    def _recv_frame(self, limits: Limits, deadline: float) -> Frame:
        self._fill(PREAMBLE_LEN, deadline, at_frame_start=True)
        header_len, payload_len, has_payload = parse_preamble(self._pending, limits)
        end = PREAMBLE_LEN + header_len
        self._fill(end, deadline)
        header = decode_header(self._pending[PREAMBLE_LEN:end])
        del self._pending[:end]
        landing = self._landings.pop(header["id"], None) if self._landings else None
        if not has_payload:
            return Frame(header, None)
        # A payload is read straight into its own buffer (after what was read ahead of it), or
        # a get's record payloads straight into the caller's buffers.
        if landing is not None and header.get("ok") is True:
            body = self._recv_landed(payload_len, header.get("lens"), landing, deadline)
        else:
            body = self._recv_exact(payload_len, deadline)
        return Frame(header, memoryview(body).toreadonly())

    def close(self) -> None:
        """Close the socket and unmap the segments (idempotent)."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        self._inflight.clear()
        self._arrived.clear()
        self._forgotten.clear()
        self._outbox.clear()
        self._held.clear()
        self._held_quiet = 0
        self._landings.clear()
        self._buffers.close()
        if self._kept:
            self.late.lost(ConnectionLost("the connection closed"), len(self._kept))
            self._kept.clear()
        if self.session is not None:
            self.session.close()
