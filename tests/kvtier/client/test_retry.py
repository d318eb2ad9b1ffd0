"""Which failures are retried, which start the hold-down, and the hold-down itself."""

from __future__ import annotations

import time

import pytest

from kvtier.client import ClientOptions, ConnectionLost, TimedOut
from kvtier.client.errors import Unreachable
from kvtier.client.retry import Holddown, attempts, backoff_s, retriable, trips_holddown
from kvtier_protocol.errors import Busy, InvalidRequest, LeaseError, Unavailable
from tests.kvtier.waitkit import ManualClock


def test_attempts() -> None:
    assert attempts(ClientOptions(retries=2), idempotent=True) == 3
    assert attempts(ClientOptions(retries=2), idempotent=False) == 2  # save: once more at most
    assert attempts(ClientOptions(retries=0), idempotent=False) == 1


@pytest.mark.parametrize("exc, retry, holddown", [
    (ConnectionLost("reset"), True, False),  # one broken connection: reconnect, no hold-down
    (Unreachable("refused"), True, True),
    (Unavailable("shutting down"), True, True),
    (Busy("full"), True, False),
    (TimedOut("silent"), False, True),
    (LeaseError("expired"), False, False),
    (InvalidRequest("bad"), False, False),
])
def test_classification(exc: Exception, retry: bool, holddown: bool) -> None:
    assert retriable(exc) is retry
    assert trips_holddown(exc) is holddown


def test_backoff_stays_within_the_deadline() -> None:
    far = time.monotonic() + 100
    assert [backoff_s(i, far) for i in range(6)] == [0.02, 0.04, 0.08, 0.16, 0.25, 0.25]
    assert backoff_s(3, time.monotonic() - 1) == 0


def test_holddown() -> None:
    clock = ManualClock()
    h = Holddown(0.5, clock=clock)
    h.check("addr")
    h.trip()
    with pytest.raises(Unavailable):
        h.check("addr")
    clock.advance(0.25)
    with pytest.raises(Unavailable):
        h.check("addr")  # still within
    clock.advance(0.25)  # over: exactly ``seconds`` after the trip
    h.check("addr")
    h.trip()
    h.reset()
    h.check("addr")
