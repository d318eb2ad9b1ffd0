"""The circuit breaker's states, driven by a clock the test advances (no waiting)."""

from __future__ import annotations

import pytest

from kvtier.daemon.remote.breaker import BreakerSettings, BreakerState, CircuitBreaker


class Clock:
    """A monotonic clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_consecutive_failures_and_a_success_resets_the_count() -> None:
    changes: list[tuple[BreakerState, BreakerState]] = []
    b = CircuitBreaker(BreakerSettings(failures=3, backoff_s=1.0), clock=Clock(),
                       on_change=lambda old, new: changes.append((old, new)))
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.allow()
    b.success()  # not consecutive any more
    for _ in range(2):
        assert b.allow()
        b.failure()
    assert b.state is BreakerState.CLOSED and changes == []
    assert b.allow()
    b.failure()
    assert b.state is BreakerState.OPEN
    assert changes == [(BreakerState.CLOSED, BreakerState.OPEN)]
    assert not b.allow()


def test_half_open_lets_one_probe_through_and_closes_on_success() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failures=1, backoff_s=2.0), clock=clock)
    b.allow()
    b.failure()
    clock.now += 1.9
    assert not b.allow()
    clock.now += 0.2
    assert b.allow()  # the probe
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow()  # only one probe at a time
    b.success()
    assert b.state is BreakerState.CLOSED
    assert b.allow() and b.allow()


def test_a_failed_probe_reopens_with_a_doubled_capped_backoff() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failures=1, backoff_s=1.0, max_backoff_s=3.0), clock=clock)
    b.allow()
    b.failure()
    for wait in (1.0, 2.0, 3.0, 3.0):  # 1, then doubled, then capped
        clock.now += wait - 0.01
        assert not b.allow()
        clock.now += 0.01
        assert b.allow()
        b.failure()
        assert b.state is BreakerState.OPEN
    clock.now += 3.0
    assert b.allow()
    b.success()
    b.allow()
    b.failure()  # after closing, the back-off starts from the beginning again
    clock.now += 1.0
    assert b.allow()


def test_an_abandoned_probe_frees_the_slot() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failures=1, backoff_s=1.0), clock=clock)
    b.allow()
    b.failure()
    clock.now += 1.0
    assert b.allow()
    b.abandon()  # the probing caller was cancelled
    assert b.state is BreakerState.HALF_OPEN
    assert b.allow()


def test_a_late_failure_while_open_changes_nothing() -> None:
    clock = Clock()
    b = CircuitBreaker(BreakerSettings(failures=1, backoff_s=1.0), clock=clock)
    assert b.allow() and b.allow()  # two calls in flight
    b.failure()
    b.failure()  # the second answers after the breaker opened
    clock.now += 1.0
    assert b.allow()


@pytest.mark.parametrize("kw", [dict(failures=0), dict(failures=True), dict(backoff_s=0.0),
                                dict(backoff_s=5.0, max_backoff_s=1.0)])
def test_settings_are_checked(kw: dict) -> None:
    with pytest.raises(ValueError):
        BreakerSettings(**kw)
