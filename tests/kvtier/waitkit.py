"""Waiting in tests without betting on the machine's speed: conditions with generous deadlines,
and a clock that moves only when a test says so.

A test that sleeps "long enough" or asserts that something took "less than X seconds" fails on a
busy machine; one that waits for the state it needs, with a deadline far beyond any normal run,
fails only when that state never comes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

PATIENCE_S = 60.0  # a deadline no healthy run comes near, even on a loaded 2-core machine


def wait_until(condition: Callable[[], object], timeout_s: float = PATIENCE_S, what: str = "the condition",
               interval_s: float = 0.01) -> None:
    """Poll ``condition`` until it is true.

    Raises:
        AssertionError: it was still false after ``timeout_s`` (naming ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        time.sleep(interval_s)


async def wait_until_async(condition: Callable[[], object], timeout_s: float = PATIENCE_S,
                           what: str = "the condition", interval_s: float = 0.005) -> None:
    """:func:`wait_until` for a coroutine: yields to the event loop between polls."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout_s} s"
        await asyncio.sleep(interval_s)


class ManualClock:
    """A monotonic clock for an injectable ``clock=`` parameter: it reads ``now`` and moves only
    by :meth:`advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward."""
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds
