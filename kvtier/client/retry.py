"""When a client call retries, and when it stops trying (shared by both clients).

* Every call has one deadline, ``timeout_s`` from its start, covering reconnects and retries.
* A lost connection (refused, reset, closed, or the daemon saying ``unavailable`` while it shuts
  down) is retried after reconnecting: idempotent calls up to ``retries`` times, ``save`` once and
  only if its commit (or put) was not sent yet. ``busy`` is retried on the same connection.
* Silence (:class:`TimedOut`) is never retried: the deadline is spent, and a stuck daemon would
  only stall the caller again.
* After a call found the daemon unreachable, silent or shutting down, calls within ``holddown_s``
  fail at once (lookup and load degrade to misses), so an engine does not wait ``timeout_s`` per
  request on a dead daemon. A connection lost mid-call alone does not start it.

Both drivers loop over :func:`attempts_of` (which checks the hold-down first) and ask each failed
:class:`Attempt` whether to go on (:meth:`Attempt.pause_after`: the pause, or the error raised).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtier_protocol.errors import Busy, KVTierError, Unavailable

from kvtier.client.errors import ConnectionLost, TimedOut, Unreachable
from kvtier.client.options import ClientOptions
from kvtier.client.steps import FlowFactory, FlowRun

_BACKOFF_BASE_S = 0.02
_BACKOFF_MAX_S = 0.25


def attempts(options: ClientOptions, idempotent: bool) -> int:
    """How many times a call may be tried in all."""
    return 1 + (options.retries if idempotent else min(options.retries, 1))


def retriable(exc: BaseException) -> bool:
    """Whether another attempt may succeed: a lost connection or ``busy``, never silence."""
    return isinstance(exc, Busy) or (isinstance(exc, Unavailable) and not isinstance(exc, TimedOut))


def trips_holddown(exc: BaseException) -> bool:
    """Whether a failed call is evidence that the daemon is down (not just one broken connection)."""
    if not isinstance(exc, Unavailable):
        return False
    return not isinstance(exc, ConnectionLost) or isinstance(exc, Unreachable)


def backoff_s(attempt: int, deadline: float) -> float:
    """Pause before attempt ``attempt + 1``: exponential from 20 ms, capped, within the deadline."""
    return max(0.0, min(_BACKOFF_BASE_S * (2 ** attempt), _BACKOFF_MAX_S, deadline - time.monotonic()))


def remaining_s(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``.

    Raises:
        TimedOut: none left.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimedOut(f"{what}: no answer within the call's timeout")
    return left


@dataclass(slots=True)
class Holddown:
    """Remembers that the daemon was unavailable, to fail fast for ``seconds`` afterwards.

    ``clock`` is the monotonic clock the hold-down is measured on (a test passes one it advances
    by hand, so that "within" and "after" the hold-down do not depend on the machine's speed).
    """

    seconds: float
    until: float = 0.0
    clock: Callable[[], float] = time.monotonic

    def check(self, address: object) -> None:
        """Raise Unavailable while the hold-down lasts."""
        if self.clock() < self.until:
            raise Unavailable(f"daemon at {address} was unavailable moments ago; not retrying yet")

    def trip(self) -> None:
        """Start (or extend) the hold-down."""
        self.until = self.clock() + self.seconds

    def reset(self) -> None:
        """The daemon answered: end the hold-down."""
        self.until = 0.0


@dataclass(slots=True)
class Attempt:
    """One try of a call (see :func:`attempts_of`): the driver starts the flow on a connection
    (:meth:`start`), does its I/O, and on a :class:`KVTierError` asks :meth:`pause_after` whether
    to try again."""

    number: int
    tries: int
    deadline: float
    holddown: Holddown
    run: FlowRun[Any] | None = None

    def start(self, make_flow: FlowFactory, conn: Any) -> FlowRun[Any]:
        """The run of the call's flow on ``conn`` (a connection after hello: ``session``, ``kept``)."""
        session = conn.session
        self.run = FlowRun(make_flow(session), lambda: conn.kept, session.limits)
        return self.run

    def pause_after(self, exc: KVTierError) -> float:
        """Seconds to wait before the next attempt, after this one failed with ``exc``.

        Raises:
            KVTierError: ``exc``, when no attempt follows: it is not :func:`retriable`, this was
                the last try, or the flow sent a commit (a save is never repeated then). If
                ``exc`` shows the daemon down (:func:`trips_holddown`), the hold-down starts.
        """
        committed = self.run is not None and self.run.committed
        if retriable(exc) and self.number + 1 < self.tries and not committed:
            return backoff_s(self.number, self.deadline)
        if trips_holddown(exc):
            self.holddown.trip()
        raise exc


def attempts_of(options: ClientOptions, idempotent: bool, holddown: Holddown, address: object) -> Iterator[Attempt]:
    """The attempts of one call, sharing its deadline (``timeout_s`` from now).

    Raises:
        Unavailable: the hold-down lasts (before the first attempt; it is not extended).
    """
    holddown.check(address)
    deadline = time.monotonic() + options.timeout_s
    tries = attempts(options, idempotent)
    for number in range(tries):
        yield Attempt(number, tries, deadline, holddown)
