"""Counters (deltas between snapshots) and the bounded event log."""

from __future__ import annotations

import pytest

from kvtier.daemon.store.stats import EventKind, EventLog, StoreCounters, StoreEvent
from kvtier.daemon.store.types import Tier


def _event(i: int) -> StoreEvent:
    return StoreEvent(EventKind.STORED, Tier.DISK, b"n" * 16, bytes([i]) * 32, None, 16)


def test_minus_is_fieldwise_including_tiers():
    a, b = StoreCounters(), StoreCounters()
    a.commits, b.commits = 5, 2
    a.tiers[Tier.HOST].bytes_in = 100
    b.tiers[Tier.HOST].bytes_in = 40
    d = a.minus(b)
    assert d.commits == 3 and d.tiers[Tier.HOST].bytes_in == 60 and d.tiers[Tier.DISK].hits == 0


def test_copy_is_independent():
    a = StoreCounters()
    snap = a.copy()
    a.tiers[Tier.DISK].hits += 1
    a.demotions += 1
    assert snap.tiers[Tier.DISK].hits == 0 and snap.demotions == 0


def test_count_acquire_counts_hits_per_tier_and_misses_of_faster_tiers():
    c = StoreCounters()
    c.count_acquire([(10, Tier.HOST, Tier.HOST), (20, Tier.DISK, Tier.HOST)], missed=True, disk_on=True)
    host, disk = c.tiers[Tier.HOST], c.tiers[Tier.DISK]
    assert (host.hits, host.misses, host.bytes_out) == (1, 2, 30)
    assert (disk.hits, disk.misses) == (1, 1)


def test_count_acquire_charges_the_tier_the_client_reads_from():
    c = StoreCounters()
    # One block served in place from GPU, one copied down from GPU into host.
    c.count_acquire([(10, Tier.GPU, Tier.GPU), (20, Tier.GPU, Tier.HOST)], missed=False, disk_on=False)
    gpu, host = c.tiers[Tier.GPU], c.tiers[Tier.HOST]
    assert (gpu.hits, gpu.misses, gpu.bytes_out) == (2, 0, 10)
    assert (host.hits, host.misses, host.bytes_out) == (0, 1, 20)


@pytest.mark.parametrize("missed", [False, True])
@pytest.mark.parametrize("disk_on", [False, True])
def test_count_host_acquire_is_count_acquire_of_blocks_found_and_read_in_host(missed: bool, disk_on: bool):
    # The acquire fast path (every block in host) counts without a tuple per block.
    slow, fast = StoreCounters(), StoreCounters()
    slow.count_acquire([(10, Tier.HOST, Tier.HOST), (30, Tier.HOST, Tier.HOST)], missed=missed, disk_on=disk_on)
    fast.count_host_acquire(2, 40, missed=missed, disk_on=disk_on)
    assert fast == slow


def test_event_log_drops_the_oldest_beyond_its_bound_and_counts_them():
    counters = StoreCounters()
    log = EventLog(2, counters)
    for i in range(3):
        log.append(_event(i))
    assert [e.chain_hash[0] for e in log.take()] == [1, 2]
    assert counters.events_dropped == 1 and len(log) == 0
    assert _event(0).medium == "STORAGE"


def test_event_log_of_size_zero_records_nothing():
    log = EventLog(0, StoreCounters())
    log.append(_event(0))
    assert not log.enabled and log.take() == []
