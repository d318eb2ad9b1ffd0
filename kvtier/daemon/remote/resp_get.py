"""The remote tier's fast path for block GETs: each value received straight into its own buffer.

redis-py reads a reply through an ``asyncio.StreamReader`` (64 KiB reads, flow control pausing
the socket every 128 KiB) and feeds it to hiredis, which grows its own buffer and copies the
finished value out again: a multi-megabyte block crosses memory four or five times and the loop
runs hundreds of small steps per value. Here a GET pipeline to one node runs on a connection
whose :class:`asyncio.BufferedProtocol` parses the RESP2 header of each bulk reply and then hands
the kernel the value's own ``bytearray`` to ``recv_into``: the bytes are written once, where they
stay. Everything else (slot map, MOVED/ASK, uploads, deletes, exists) stays with redis-py; a key
this path cannot serve (its slot not in the map, a MOVED/ASK/TRYAGAIN answer) is retried through
redis-py by the caller.

Replies are the same as a redis-py pipeline's with ``raise_on_error=False``: the value (a
``bytearray``), None for a missing key, or the redis-py exception of an error reply (so that
:func:`~kvtier.daemon.remote.redis_cluster.error_kind` names it alike). A connection is reused only
after a pipeline read to its end; one cancelled (a call's deadline), failed or answered with
something a GET cannot answer is closed.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from redis import exceptions as rx
from redis._parsers.base import BaseParser

SCRATCH = 64 << 10
"""Bytes of a connection's buffer for reply headers (and whatever follows them in one read)."""
IDLE_PER_NODE = 8
"""Idle connections kept per node (more in flight at once are closed after use)."""


@dataclass(frozen=True, slots=True)
class RespAuth:
    """How a fast-path connection authenticates and encrypts, as redis-py's connections do.

    Attributes:
        user: ACL user (None: the default user).
        password: the password (None: no AUTH).
        tls: whether to speak TLS.
        tls_ca_file: CA bundle for the servers' certificates (None: the system's).
    """

    user: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_file: str | None = None

    def __repr__(self) -> str:  # never the password
        return f"RespAuth(user={self.user!r}, tls={self.tls})"


def pack(*args: bytes) -> bytes:
    """One RESP2 command."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class ProtocolViolation(rx.ConnectionError):
    """A reply a GET (or AUTH) cannot give: the connection is closed, its replies are failures."""


Reply = bytearray | bytes | int | None | BaseException


class GetReplies(asyncio.BufferedProtocol):
    """One connection's replies, read as they come: headers into a scratch buffer, bulk values
    into their own ``bytearray`` (allocated when the header says their length).

    :meth:`expect` arms it for the next ``n`` replies; they are parsed in order (RESP2: simple
    string, error, integer, bulk string; an array is a protocol violation).
    """

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._scratch = bytearray(SCRATCH)
        # Always handed out as a memoryview: asyncio's TLS reader fills a buffer in several
        # reads through ``buf[offset:]``, which of a bytearray would be a copy (bytes lost).
        self._scratch_view = memoryview(self._scratch)
        self._head = bytearray()  # received bytes not parsed yet (outside bulk values)
        self._body: bytearray | None = None  # the bulk value being received
        self._filled = 0  # bytes of _body received
        self._skip = 0  # bytes of a bulk's trailing CRLF still to check and drop
        self._done: bytearray | None = None  # a whole bulk value waiting for its CRLF
        self._want = 0
        self._replies: list[Reply] = []
        self._waiter: asyncio.Future[list[Reply]] | None = None
        self.broken = False

    # -- the caller's side -------------------------------------------------------------------

    def expect(self, n: int) -> asyncio.Future[list[Reply]]:
        """A future of the next ``n`` replies (or the ConnectionError that ended the connection)."""
        assert self._waiter is None or self._waiter.done(), "one pipeline at a time per connection"
        assert not (self._replies or self._head or self._skip) and self._body is None, "replies nobody asked for"
        self._want = n
        self._waiter = asyncio.get_running_loop().create_future()
        if self.broken:
            self._waiter.set_exception(rx.ConnectionError("connection closed"))
        return self._waiter

    @property
    def receiving_value(self) -> bool:
        """Whether part of a bulk value is in and the rest is awaited."""
        return self._body is not None and self._filled > 0

    def close(self) -> None:
        """Drop the connection now (mid-reply or not)."""
        self.broken = True
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio's side ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # No isinstance check: uvloop's transports are no asyncio.Transport subclasses.
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = True
        self._fail(rx.ConnectionError(f"connection lost: {exc!r}" if exc else "connection closed by the server"))

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost fails what is pending

    def get_buffer(self, sizehint: int) -> memoryview:
        body = self._body
        if body is not None:
            return memoryview(body)[self._filled:]
        return self._scratch_view

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._filled += nbytes
            if self._filled == len(self._body):
                self._done, self._body = self._body, None
                self._skip = 2  # the value is whole; it is a reply once its CRLF is in
            return
        self._head += self._scratch_view[:nbytes]
        self._parse()

    # -- parsing ------------------------------------------------------------------------------

    def _parse(self) -> None:
        head = self._head
        while self._body is None and not self.broken:
            if self._skip:
                k = min(self._skip, len(head))
                if head[:k] != b"\r\n"[2 - self._skip:2 - self._skip + k]:
                    return self._violation("a bulk string not followed by CRLF")
                del head[:k]
                self._skip -= k
                if self._skip:
                    return
                done, self._done = self._done, None
                self._reply(done)
                continue
            end = head.find(b"\r\n")
            if end < 0:
                if len(head) > SCRATCH:
                    self._violation("a reply header longer than 64 KiB")
                return
            kind, line = head[:1], bytes(head[1:end])
            if kind == b"$":
                try:
                    n = int(line)
                except ValueError:
                    return self._violation("a bulk length that is not a number")
                if n < 0:
                    del head[:end + 2]
                    self._reply(None)
                    continue
                body = bytearray(n)
                have = min(n, len(head) - end - 2)
                body[:have] = head[end + 2:end + 2 + have]
                del head[:end + 2 + have]
                if have == n:
                    self._done, self._skip = body, 2
                    continue
                self._body, self._filled = body, have
                return
            del head[:end + 2]
            text = line.decode("utf-8", "replace")
            if kind == b"-":
                self._reply(BaseParser.parse_error(text))
            elif kind == b"+":
                self._reply(line)
            elif kind == b":":
                try:
                    self._reply(int(line))
                except ValueError:
                    return self._violation("an integer reply that is not a number")
            else:
                return self._violation(f"a reply of type {bytes(kind)!r}")

    def _reply(self, value: Reply) -> None:
        if len(self._replies) >= self._want:
            return self._violation("a reply nobody asked for")
        self._replies.append(value)
        if len(self._replies) == self._want:
            waiter, replies = self._waiter, self._replies
            self._replies, self._waiter, self._want = [], None, 0
            if waiter is not None and not waiter.done():
                waiter.set_result(replies)

    def _violation(self, what: str) -> None:
        self._fail(ProtocolViolation(f"remote fast path: {what}"))
        self.close()

    def _fail(self, exc: BaseException) -> None:
        waiter = self._waiter
        self._waiter = None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class FastGets:
    """Pipelined GETs to cluster nodes on connections of :class:`GetReplies`, pooled per node.

    Not thread-safe; one event loop. Never raises for what a node answers: errors are replies.

    Raises (:meth:`get`): redis-py's ConnectionError (or OSError, ssl.SSLError) when the node
    cannot be reached or the connection breaks; the caller counts it like redis-py's.
    """

    def __init__(self, auth: RespAuth) -> None:
        self.auth = auth
        self._idle: dict[tuple[str, int], list[GetReplies]] = {}
        self.busy: set[GetReplies] = set()  # connections with a pipeline in flight
        self._ssl: ssl.SSLContext | None = None
        if auth.tls:
            # As redis-py's SSLConnection: certificates required, host names checked.
            self._ssl = ssl.create_default_context(cafile=auth.tls_ca_file)

    async def get(self, node: tuple[str, int], keys: Sequence[bytes]) -> list[Reply]:
        """The replies of ``GET key`` for each of ``keys``, in order, from ``node``."""
        conn = await self._acquire(node)
        done = False
        self.busy.add(conn)
        try:
            waiter = conn.expect(len(keys))
            assert conn.transport is not None
            conn.transport.write(b"".join(pack(b"GET", k) for k in keys))
            replies = await waiter
            done = True
            return replies
        finally:
            self.busy.discard(conn)
            if done and not conn.broken:
                idle = self._idle.setdefault(node, [])
                if len(idle) < IDLE_PER_NODE:
                    idle.append(conn)
                else:
                    conn.close()
            else:  # cancelled mid-reply or broken: its later bytes belong to nobody
                conn.close()

    async def _acquire(self, node: tuple[str, int]) -> GetReplies:
        idle = self._idle.get(node)
        while idle:
            conn = idle.pop()
            if not conn.broken:
                return conn
        host, port = node
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(GetReplies, host, port, ssl=self._ssl,
                                               server_hostname=host if self._ssl is not None else None)
        try:
            a = self.auth
            if a.user is not None or a.password is not None:
                waiter = conn.expect(1)
                assert conn.transport is not None
                conn.transport.write(pack(b"AUTH", (a.user or "default").encode(), (a.password or "").encode()))
                [answer] = await waiter
                if isinstance(answer, BaseException):
                    if isinstance(answer, rx.ResponseError) and not isinstance(answer, rx.AuthenticationError):
                        raise rx.AuthenticationError(str(answer))
                    raise answer
        except BaseException:
            conn.close()
            raise
        return conn

    def close(self) -> None:
        """Close every connection, idle or in use (a pipeline in flight fails)."""
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in list(self.busy):
            conn.close()
