"""The blocking kvtier client: plain sockets, one call at a time, safe to share across threads.

::

    with Client.connect("unix:/run/kvtier/kvtier.sock") as kv:
        hit = kv.lookup(ns_id, hashes)                  # LookupResult(num_hits, tiers)
        records = kv.load(ns_id, hashes[:hit.num_hits]) # whole verified records
        kv.save(ns_id, [(chain_hash, record), ...])     # ["stored" | "exists" | "full", ...]

Over a unix socket payloads move through the daemon's shared memory; over TCP they travel in
the frames. Every call returns within ``timeout_s``; lookup and load turn an unavailable daemon
into misses unless called with ``degrade=False``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, TypeVar

from kvtier_protocol.address import Address
from kvtier_protocol.errors import KVTierError, Unavailable

from kvtier.client.behind import DeferredFlush
from kvtier.client.core import ClientCore, Job
from kvtier.client.options import ClientOptions
from kvtier.client.retry import attempts_of
from kvtier.client.session import Session
from kvtier.client.steps import FlowFactory, FlowRun
from kvtier.client.transport import BlockingConnection

T = TypeVar("T")


class Client(ClientCore):
    """A blocking connection to kvtierd that reconnects by itself; its operations (lookup, save,
    load, load_into, save_tensors, load_tensors, delete, clear, stats, ping) and arguments are
    documented on :class:`~kvtier.client.core.ClientCore`.

    Calls are made one at a time (a lock), so one client may be shared across threads.
    """

    _conn: BlockingConnection | None

    def __init__(self, address: str | Address | None = None, options: ClientOptions | None = None,
                 **kwargs: Any) -> None:
        super().__init__(address, options, **kwargs)
        self._lock = threading.RLock()
        self._flusher = DeferredFlush(self._flush_held)

    @classmethod
    def connect(cls, address: str | Address | None = None, options: ClientOptions | None = None,
                **kwargs: Any) -> Client:
        """Create a client and connect it now (no address: the default one, see ClientCore).

        Raises:
            Unavailable: the daemon cannot be reached within ``connect_timeout_s``.
            Unauthorized: the daemon refused the token.
        """
        client = cls(address, options, **kwargs)
        try:
            client.open()
        except BaseException:
            client.close()
            raise
        return client

    def open(self) -> Session:
        """Connect (and say hello) unless connected; returns the session."""
        with self._lock:
            conn = self._connection(time.monotonic() + self.options.connect_timeout_s)
            assert conn.session is not None, "set by hello"
            return conn.session

    def _connection(self, deadline: float) -> BlockingConnection:
        self._check_open()
        conn = self._conn
        if conn is None or conn.closed:
            if conn is not None:
                conn.close()  # unmap the old segments before mapping the new ones
                self._late.absorb(conn.late)
            self._conn = None
            self._conn = conn = BlockingConnection.open(self.address, self.options, deadline)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._late.absorb(self._conn.late)

    def _settle(self, conn: BlockingConnection) -> None:
        """Write held-back requests and claim every write-behind commit's answer (lock held)."""
        if conn.closed or not (conn.kept or conn.holding):
            return
        deadline = time.monotonic() + self.options.timeout_s
        try:
            conn.flush(deadline)
            conn.settle(deadline)
        except KVTierError:
            pass  # recorded as late by the connection

    def _flush_held(self) -> None:
        """Write held-back write-behind commits and quiet releases that no request took along
        (DeferredFlush).

        Not while a call runs: it takes them along, or holds its own and arms the flush again
        when it ends (a flush queued behind it would write them before the next save's reserve).
        """
        if not self._lock.acquire(blocking=False):
            return
        try:
            conn = self._conn
            if conn is not None and conn.holding:
                try:
                    conn.flush(time.monotonic() + self.options.timeout_s)
                except KVTierError:
                    pass  # closed by flush, its commits recorded as unknown when it is replaced
        finally:
            self._lock.release()

    def _run(self, job: Job[T]) -> T:
        make_flow = job.prepare()
        with self._lock:
            self._check_open()
            try:
                result = self._attempts(make_flow, job.idempotent)
            except Unavailable as exc:
                result = self._degraded(job, exc)
            else:
                self._holddown.reset()
                if self._conn is not None and self._conn.holding:
                    self._flusher.arm()  # a write-behind commit or a quiet release waits for the next request, not long
        return job.finish(result)

    def _attempts(self, make_flow: FlowFactory, idempotent: bool) -> Any:
        for attempt in attempts_of(self.options, idempotent, self._holddown, self.address):
            try:
                conn = self._connection(attempt.deadline)
                return self._drive(conn, attempt.start(make_flow, conn), attempt.deadline)
            except KVTierError as exc:
                if isinstance(exc, Unavailable):
                    self._drop()
                time.sleep(attempt.pause_after(exc))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    def _drive(conn: BlockingConnection, run: FlowRun[T], deadline: float) -> T:
        """Do the I/O of ``run`` on ``conn``, each wait bounded by ``deadline``."""
        try:
            io = run.resume()
            while io is not None:
                io = run.resume(*conn.perform(io, deadline))
            return run.result  # type: ignore[return-value]
        finally:
            conn.finish(*run.close(), deadline)

    def flush(self) -> None:
        """Wait until every write-behind save so far is committed (``ClientOptions.write_behind``),
        and raise the first commit refused since the last flush. Without write-behind, a no-op.

        Raises:
            KVTierError: the typed error of a refused commit (its blocks are not stored), or
                ConnectionLost when the connection broke with commits unanswered (their blocks
                may or may not be stored). Either way the client stays usable.
        """
        with self._lock:
            conn = self._conn
            if conn is not None:
                self._settle(conn)
                self._late.absorb(conn.late)
            self._late.raise_first()

    def close(self) -> None:
        """Close the connection and unmap the segments; later calls raise Unavailable.

        Write-behind commits still unanswered are waited for first (within ``timeout_s``), so
        that a client closed right after a save has its blocks stored.
        """
        self._flusher.close()
        with self._lock:
            if self._conn is not None:
                self._settle(self._conn)
            self._closed = True
            self._drop()
            self._conn = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
