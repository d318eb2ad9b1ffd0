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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvtier_protocol.errors import Busy, Unavailable

from kvtier.client.errors import ConnectionLost, TimedOut, Unreachable
from kvtier.client.options import ClientOptions

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
    """Remembers that the daemon was unavailable, to fail fast for ``seconds`` afterwards."""

    seconds: float
    until: float = 0.0

    def check(self, address: object) -> None:
        """Raise Unavailable while the hold-down lasts."""
        if time.monotonic() < self.until:
            raise Unavailable(f"daemon at {address} was unavailable moments ago; not retrying yet")

    def trip(self) -> None:
        """Start (or extend) the hold-down."""
        self.until = time.monotonic() + self.seconds

    def reset(self) -> None:
        """The daemon answered: end the hold-down."""
        self.until = 0.0
