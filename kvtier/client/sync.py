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

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier_protocol.errors import KVTierError, Unavailable

from kvtier.client import retry
from kvtier_protocol.address import Address, parse_address
from kvtier.client.api import ClientBase, degrade_error
from kvtier.client.errors import ConnectionLost
from kvtier.client.behind import DeferredFlush, LateErrors
from kvtier.client.calls import BLIND_OPS, Await, Call, Flow, Ticket
from kvtier.client.flows import NO_HITS, LookupResult
from kvtier.client.options import ClientOptions
from kvtier.client.session import Session
from kvtier.client.transport import BlockingConnection

if TYPE_CHECKING:
    import torch

    from kvtier_protocol.header import BlockHeader
    from kvtier_protocol.namespace import Namespace

T = TypeVar("T")


class Client(ClientBase):
    """A blocking connection to kvtierd that reconnects by itself.

    Args:
        address: ``"unix:/path"``, a plain path, ``"tcp://host:port"`` or ``"host:port"``.
        options: connection options; or pass their fields as keywords (token, tenant,
            client_name, timeout_s, connect_timeout_s, retries, holddown_s, lease_ms).

    The constructor does not connect: the first call does (see :meth:`connect` to fail early).
    """

    def __init__(self, address: str | Address, options: ClientOptions | None = None, **kwargs: Any) -> None:
        self.address = parse_address(address)
        self.options = options if options is not None else ClientOptions(**kwargs)
        self._holddown = retry.Holddown(self.options.holddown_s)
        self._conn: BlockingConnection | None = None
        self._lock = threading.RLock()
        self._closed = False
        self._late = LateErrors()  # write-behind failures of connections already replaced
        self._flusher = DeferredFlush(self._flush_held)

    @classmethod
    def connect(cls, address: str | Address, options: ClientOptions | None = None, **kwargs: Any) -> Client:
        """Create a client and connect it now.

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

    @property
    def session(self) -> Session | None:
        """The current connection's session (server, limits, segments), or None if not connected."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.session

    def _connection(self, deadline: float) -> BlockingConnection:
        if self._closed:
            raise ConnectionLost("the client is closed")
        conn = self._conn
        if conn is None or conn.closed:
            if conn is not None:
                conn.close()  # unmap the old segments before mapping the new ones
                self._keep_late(conn)
            self._conn = None
            self._conn = conn = BlockingConnection.open(self.address, self.options, deadline)
        return conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._keep_late(self._conn)

    def _keep_late(self, conn: BlockingConnection) -> None:
        self._late.absorb(conn.late)

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
        """Write held-back write-behind commits that no request took along (DeferredFlush).

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

    def _run(self, make_flow: Callable[[Session], Flow[T]], *, idempotent: bool,
             degrade: bool = False, fallback: Any = None) -> T:
        with self._lock:
            if self._closed:
                raise ConnectionLost("the client is closed")
            try:
                self._holddown.check(self.address)
                try:
                    result = self._attempts(make_flow, idempotent)
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
            conn = self._conn
            if conn is not None and conn.holding:
                self._flusher.arm()  # a write-behind commit waits for the next request, not long
            return result

    def _attempts(self, make_flow: Callable[[Session], Flow[T]], idempotent: bool) -> T:
        deadline = time.monotonic() + self.options.timeout_s
        tries = retry.attempts(self.options, idempotent)
        for attempt in range(tries):
            committed = [False]
            try:
                conn = self._connection(deadline)
                assert conn.session is not None, "set by hello"
                return self._drive(conn, make_flow(conn.session), deadline, committed)
            except KVTierError as exc:
                if isinstance(exc, Unavailable):
                    self._drop()
                if not retry.retriable(exc) or attempt + 1 == tries or committed[0]:
                    raise
                time.sleep(retry.backoff_s(attempt, deadline))
        raise AssertionError("unreachable: the last attempt returns or raises")

    @staticmethod
    def _drive(conn: BlockingConnection, flow: Flow[T], deadline: float, committed: list[bool]) -> T:
        reply: Any = None
        error: BaseException | None = None
        sent: dict[int, tuple[Call, int | None]] = {}  # ticket -> (call, request id) not awaited
        tickets = itertools.count(1)
        try:
            while True:
                try:
                    step = flow.send(reply) if error is None else flow.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                if isinstance(step, Await):
                    call, ident = sent.pop(step.ticket)
                    try:
                        reply = None if ident is None else conn.receive(ident, deadline)
                    except KVTierError as exc:
                        if not call.best_effort:
                            error = exc
                    continue
                committed[0] = committed[0] or step.commits
                ident = None
                try:
                    if conn.kept and step.op not in BLIND_OPS:
                        conn.settle(deadline)  # read your own writes: their commits first
                    elif conn.kept > conn.session.limits.max_inflight // 4:  # type: ignore[union-attr]
                        conn.settle(deadline, keep_last=conn.kept // 2)
                    ident = conn.send(step, deadline)
                    if step.wait:
                        reply = conn.receive(ident, deadline)
                except KVTierError as exc:
                    if not step.best_effort:
                        error = exc
                if not step.wait and error is None:
                    reply = Ticket(next(tickets))
                    sent[reply] = (step, ident)
        finally:
            flow.close()
            held = False
            for call, ident in sent.values():  # tickets never awaited: answers dropped, leases released
                if ident is None:
                    continue
                if call.behind:  # ... except write-behind commits: claimed later, held back a while
                    conn.keep(ident)
                    held = True
                else:
                    conn.forget(ident, deadline)
            if not conn.closed and not held:
                try:
                    conn.flush(deadline)  # deferred requests (releases, commits) leave with the call
                except KVTierError:
                    pass  # closed by flush; a lost release expires, a lost commit was never answered

    # -- operations --------------------------------------------------------------------------

    def lookup(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True) -> LookupResult:
        """How many of ``hashes``, from the first, are stored, and the tier of each hit.

        Args:
            ns_id: the namespace id (16 bytes).
            hashes: chain hashes of consecutive blocks of a prefix, first first.
            degrade: an unavailable daemon answers no hits instead of raising.

        Raises:
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
            InvalidKey: a malformed ns_id or hash.
        """
        return self._run(self._lookup_flow(ns_id, hashes), idempotent=True, degrade=degrade, fallback=NO_HITS)

    def save(self, ns_id: bytes, blocks: Sequence[tuple[bytes, bytes]], *,
             tokens: Sequence[Sequence[int] | None] | None = None,
             unit_hashes: Sequence[Sequence[bytes] | None] | None = None, priority: int = 0) -> list[str]:
        """Store whole block records; per block ``"stored"``, ``"exists"`` or ``"full"``.

        Args:
            ns_id: the namespace id; every record's header must name it and its key.
            blocks: ``(chain_hash, record)`` pairs; a record is header + payload (§4).
            tokens: optionally, per block, its token ids (for KV events).
            unit_hashes: optionally, per block, its hash-unit digests, last = the key.
            priority: eviction priority, -128..127 (higher is kept longer).

        Raises:
            Unavailable: the daemon is unreachable or silent.
            InvalidRequest, InvalidKey, HeaderError: malformed blocks (nothing is sent).
        """
        return self._run(self._save_flow(ns_id, blocks, tokens, unit_hashes, priority), idempotent=False)

    def load(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True) -> list[bytes]:
        """The whole records of the stored prefix of ``hashes`` (shorter on a miss).

        Each record is checked against its checksums and key; a failing one counts as a miss.

        Raises:
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
        """
        return self._run(self._load_flow(ns_id, hashes), idempotent=True, degrade=degrade, fallback=[])

    def load_into(self, ns_id: bytes, hashes: Sequence[bytes], buffers: Sequence[Any], *,
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
        return self._run(self._load_into_flow(ns_id, hashes, buffers), idempotent=True, degrade=degrade,
                         fallback=[])

    def save_tensors(self, ns: Namespace, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], *,
                     layout: str = "canonical", codec: str = "raw",
                     parents: Sequence[bytes | None] | None = None, **save_kwargs: Any) -> list[str]:
        """Encode block tensors into records of namespace ``ns`` and :meth:`save` them.

        Args:
            parents: parent chain hash per block; None: ``hashes`` form one chain from the root.
            save_kwargs: passed to :meth:`save` (tokens, unit_hashes, priority).
        """
        return self.save(ns.ns_id, self._encode(ns, hashes, tensors, layout, codec, parents), **save_kwargs)

    def load_tensors(self, ns: Namespace, hashes: Sequence[bytes], *, layout: str | None = None,
                     device: Any = "cpu", degrade: bool = True) -> list[torch.Tensor]:
        """:meth:`load` the stored prefix of ``hashes`` and decode each block into a tensor."""
        return self._decode(self.load(ns.ns_id, hashes, degrade=degrade), layout, device)

    def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Drop keys from every tier; returns how many existed."""
        return self._run(self._delete_flow(ns_id, hashes), idempotent=True)

    def clear(self, ns_id: bytes) -> int:
        """Drop every block of a namespace; returns how many there were."""
        return self._run(self._clear_flow(ns_id), idempotent=True)

    def stats(self) -> dict[str, Any]:
        """The daemon's counters and gauges (names are informative)."""
        return self._run(self._stats_flow(), idempotent=True)

    def ping(self) -> float:
        """Round-trip time of one ping, in seconds (connecting first if needed)."""
        return self._run(self._ping_flow(), idempotent=True)

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
                self._keep_late(conn)
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
