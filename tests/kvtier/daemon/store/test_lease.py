"""LeaseTable: ids, expiry order, stale heap entries."""

from __future__ import annotations

from kvtier.daemon.store.lease import LeaseKind, LeaseTable
from kvtier.daemon.store.types import BlockKey

K = [BlockKey(bytes([i]) * 48) for i in range(4)]


def test_open_assigns_increasing_ids_and_keeps_held_blocks():
    table: LeaseTable[str] = LeaseTable()
    a = table.open(LeaseKind.PUT, K[:2], ["x", None], expires_at=10.0)
    b = table.open(LeaseKind.GET, K[2:3], ["y"], expires_at=5.0)
    assert 0 < a.lease_id < b.lease_id
    assert a.held == ["x"] and b.held == ["y"]
    assert table.get(a.lease_id) is a and len(table) == 2


def test_pop_expired_returns_leases_in_expiry_order_and_only_due_ones():
    table: LeaseTable[str] = LeaseTable()
    late = table.open(LeaseKind.GET, K[:1], ["a"], expires_at=30.0)
    early = table.open(LeaseKind.GET, K[1:2], ["b"], expires_at=10.0)
    mid = table.open(LeaseKind.PUT, K[2:3], ["c"], expires_at=20.0)
    assert table.pop_expired(9.99) == []
    assert table.pop_expired(20.0) == [early, mid]
    assert table.get(early.lease_id) is None
    assert table.next_expiry() == 30.0
    assert table.pop_expired(100.0) == [late]
    assert len(table) == 0


def test_released_lease_never_expires_later():
    table: LeaseTable[str] = LeaseTable()
    lease = table.open(LeaseKind.GET, K[:1], ["a"], expires_at=1.0)
    assert table.pop(lease.lease_id) is lease
    assert table.pop(lease.lease_id) is None
    assert table.pop_expired(5.0) == []


def test_heap_of_stale_entries_is_compacted():
    table: LeaseTable[str] = LeaseTable()
    keep = table.open(LeaseKind.GET, K[:1], ["k"], expires_at=1e9)
    for i in range(500):
        table.pop(table.open(LeaseKind.GET, K[:1], ["x"], expires_at=1e6 + i).lease_id)
    assert len(table._heap) <= 2 * len(table) + 65
    assert table.pop_expired(2e9) == [keep]
