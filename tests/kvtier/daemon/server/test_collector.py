"""The daemon's garbage-collector policy: what it freezes and when, the bound on what a freeze
keeps, the pause accounting, and that stopping it leaves the interpreter as it was."""

from __future__ import annotations

import asyncio
import gc
import logging
import weakref

import pytest

from kvtier.daemon.server import collector
from kvtier.daemon.server.collector import GEN0_THRESHOLD, PAUSE_BUCKETS, CollectorPolicy, Pauses
from tests.kvtier.waitkit import wait_until_async


class Node:
    """Something the collector tracks (and that can form a cycle)."""

    def __init__(self) -> None:
        self.other: Node | None = None


def _frozen(obj: object) -> bool:
    """Whether ``obj`` is out of the collector's walks (in none of its three generations)."""
    return id(obj) not in {id(o) for o in gc.get_objects()}


async def _settle() -> None:
    for _ in range(3):  # the policy's work after a collection is scheduled on the loop
        await asyncio.sleep(0)


async def test_start_freezes_what_exists_and_stop_restores_the_interpreter():
    before = gc.get_threshold()
    policy = CollectorPolicy()
    policy.start()
    try:
        assert gc.get_threshold() == (GEN0_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0  # the modules, the test's objects: all out of the walks
        assert policy._on_gc in gc.callbacks
    finally:
        await policy.stop()
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0
    assert policy._on_gc not in gc.callbacks
    await policy.stop()  # idempotent


async def test_survivors_of_a_middle_collection_are_frozen_young_ones_are_not():
    policy = CollectorPolicy()
    policy.start()
    try:
        blocks = [Node() for _ in range(1000)]  # what a burst of saves leaves in the index
        gc.collect(0)
        await _settle()
        assert policy.freezes == 0 and not any(map(_frozen, blocks))  # a young collection: no freeze
        gc.collect(1)
        await _settle()
        assert policy.freezes == 1
        assert all(map(_frozen, blocks))  # never walked again
        assert policy.pauses[0].count >= 1 and policy.pauses[1].count >= 1
    finally:
        await policy.stop()


async def test_a_frozen_cycle_is_reclaimed_by_the_full_collection():
    """The price of freezing, and its bound: a cycle alive at a freeze and dropped later is not
    collected while frozen; the periodic full collection reclaims it."""
    policy = CollectorPolicy()
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    policy.start()
    try:
        del a, b
        gc.collect()
        assert gone() is not None  # frozen: kept
        policy.full()
        assert gone() is None
    finally:
        await policy.stop()


async def test_the_full_collection_runs_every_interval():
    policy = CollectorPolicy(full_interval_s=0.05)
    policy.start()
    try:
        a = Node()
        a.other = a
        gone = weakref.ref(a)
        del a
        policy.full()  # freezes nothing dead; the cycle above is garbage but not frozen either
        assert gone() is None
        b = Node()
        b.other = b
        gone = weakref.ref(b)
        gc.freeze()  # as a freeze after a collection would, while it was alive
        del b
        await wait_until_async(lambda: gone() is None, what="the periodic full collection")
    finally:
        await policy.stop()


async def test_without_freeze_only_the_pauses_are_timed():
    before = gc.get_threshold()
    policy = CollectorPolicy(freeze=False)
    policy.start()
    try:
        assert gc.get_threshold() == before and gc.get_freeze_count() == 0
        gc.collect(1)
        gc.collect()
        await _settle()
        assert policy.freezes == 0 and gc.get_freeze_count() == 0
        assert policy.pauses[1].count >= 1 and policy.pauses[2].count >= 1
    finally:
        await policy.stop()


async def test_a_slow_collection_is_logged_once_on_the_loop(monkeypatch, caplog):
    monkeypatch.setattr(collector, "SLOW_PAUSE_S", 0.0)
    policy = CollectorPolicy(freeze=False)
    policy.start()
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.daemon.server.collector"):
            gc.collect(0)
            gc.collect(0)
            assert not caplog.records  # not from inside the collector's callback
            await _settle()
        slow = [r for r in caplog.records if "garbage collection of generation" in r.getMessage()]
        assert len(slow) == 1  # the slowest of those since the last line
    finally:
        await policy.stop()


async def test_collections_in_another_thread_are_handed_to_the_loop():
    policy = CollectorPolicy()
    policy.start()
    try:
        await asyncio.get_running_loop().run_in_executor(None, gc.collect, 1)
        await _settle()
        assert policy.freezes >= 1
    finally:
        await policy.stop()


def test_pauses_fall_in_le_buckets():
    p = Pauses()
    for seconds in (0.0, PAUSE_BUCKETS[0], PAUSE_BUCKETS[0] * 1.5, 10.0):
        p.add(seconds)
    assert p.count == 4 and p.total_s == pytest.approx(sum((0.0, PAUSE_BUCKETS[0], PAUSE_BUCKETS[0] * 1.5, 10.0)))
    assert p.buckets[0] == 2  # le: a pause equal to the bound counts in its bucket
    assert p.buckets[1] == 1
    assert p.buckets[-1] == 1  # above every bound
    assert sum(p.buckets) == p.count
