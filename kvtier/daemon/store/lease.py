"""Leases: time-bounded pins held by clients between reserve/commit and acquire/release.

Torch-free, I/O-free. The table only records leases and finds the expired ones (a heap ordered by
expiry, O(log n) per lease); what a lease pins, and what reclaiming it means, is the store's job.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from kvtier.daemon.store.types import BlockKey

B = TypeVar("B")


class LeaseKind(enum.Enum):
    PUT = "put"  # reserve → commit: the blocks are pending, their slots are being written
    GET = "get"  # acquire → release: the blocks are committed, their slots are being read
    GRANT = "grant"  # grant → place: slots without keys yet (placeholder blocks), being written


@dataclass(slots=True, eq=False)
class Lease(Generic[B]):
    """One client's hold on a batch of blocks."""

    lease_id: int
    kind: LeaseKind
    keys: list[BlockKey]  # the keys the client named, in its order
    blocks: list[B | None]  # aligned with keys; None where the lease holds nothing for that key
    expires_at: float  # clock value after which the lease may be reclaimed
    held: list[B] = field(default_factory=list)  # the non-None blocks, in order


class LeaseTable(Generic[B]):
    """Open leases by id, with expiry order."""

    def __init__(self) -> None:
        self._leases: dict[int, Lease[B]] = {}
        self._heap: list[tuple[float, int]] = []
        self._next_id = 1

    def open(self, kind: LeaseKind, keys: list[BlockKey], blocks: list[B | None], expires_at: float) -> Lease[B]:
        """Record a new lease; ids are positive, increasing and never reused within a process."""
        assert len(keys) == len(blocks), "blocks align with keys"
        lease = Lease(self._next_id, kind, keys, blocks, expires_at, [b for b in blocks if b is not None])
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._heap, (expires_at, lease.lease_id))
        return lease

    def get(self, lease_id: int) -> Lease[B] | None:
        return self._leases.get(lease_id)

    def pop(self, lease_id: int) -> Lease[B] | None:
        """Remove and return a lease (its heap entry is skipped lazily)."""
        lease = self._leases.pop(lease_id, None)
        if len(self._heap) > 2 * len(self._leases) + 64:
            # Most leases end by release long before they expire; drop their stale heap entries
            # now and then so the heap stays proportional to the open leases.
            self._heap = [(lz.expires_at, lz.lease_id) for lz in self._leases.values()]
            heapq.heapify(self._heap)
        return lease

    def pop_expired(self, now: float) -> list[Lease[B]]:
        """Remove and return every lease whose ``expires_at`` is ``<= now``."""
        out: list[Lease[B]] = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            expires_at, lease_id = heapq.heappop(heap)
            lease = self._leases.get(lease_id)
            # A lease popped by release/commit leaves a stale heap entry: skip it.
            if lease is not None and lease.expires_at == expires_at:
                del self._leases[lease_id]
                out.append(lease)
        return out

    def pop_all(self) -> list[Lease[B]]:
        """Remove and return every open lease (at shutdown)."""
        out = list(self._leases.values())
        self._leases.clear()
        self._heap.clear()
        return out

    def next_expiry(self) -> float | None:
        """Earliest expiry among open leases (may be a stale entry's, never later than the true one)."""
        return self._heap[0][0] if self._heap else None

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[Lease[B]]:
        return iter(list(self._leases.values()))
