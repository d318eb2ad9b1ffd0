"""What a flow yields to its driver: a request (:class:`Call`), or a claim on the answer of one it
sent earlier without waiting (:class:`Await`).

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
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import Any, NewType, TypeAlias, TypeVar

from kvtier_protocol.errors import FrameError
from kvtier_protocol.frames import Payload

T = TypeVar("T")

Ticket = NewType("Ticket", int)
"""A request sent with ``wait=False``, for :class:`Await` (unique within one flow)."""

LEASE_OPS = ("acquire", "reserve", "grant")
"""Requests whose answer grants a lease: a forgotten answer of one is released."""

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
    """

    op: str
    keys: dict[str, Any] = field(default_factory=dict)
    payload: Payload | None = None
    best_effort: bool = False
    commits: bool = False
    wait: bool = True
    defer: bool = False
    behind: bool = False


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
