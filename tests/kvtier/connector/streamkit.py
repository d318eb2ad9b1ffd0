"""Streams for testing the ordering of layer-wise copies on a host.

:class:`StreamClock` is a fake GPU: every stream is a queue of ops (work, waits on events) that
runs only when the clock steps, and the clock always runs the *copy* streams first whenever their
next op may run. So an op runs as early as the events it waits on allow, never later: a save copy
that forgot to wait for the compute that writes its page runs before that compute, and reads the
old bytes, every time (no timing involved).

:class:`GatedStream` is a host stream whose ``k``-th op blocks until the test opens the gate: an
injected delay on exactly one layer's copy.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvtier.connector.streams import DONE, Event, Streams


@dataclass(eq=False)
class ClockEvent:
    """Complete when ``stream`` has run its first ``upto`` ops."""

    clock: StreamClock
    stream: ClockStream
    upto: int

    def query(self) -> bool:
        with self.clock.lock:
            return self.stream.done >= self.upto

    def synchronize(self) -> None:
        self.clock.run_until(self.query)


@dataclass(eq=False)
class ClockStream:
    """One stream of a :class:`StreamClock`."""

    clock: StreamClock
    name: str
    ops: deque = field(default_factory=deque)  # ("run", fn) | ("wait", event)
    queued: int = 0
    done: int = 0

    def run(self, fn: Callable[[], None]) -> None:
        with self.clock.lock:
            self.ops.append(("run", fn))
            self.queued += 1

    def wait_event(self, event: Event) -> None:
        with self.clock.lock:
            self.ops.append(("wait", event))
            self.queued += 1

    def record_event(self) -> Event:
        with self.clock.lock:
            return ClockEvent(self.clock, self, self.queued)


class StreamClock:
    """Three fake streams; ops run only in :meth:`step`, copy streams first (see module docstring).

    Attributes:
        log: ``(stream name, op number)`` of every op run, in order.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.compute = ClockStream(self, "compute")
        self.load = ClockStream(self, "load")
        self.save = ClockStream(self, "save")
        self.log: list[tuple[str, int]] = []

    def streams(self) -> Streams:
        return Streams(self.compute, self.load, self.save)

    def step(self) -> bool:
        """Run one op (a copy stream's when one may run); False when none may run."""
        with self.lock:
            for s in (self.save, self.load, self.compute):
                if not s.ops:
                    continue
                kind, what = s.ops[0]
                if kind == "wait" and not _complete(what):
                    continue
                s.ops.popleft()
                if kind == "run":
                    what()
                s.done += 1
                self.log.append((s.name, s.done))
                return True
            return False

    def run_until(self, cond: Callable[[], bool]) -> None:
        while not cond():
            assert self.step(), "the stream clock is stuck: a wait on an event nothing will record"

    def drain(self) -> None:
        while self.step():
            pass


def _complete(event: Event) -> bool:
    # a wait on an event of this clock blocks the stream until then; any other event is complete
    # (DONE) or is synchronized by the host
    return event.query() if isinstance(event, ClockEvent) else (event.synchronize() or True)


class GatedStream:
    """A synchronous host stream whose op number ``gate_at`` (from 0) blocks until :meth:`open`."""

    def __init__(self, gate_at: int) -> None:
        self.gate_at = gate_at
        self.ops = 0
        self._gate = threading.Event()
        self.reached = threading.Event()

    def open(self) -> None:
        self._gate.set()

    def run(self, fn: Callable[[], None]) -> None:
        if self.ops == self.gate_at:
            self.reached.set()
            assert self._gate.wait(60.0), "the test never opened the gate"
        self.ops += 1
        fn()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def record_event(self) -> Event:
        return DONE
