"""How a flow and its driver talk: the steps a flow yields (:class:`Call`, :class:`Await`), and
:class:`FlowRun`, which turns them into the I/O a driver does. No socket, no event loop.

A flow is a generator: it yields steps and receives, for each, what the driver got::

    yield Call(op, keys)               -> the typed response (or the call's error thrown in)
    yield Call(op, keys, wait=False)   -> a Ticket at once: the request is on the wire
    yield Await(ticket)                -> that request's typed response (or its error thrown in)

Requests sent without waiting let a flow overlap the daemon's work and the round trips with its
own copies (SPEC.md §7: many requests may be in flight on one connection, answered in any
order). A ticket the flow never awaits is *forgotten* by the driver when the flow ends: its
answer is read and dropped, and a lease it grants (``reserve``, ``acquire``) is released, unless
the call was sent ``behind``: then the connection *keeps* it and claims its answer later
(write-behind commits, ``ClientOptions.write_behind``).

:class:`FlowRun` is the part of driving that both clients share (sans I/O): it steps the flow,
hands out tickets, decides when write-behind answers must be claimed first (read your own
writes), swallows the errors of best-effort calls, and tells the driver which requests to keep
or forget at the end. A driver (``Client._drive``, ``AsyncClient._drive``) only does the
:data:`IO` it is given — :class:`Send`, :class:`Receive`, :class:`Settle` — and feeds back what
it got or the error it met.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NewType, TypeAlias, TypeVar

from kvtier_protocol.errors import FrameError, KVTierError
from kvtier_protocol.frames import Limits, Payload

T = TypeVar("T")

Ticket = NewType("Ticket", int)
"""A request sent with ``wait=False``, for :class:`Await` (unique within one flow)."""

LEASE_OPS = ("acquire", "reserve", "grant")
"""Requests whose answer grants a lease: a forgotten answer of one is released."""


def granted_lease(op: str, header: dict[str, Any]) -> int:
    """The lease a successful answer of ``op`` grants (``lease`` of :data:`LEASE_OPS`, a place's
    refill ``grant_lease``), 0 if none: what a forgotten answer must release."""
    if header.get("ok") is not True:
        return 0
    lease = header.get("lease") if op in LEASE_OPS else header.get("grant_lease") if op == "place" else None
    return lease if type(lease) is int and lease > 0 else 0

BLIND_OPS = frozenset({"reserve", "commit", "release", "ping", "grant", "place"})
"""Requests that may travel while write-behind commits (or places) are unanswered: none of them
reads what a commit changes (a reserve of a key being committed answers "exists", as it would
after; a place of one answers "exists"). Every other request first waits for those answers, so
that a client reads its own writes."""

JUMP_OPS = frozenset({"reserve", "acquire"})
"""Requests written ahead of the deferred ones still held back (commits, releases): the daemon
then grants the slots the client waits for first, and does the deferred work while the client
copies. An acquire never passes a commit: reads wait for commits first (:data:`BLIND_OPS`)."""


@dataclass(frozen=True, slots=True)
class Call:
    """One request of a flow.

    Attributes:
        op: the operation.
        keys: the op-specific header keys, in wire order (the driver adds ``op`` and ``id``).
        payload: the frame payload (put only).
        best_effort: a failure is not raised into the flow, which receives None instead
            (releases: the daemon reclaims the lease anyway when it expires).
        commits: the request makes blocks visible; a save is not retried once it was sent.
        wait: False: the driver sends the request and answers with a :data:`Ticket` at once (an
            error sending it is thrown in then); the response is claimed with :class:`Await`.
        defer: (with ``wait=False``) the request may be held back and written together with the
            next one (one write, one wake-up of the daemon for both); it is written at the latest
            before the driver waits for an answer or the flow ends (a ``behind`` commit: within
            ``kvtier.client.behind.FLUSH_AFTER_S`` of it). For requests nothing waits on soon: releases, commits.
        behind: (with ``wait=False``) the flow never claims the answer: the connection keeps it
            and claims it before the next request that reads (:data:`BLIND_OPS`), or on
            ``flush``/``close``. Write-behind commits only.
        into: (get only) the caller's buffers a transport may receive the records' payloads
            straight into (``load_into`` over TCP; :class:`Landing`).
    """

    op: str
    keys: dict[str, Any] = field(default_factory=dict)
    payload: Payload | None = None
    best_effort: bool = False
    commits: bool = False
    wait: bool = True
    defer: bool = False
    behind: bool = False
    into: Landing | None = None


@dataclass(frozen=True, slots=True)
class Landing:
    """Where the payloads of a get's records may land (``load_into`` over TCP): a transport that
    can (kvtier.client.transport) receives the payload of the get's ``j``-th key straight into
    ``dests[first + j]``, hashing it as it lands, and sets ``digests[first + j]`` to the xxh3-64
    of the bytes it wrote there; that record's payload bytes in the response are then left
    unfilled. Where it is None, the payload is in the response as usual.

    Attributes:
        dests: per key of the whole load, the caller's buffer.
        digests: per key of the whole load, set by the transport (shared by the load's gets).
        first: the index in ``dests`` of the get's first key.
    """

    dests: Sequence[memoryview]
    digests: list[int | None]
    first: int = 0


@dataclass(frozen=True, slots=True)
class Await:
    """Claim the response of a request sent with ``wait=False`` (each ticket once)."""

    ticket: Ticket


Step: TypeAlias = Call | Await
Flow: TypeAlias = Generator[Step, Any, T]


def expect_len(op: str, got: Sequence[Any], want: int) -> None:
    """Raise FrameError unless a response has one entry per key of its request."""
    if len(got) != want:
        raise FrameError(f"{op} response has {len(got)} entries for {want} keys")


FlowFactory: TypeAlias = Callable[[Any], Flow[Any]]
"""Starts an operation's flow on a connection's session (kvtier.client.session.Session), once
per attempt."""


# -- driving a flow, without I/O --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """I/O: write ``call``'s request (a deferred one may wait for the next write); what the driver
    feeds back is the request's handle (the connection's id or future of its answer)."""

    call: Call


@dataclass(frozen=True, slots=True)
class Receive:
    """I/O: wait for the answer of the request ``handle`` names; feed back its typed response."""

    handle: Any


@dataclass(frozen=True, slots=True)
class Settle:
    """I/O: claim the answers of the connection's kept write-behind commits, all but the newest
    ``keep_last``; feed back None."""

    keep_last: int


IO: TypeAlias = Send | Receive | Settle


def settle_first(op: str, kept: int, limits: Limits) -> int | None:
    """Before a request ``op`` goes out while ``kept`` write-behind answers are unclaimed: how
    many of them may stay unclaimed (None: all, nothing to do). A request that reads waits for
    all (:data:`BLIND_OPS`); others keep at most half once they pass a quarter of
    ``max_inflight``, so that kept answers never fill the daemon's window."""
    if kept and op not in BLIND_OPS:
        return 0  # read your own writes: their commits first
    if kept > limits.max_inflight // 4:
        return kept // 2
    return None


class FlowRun(Generic[T]):
    """One flow driven over one connection, as the I/O its steps need.

    A driver does what :meth:`resume` returns and resumes with what it got, or with the
    :class:`KVTierError` it met (which the run throws into the flow, unless the call was best
    effort), until :meth:`resume` returns None; then :attr:`result` holds the flow's result.
    Whatever happens, it ends with :meth:`close`, and keeps or forgets the requests named there
    (the transports' ``perform`` and ``finish``)::

        try:
            io = run.resume()
            while io is not None:
                io = run.resume(*conn.perform(io))   # (what the I/O gave, None) or (None, error)
            return run.result
        finally:
            conn.finish(*run.close())

    Attributes:
        committed: a request that makes blocks visible was sent (a save is not retried then).
        result: the flow's result, once :meth:`resume` returned None.
    """

    def __init__(self, flow: Flow[T], kept: Callable[[], int], limits: Limits) -> None:
        """``kept``: the connection's count of unclaimed write-behind answers (read before each
        request); ``limits``: the daemon's."""
        self.committed = False
        self.result: T | None = None
        self._sent: dict[Ticket, tuple[Call, Any]] = {}  # ticket -> (call, handle) not awaited
        self._io = self._steps(flow, kept, limits)

    def resume(self, got: Any = None, error: KVTierError | None = None) -> IO | None:
        """Feed back the outcome of the last I/O (nothing at the start); the next I/O, or None
        when the flow returned. Raises what the flow raises."""
        try:
            return self._io.send(got) if error is None else self._io.throw(error)
        except StopIteration as stop:
            self.result = stop.value
            return None

    def close(self) -> tuple[list[Any], list[Any]]:
        """End the run (the flow is closed at its current step). Returns the handles of the
        requests whose tickets the flow never awaited, as ``(keep, forget)``: the driver keeps
        the write-behind ones (``Call.behind``: the connection claims their answers later) and
        forgets the others (answers dropped, leases released)."""
        self._io.close()
        keep = [handle for call, handle in self._sent.values() if handle is not None and call.behind]
        forget = [handle for call, handle in self._sent.values() if handle is not None and not call.behind]
        self._sent.clear()
        return keep, forget

    def _steps(self, flow: Flow[T], kept: Callable[[], int], limits: Limits) -> Generator[IO, Any, T]:
        tickets = itertools.count(1)
        reply: Any = None
        error: KVTierError | None = None
        try:
            while True:
                try:
                    step = flow.send(reply) if error is None else flow.throw(error)
                except StopIteration as stop:
                    return stop.value
                reply, error = None, None
                if isinstance(step, Await):
                    call, handle = self._sent.pop(step.ticket)
                    try:
                        reply = None if handle is None else (yield Receive(handle))
                    except KVTierError as exc:
                        if not call.best_effort:
                            error = exc
                    continue
                self.committed = self.committed or step.commits
                handle = None
                try:
                    keep_last = settle_first(step.op, kept(), limits)
                    if keep_last is not None:
                        yield Settle(keep_last)
                    handle = yield Send(step)
                    if step.wait:
                        reply = yield Receive(handle)
                except KVTierError as exc:
                    if not step.best_effort:
                        error = exc
                if not step.wait and error is None:
                    reply = Ticket(next(tickets))
                    self._sent[reply] = (step, handle)
        finally:
            flow.close()
