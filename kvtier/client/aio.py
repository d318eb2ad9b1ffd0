"""The asyncio kvtier client: the API of :class:`kvtier.client.Client`, awaitable, with many
requests in flight on one connection.

::

    async with await AsyncClient.connect("unix:/run/kvtier/kvtier.sock") as kv:
        hits, records = await asyncio.gather(kv.lookup(ns_id, a), kv.load(ns_id, b))

Every call returns within ``timeout_s``; lookup and load turn an unavailable daemon into misses
unless called with ``degrade=False``. A timeout drops the connection (a stuck daemon would only
stall the calls behind it); the next call reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier_protocol.errors import KVTierError, Unavailable

from kvtier.client import retry
from kvtier_protocol.address import Address, parse_address
from kvtier.client.aio_transport import AsyncConnection, Sent
from kvtier.client.api import ClientBase, FlowFactory, degrade_error
from kvtier.client.errors import ConnectionLost, TimedOut
from kvtier.client.behind import LateErrors
from kvtier.client.calls import BLIND_OPS, Await, Call, Flow, Ticket
from kvtier.client.flows import NO_HITS, LookupResult
from kvtier.client.options import ClientOptions
from kvtier.client.session import Session

if TYPE_CHECKING:
    import torch

    from kvtier_protocol.header import BlockHeader
    from kvtier_protocol.namespace import Namespace

T = TypeVar("T")


class AsyncClient(ClientBase):
    """An asyncio connection to kvtierd that reconnects by itself.

    Args:
        address: ``"unix:/path"``, a plain path, ``"tcp://host:port"`` or ``"host:port"``.
        options: connection options; or pass their fields as keywords (token, tenant,
            client_name, timeout_s, connect_timeout_s, retries, holddown_s, lease_ms).

    The constructor does not connect: the first call does (see :meth:`connect` to fail early).
    Use it from one event loop.
    """

    def __init__(self, address: str | Address, options: ClientOptions | None = None, **kwargs: Any) -> None:
        self.address = parse_address(address)
        self.options = options if options is not None else ClientOptions(**kwargs)
        self._holddown = retry.Holddown(self.options.holddown_s)
        self._conn: AsyncConnection | None = None
        self._connect_lock = asyncio.Lock()
        self._closed = False
        self._late = LateErrors()  # write-behind failures of connections already replaced

    @classmethod
    async def connect(cls, address: str | Address, options: ClientOptions | None = None,
                      **kwargs: Any) -> AsyncClient:
        """Create a client and connect it now.

        Raises:
            Unavailable: the daemon cannot be reached within ``connect_timeout_s``.
            Unauthorized: the daemon refused the token.
        """
        client = cls(address, options, **kwargs)
        try:
            await client.open()
        except BaseException:
            await client.close()
            raise
        return client

    async def open(self) -> Session:
        """Connect (and say hello) unless connected; returns the session."""
        return (await self._connection()).session

    @property
    def session(self) -> Session | None:
        """The current connection's session (server, limits, segments), or None if not connected."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.session

    async def _connection(self) -> AsyncConnection:
        async with self._connect_lock:
            if self._closed:
                raise ConnectionLost("the client is closed")
            conn = self._conn
            if conn is None or conn.closed:
                if conn is not None:
                    await conn.close()  # unmap the old segments before mapping the new ones
                    self._late.absorb(conn.late)
                self._conn = None
                self._conn = conn = await AsyncConnection.open(self.address, self.options)
            return conn

    async def _run(self, make_flow: FlowFactory, *, idempotent: bool, degrade: bool = False,
                   fallback: Any = None) -> Any:
        if self._closed:
            raise ConnectionLost("the client is closed")
        try:
            self._holddown.check(self.address)
            try:
                async with asyncio.timeout(self.options.timeout_s):
                    result = await self._attempts(make_flow, idempotent)
            except TimeoutError:
                if self._conn is not None:
                    self._conn.abort(TimedOut("a call on this connection timed out"))
                self._holddown.trip()
                raise TimedOut(f"no answer from {self.address} within {self.options.timeout_s}s") from None
            except Unavailable as exc:
                if retry.trips_holddown(exc):
                    self._holddown.trip()
                raise
        except Unavailable as exc:
            if degrade:
                degrade_error(self.address, exc)
                return fallback
            raise
        self._holddown.reset()
        return result

    async def _attempts(self, make_flow: FlowFactory, idempotent: bool) -> Any:
        deadline = time.monotonic() + self.options.timeout_s
        tries = retry.attempts(self.options, idempotent)
        for attempt in range(tries):
            committed = [False]
            conn: AsyncConnection | None = None
            try:
                conn = await self._connection()
                return await self._drive(conn, make_flow(conn.session), committed)
            except KVTierError as exc:
                if isinstance(exc, Unavailable) and conn is not None:
                    conn.abort(exc)
                if not retry.retriable(exc) or attempt + 1 == tries or committed[0]:
                    raise
                await asyncio.sleep(retry.backoff_s(attempt, deadline))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    async def _drive(conn: AsyncConnection, flow: Flow[T], committed: list[bool]) -> T:
        reply: Any = None
        error: BaseException | None = None
        sent: dict[int, tuple[Call, Sent | None]] = {}  # ticket -> (call, request) not awaited
        tickets = itertools.count(1)
        try:
            while True:
                try:
                    step = flow.send(reply) if error is None else flow.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                if isinstance(step, Await):
                    call, request = sent.pop(step.ticket)
                    try:
                        reply = None if request is None else await conn.receive(request)
                    except KVTierError as exc:
                        if not call.best_effort:
                            error = exc
                    continue
                committed[0] = committed[0] or step.commits
                request = None
                try:
                    if conn.kept and step.op not in BLIND_OPS:
                        await conn.settle()  # read your own writes: their commits first
                    elif conn.kept > conn.session.limits.max_inflight // 4:
                        await conn.settle(keep_last=conn.kept // 2)
                    request = await conn.send(step)
                    if step.wait:
                        reply = await conn.receive(request)
                except KVTierError as exc:
                    if not step.best_effort:
                        error = exc
                if not step.wait and error is None:
                    reply = Ticket(next(tickets))
                    sent[reply] = (step, request)
        finally:
            flow.close()
            for call, request in sent.values():  # tickets never awaited: answers dropped, leases released
                if request is not None:
                    if call.behind:  # ... except write-behind commits: claimed later
                        conn.keep(request)
                    else:
                        conn.forget(request)

    # -- operations (see kvtier.client.Client for the full documentation) -------------------

    async def lookup(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True) -> LookupResult:
        """How many of ``hashes``, from the first, are stored, and the tier of each hit;
        no hits when the daemon is unavailable (``degrade``)."""
        return await self._run(self._lookup_flow(ns_id, hashes), idempotent=True, degrade=degrade,
                               fallback=NO_HITS)

    async def save(self, ns_id: bytes, blocks: Sequence[tuple[bytes, bytes]], *,
                   tokens: Sequence[Sequence[int] | None] | None = None,
                   unit_hashes: Sequence[Sequence[bytes] | None] | None = None,
                   priority: int = 0) -> list[str]:
        """Store whole block records; per block ``"stored"``, ``"exists"`` or ``"full"``."""
        flow = self._save_flow(ns_id, blocks, tokens, unit_hashes, priority)
        return await self._run(flow, idempotent=False)

    async def load(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True) -> list[bytes]:
        """The verified whole records of the stored prefix of ``hashes``; [] when the daemon is
        unavailable (``degrade``)."""
        return await self._run(self._load_flow(ns_id, hashes), idempotent=True, degrade=degrade, fallback=[])

    async def load_into(self, ns_id: bytes, hashes: Sequence[bytes], buffers: Sequence[Any], *,
                        degrade: bool = True) -> list[BlockHeader]:
        """Copy the payloads of the stored prefix of ``hashes`` into ``buffers``, one per key.

        Cheaper than :meth:`load`: no record is allocated, and each payload is verified (xxh3-64)
        chunk by chunk while it is copied. Buffer ``i`` receives block ``i``'s payload in its first
        ``headers[i].payload_len`` bytes (a bytearray, a memoryview, a numpy array, a CPU torch
        tensor's ``.numpy()``); buffers past the prefix are untouched.

        Returns:
            The verified headers of the blocks copied (layout, shape, dtype, codec, sections, to
            decode them), first first; shorter than ``hashes`` on a miss. A block that fails
            verification is a miss (its buffer's contents are then unspecified).

        Raises:
            InvalidRequest: not one writable contiguous buffer per key, or a buffer smaller
                than its block's payload (the blocks before it are copied).
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
        """
        return await self._run(self._load_into_flow(ns_id, hashes, buffers), idempotent=True,
                               degrade=degrade, fallback=[])

    async def save_tensors(self, ns: Namespace, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], *,
                           layout: str = "canonical", codec: str = "raw",
                           parents: Sequence[bytes | None] | None = None, **save_kwargs: Any) -> list[str]:
        """Encode block tensors into records of namespace ``ns`` and :meth:`save` them."""
        blocks = self._encode(ns, hashes, tensors, layout, codec, parents)
        return await self.save(ns.ns_id, blocks, **save_kwargs)

    async def load_tensors(self, ns: Namespace, hashes: Sequence[bytes], *, layout: str | None = None,
                           device: Any = "cpu", degrade: bool = True) -> list[torch.Tensor]:
        """:meth:`load` the stored prefix of ``hashes`` and decode each block into a tensor."""
        return self._decode(await self.load(ns.ns_id, hashes, degrade=degrade), layout, device)

    async def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Drop keys from every tier; returns how many existed."""
        return await self._run(self._delete_flow(ns_id, hashes), idempotent=True)

    async def clear(self, ns_id: bytes) -> int:
        """Drop every block of a namespace; returns how many there were."""
        return await self._run(self._clear_flow(ns_id), idempotent=True)

    async def stats(self) -> dict[str, Any]:
        """The daemon's counters and gauges (names are informative)."""
        return await self._run(self._stats_flow(), idempotent=True)

    async def ping(self) -> float:
        """Round-trip time of one ping, in seconds (connecting first if needed)."""
        return await self._run(self._ping_flow(), idempotent=True)

    async def _settle(self, conn: AsyncConnection) -> None:
        """Claim every write-behind commit's answer, within ``timeout_s``."""
        if conn.kept and not conn.closed:
            try:
                async with asyncio.timeout(self.options.timeout_s):
                    await conn.settle()
            except (KVTierError, TimeoutError):
                pass  # recorded as late by the connection (a timeout: the rest stay kept)

    async def flush(self) -> None:
        """Wait until every write-behind save so far is committed (``ClientOptions.write_behind``),
        and raise the first commit refused since the last flush (see :meth:`Client.flush`)."""
        conn = self._conn
        if conn is not None:
            await self._settle(conn)
            self._late.absorb(conn.late)
        self._late.raise_first()

    async def close(self) -> None:
        """Close the connection and unmap the segments; later calls raise Unavailable.
        Write-behind commits still unanswered are waited for first (within ``timeout_s``)."""
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            await self._settle(conn)
            await conn.close()
            self._late.absorb(conn.late)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
