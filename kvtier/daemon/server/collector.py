"""The daemon's policy for CPython's cyclic garbage collector: pauses that do not grow with the index.

Why. Every block the daemon indexes is objects the collector tracks (its ``BlockMeta``, its
slot). A full collection walks every tracked object, and CPython starts one whenever the objects
that survived into the oldest generation have grown by a quarter. With a million blocks indexed
(two million tracked objects) one such walk holds the event loop for ~0.95 s on a 2-core machine (``python -m kvtier.bench.gc_pause --blocks 1000000``), during
which no lookup or load is answered; under a steady stream of saves it comes back every few
hundred thousand blocks stored. The walks find nothing in the index: blocks never form
reference cycles, they are freed by reference counting the moment the index drops them.

What. ``gc.freeze()`` moves every tracked object alive now into a permanent generation that
collections skip (frozen objects are still freed by reference counting; the call itself is
O(1)). The daemon

  * freezes once when it is ready (the index loaded from the disk tier, modules, services);
  * freezes again right after every collection of the middle generation, so what survived it
    (blocks stored since, mostly) never reaches the oldest generation's walks: those walk only
    what the last few young collections let through;
  * raises the youngest generation's threshold to :data:`GEN0_THRESHOLD`: with the default (700
    allocations) the collections of all three generations took ~10 % of the store's put path
    (``reserve`` + ``commit`` of 32K small blocks: 140 ms of 1.3 s), a young one every ~170
    blocks; now a young one of up to ~5 ms every few thousand.

The price, and its bound. An object frozen while alive that later becomes part of an unreachable
cycle (a request's exception and its frames, say, in flight at the moment of a freeze) is not
reclaimed while frozen. Every :data:`FULL_INTERVAL_S` the daemon therefore unfreezes, runs one
full collection (a pause of the old length, once an hour instead of every quarter's growth) and
freezes again. ``kvtier_gc_pause_seconds`` (by generation) and ``kvtier_gc_frozen_objects`` show
both on ``/metrics``.

A library that embeds :class:`~kvtier.daemon.store.store.TieredStore` keeps its own process's policy:
only the daemon, which owns its process, changes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from bisect import bisect_left
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

FULL_INTERVAL_S = 3600.0
"""Seconds between full collections of everything, frozen objects included (see the module doc)."""
GEN0_THRESHOLD = 10_000
"""Allocations between young collections (CPython's default: 700; see the module doc)."""
SLOW_PAUSE_S = 0.1
"""A collection at least this long is logged (the slowest of those since the last log line)."""

PAUSE_BUCKETS = (1e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds (seconds) of the pause histogram; one more bucket takes the rest."""


@dataclass(slots=True)
class Pauses:
    """The collections of one generation: how many, their total time, and how many fell in each
    bucket of :data:`PAUSE_BUCKETS` (not cumulative; the last count is above every bound).

    Plain numbers, updated from the collector's callback without a lock (a lock taken there could
    be the one the interrupted code holds); read at each scrape.
    """

    count: int = 0
    total_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(PAUSE_BUCKETS) + 1))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_s += seconds
        self.buckets[bisect_left(PAUSE_BUCKETS, seconds)] += 1


class CollectorPolicy:
    """Freezes the daemon's long-lived objects and times every collection.

    Args:
        freeze: apply the policy of the module doc; False only times the collections (the
            interpreter's defaults otherwise, ``daemon.gc_freeze = false``).
        full_interval_s: see :data:`FULL_INTERVAL_S`.

    Attributes:
        pauses: per generation (0, 1, 2), the collections since :meth:`start`.
        freezes: freezes after a collection (every middle- or oldest-generation one).
    """

    def __init__(self, *, freeze: bool = True, full_interval_s: float = FULL_INTERVAL_S) -> None:
        assert full_interval_s > 0, "a positive interval"
        self.freeze = freeze
        self.full_interval_s = full_interval_s
        self.pauses = tuple(Pauses() for _ in range(3))
        self.freezes = 0
        self._started_at: float | None = None  # perf_counter of the collection under way
        self._saved_threshold: tuple[int, int, int] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued = False  # _after_collection is scheduled on the loop
        self._slow: tuple[int, float] | None = None  # the slowest pause not logged yet
        self._task: asyncio.Task[None] | None = None

    # --- life cycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Install the callback; with ``freeze``, also the threshold, a freeze of what exists
        now and the hourly full collection (on the running loop). Call once the daemon is ready."""
        assert self._loop is None, "a policy starts once"
        self._loop = asyncio.get_running_loop()
        if self.freeze:
            self._saved_threshold = gc.get_threshold()
            gc.set_threshold(GEN0_THRESHOLD, *self._saved_threshold[1:])
            self.full()
            self._task = self._loop.create_task(self._run(), name="kvtierd-gc")
        gc.callbacks.append(self._on_gc)

    async def stop(self) -> None:
        """Stop the periodic task, remove the callback, restore the threshold and unfreeze
        (idempotent): a daemon run inside a longer-lived process (tests) leaves no trace."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        self._loop = None
        if self._saved_threshold is not None:
            gc.set_threshold(*self._saved_threshold)
            self._saved_threshold = None
            gc.unfreeze()

    # --- freezing --------------------------------------------------------------------------------

    def full(self) -> float:
        """Unfreeze, collect every generation, freeze what is left; returns the seconds it took
        (a walk of every tracked object: see the module doc)."""
        t0 = time.perf_counter()
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        return time.perf_counter() - t0

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.full_interval_s)
            seconds = self.full()
            log.info("kvtierd: full garbage collection in %.3f s, %d objects frozen",
                     seconds, gc.get_freeze_count())

    # --- the collector's callback ----------------------------------------------------------------

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started_at = time.perf_counter()
            return
        started, self._started_at = self._started_at, None
        if started is None:  # installed mid-collection
            return
        seconds = time.perf_counter() - started
        generation = min(2, max(0, info.get("generation", 2)))
        self.pauses[generation].add(seconds)
        if seconds >= SLOW_PAUSE_S and (self._slow is None or seconds > self._slow[1]):
            self._slow = (generation, seconds)
        loop = self._loop
        if (generation >= 1 and self.freeze or self._slow is not None) and loop is not None and not self._queued:
            # Neither the freeze nor the log line here: the collection may have interrupted any
            # code, in any thread, holding any lock. Soon, on the loop.
            self._queued = True
            try:
                loop.call_soon_threadsafe(self._after_collection)
            except RuntimeError:  # the loop closed (a pool thread collecting during shutdown)
                self._queued = False

    def _after_collection(self) -> None:
        self._queued = False
        slow, self._slow = self._slow, None
        if slow is not None:
            log.warning("kvtierd: garbage collection of generation %d took %.3f s", *slow)
        if self.freeze and self._loop is not None:
            gc.freeze()  # what survived the collection is not walked again (see the module doc)
            self.freezes += 1

