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
from typing import Any, TypeVar

from kvtier_protocol.address import Address
from kvtier_protocol.errors import KVTierError, Unavailable

from kvtier.client.aio_transport import AsyncConnection
from kvtier.client.core import ClientCore, Job
from kvtier.client.errors import TimedOut
from kvtier.client.options import ClientOptions
from kvtier.client.retry import attempts_of
from kvtier.client.session import Session
from kvtier.client.steps import FlowFactory, FlowRun

T = TypeVar("T")


class AsyncClient(ClientCore):
    """An asyncio connection to kvtierd that reconnects by itself. Its operations are those of
    :class:`~kvtier.client.Client` (documented on :class:`~kvtier.client.core.ClientCore`), each
    returning an awaitable; the arguments are checked when it is awaited.

    Use it from one event loop.
    """

    _conn: AsyncConnection | None

    def __init__(self, address: str | Address | None = None, options: ClientOptions | None = None,
                 **kwargs: Any) -> None:
        super().__init__(address, options, **kwargs)
        self._connect_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, address: str | Address | None = None, options: ClientOptions | None = None,
                      **kwargs: Any) -> AsyncClient:
        """Create a client and connect it now (see :meth:`Client.connect`)."""
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

    async def _connection(self) -> AsyncConnection:
        async with self._connect_lock:
            self._check_open()
            conn = self._conn
            if conn is None or conn.closed:
                if conn is not None:
                    await conn.close()  # unmap the old segments before mapping the new ones
                    self._late.absorb(conn.late)
                self._conn = None
                self._conn = conn = await AsyncConnection.open(self.address, self.options)
            return conn

    async def _run(self, job: Job[T]) -> T:  # type: ignore[override]
        make_flow = job.prepare()
        self._check_open()
        try:
            try:
                async with asyncio.timeout(self.options.timeout_s):
                    result = await self._attempts(make_flow, job.idempotent)
            except TimeoutError:
                if self._conn is not None:
                    self._conn.abort(TimedOut("a call on this connection timed out"))
                self._holddown.trip()
                raise TimedOut(f"no answer from {self.address} within {self.options.timeout_s}s") from None
        except Unavailable as exc:
            result = self._degraded(job, exc)
        else:
            self._holddown.reset()
        return job.finish(result)

    async def _attempts(self, make_flow: FlowFactory, idempotent: bool) -> Any:
        for attempt in attempts_of(self.options, idempotent, self._holddown, self.address):
            conn: AsyncConnection | None = None
            try:
                conn = await self._connection()
                return await self._drive(conn, attempt.start(make_flow, conn))
            except KVTierError as exc:
                if isinstance(exc, Unavailable) and conn is not None:
                    conn.abort(exc)
                await asyncio.sleep(attempt.pause_after(exc))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    async def _drive(conn: AsyncConnection, run: FlowRun[T]) -> T:
        """Do the I/O of ``run`` on ``conn`` (the call's timeout bounds it)."""
        try:
            io = run.resume()
            while io is not None:
                io = run.resume(*await conn.perform(io))
            return run.result  # type: ignore[return-value]
        finally:
            conn.finish(*run.close())

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
