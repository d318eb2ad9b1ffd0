"""A circuit breaker: stop calling a remote engine that keeps failing, probe it back now and then.

::

    closed --(N consecutive failures)--> open --(back-off elapsed)--> half_open
    half_open --(the probe succeeds)--> closed
    half_open --(the probe fails)--> open, with a doubled back-off (capped)

While open every call is refused at once (the caller answers a miss): a dead cluster then costs
nothing per request instead of a timeout per request. In half-open exactly one call, the probe, goes
through; the others are refused until it has answered. No I/O; the clock is injectable.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    """Where the breaker stands; ``value`` is the name exported to metrics."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """Attributes:
        failures: consecutive failed calls that open the breaker (>= 1).
        backoff_s: first wait before a probe (> 0).
        max_backoff_s: the cap of the doubling back-off (>= backoff_s).
    """

    failures: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.failures, bool) or not isinstance(self.failures, int) or self.failures < 1:
            raise ValueError(f"breaker failures must be an integer >= 1, got {self.failures!r}")
        if not self.backoff_s > 0 or not self.max_backoff_s >= self.backoff_s:
            raise ValueError(f"breaker back-off must satisfy 0 < backoff_s ({self.backoff_s}) "
                             f"<= max_backoff_s ({self.max_backoff_s})")


class CircuitBreaker:
    """One breaker. Call :meth:`allow` before a call; report its outcome with :meth:`success` or
    :meth:`failure` (a call that was allowed must report exactly one of them).

    ``on_change(old, new)`` is called on every state change (the owner logs and counts it).
    """

    def __init__(self, settings: BreakerSettings = BreakerSettings(), *,
                 clock: Callable[[], float] = time.monotonic,
                 on_change: Callable[[BreakerState, BreakerState], None] | None = None) -> None:
        self.settings = settings
        self._clock = clock
        self._on_change = on_change
        self.state = BreakerState.CLOSED
        self._failures = 0  # consecutive, while closed
        self._backoff_s = settings.backoff_s
        self._retry_at = 0.0  # when open: the time a probe may go
        self._probing = False  # half-open: the probe is in flight

    def allow(self) -> bool:
        """Whether a call may go now (in half-open: True once, for the probe)."""
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN:
            if self._clock() < self._retry_at:
                return False
            self._set(BreakerState.HALF_OPEN)
        if self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        """The call reached a working engine."""
        self._failures = 0
        self._probing = False
        self._backoff_s = self.settings.backoff_s
        if self.state is not BreakerState.CLOSED:
            self._set(BreakerState.CLOSED)

    def failure(self) -> None:
        """The call found the engine unreachable, timed out or refusing service."""
        if self.state is BreakerState.HALF_OPEN:
            self._probing = False
            self._backoff_s = min(self._backoff_s * 2, self.settings.max_backoff_s)
            self._open()
        elif self.state is BreakerState.CLOSED:
            self._failures += 1
            if self._failures >= self.settings.failures:
                self._open()
        # OPEN: a call allowed before the breaker opened answered late; nothing changes.

    def abandon(self) -> None:
        """An allowed call ended without an outcome (its caller was cancelled): free the probe
        slot so the next call may probe, instead of half-open refusing everything forever."""
        self._probing = False

    def _open(self) -> None:
        self._failures = 0
        self._retry_at = self._clock() + self._backoff_s
        self._set(BreakerState.OPEN)

    def _set(self, new: BreakerState) -> None:
        old, self.state = self.state, new
        if self._on_change is not None and old is not new:
            self._on_change(old, new)
