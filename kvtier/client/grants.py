"""Slots the daemon granted this connection ahead of time, for saves of one round trip.

A save over shared memory normally asks for its slots (``reserve``), waits for them, copies, then
commits: two round trips and the daemon's bookkeeping of both, of which only the commit can be
overlapped with anything. With a pool of *granted* slots (SPEC.md §7.4 ``grant``: slots of a
given size with no key yet), a save copies at once into slots it already holds, names their keys
in one ``place``, and sends the ``grant`` that refills the pool first, so that the daemon makes
it while the client copies::

    save k:    grant(n) ── copy k into granted slots ── place k ── (refill answered meanwhile)

A daemon that announces ``place_grant`` takes the refill in the place itself (SPEC.md §7.4 place
``grant_sizes``): one request per save, the next save's slots in the place's answer::

    save k:    copy k into granted slots ── place k + refill(n) ── (slots for save k+1 answered)

This module is the pool's bookkeeping only (no requests); the save that uses it is
``kvtier.client.save.granted_save_flow``. The pool holds the slots of one connection (the daemon frees them when it ends), by payload
size and priority, each with the time its grant lapses. It stays small: at most ``limit_bytes``
(``ClientOptions.grant_bytes``, and an eighth of the daemon's host segments, so that a pool never
crowds out the cache it feeds); a save larger than that, or of mixed block sizes, reserves as
before. A slot is only handed out while more than half of its grant's lease is left, so a copy
never races the daemon's reclaim; older grants are released.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvtier_protocol.frames import SlotRef

LEASE_MARGIN = 0.5
"""Fraction of a grant's lease after which its slots are no longer handed out (and it is
released): a copy into a slot always finishes well before the daemon could reclaim it."""
HOST_FRACTION = 8
"""A pool holds at most 1/HOST_FRACTION of the daemon's host segments."""


@dataclass(frozen=True, slots=True)
class Granted:
    """One granted slot: write the payload into ``slot``, then place it as ``position`` of ``lease``."""

    lease: int
    position: int
    slot: SlotRef


@dataclass(slots=True)
class _Shelf:
    """The granted slots of one (size, priority), oldest grant first, and when each grant stops
    being handed out."""

    slots: deque[Granted] = field(default_factory=deque)
    until: dict[int, float] = field(default_factory=dict)  # lease -> monotonic deadline


class GrantPool:
    """Granted slots of one connection, by (payload size, priority). Not thread-safe: one flow
    at a time uses a connection's session."""

    def __init__(self, limit_bytes: int, clock=time.monotonic) -> None:
        self.limit_bytes = limit_bytes
        self.enabled = limit_bytes > 0
        self._clock = clock
        self._shelves: dict[tuple[int, int], _Shelf] = {}
        self._stale: list[int] = []  # leases to release: lapsed, or dropped after a failure

    def fits(self, size: int, count: int, priority: int) -> bool:
        """Whether a save of ``count`` payloads of ``size`` bytes may use the pool: the slots it
        keeps for such saves and those it holds for others stay within ``limit_bytes``."""
        if not self.enabled or size <= 0:
            return False
        others = sum(k[0] * len(shelf.slots) for k, shelf in self._shelves.items() if k != (size, priority))
        return size * count + others <= self.limit_bytes

    def take(self, size: int, priority: int, count: int) -> list[Granted] | None:
        """``count`` slots of ``size`` bytes, oldest grant first, or None (the pool keeps them)
        when it holds fewer."""
        shelf = self._shelves.get((size, priority))
        if shelf is None:
            return None
        self._expire(shelf)
        if len(shelf.slots) < count:
            return None
        taken = [shelf.slots.popleft() for _ in range(count)]
        live = {g.lease for g in shelf.slots}
        for lease in {g.lease for g in taken} - live:  # used up: the daemon ended it too
            del shelf.until[lease]
        return taken

    def held(self, size: int, priority: int) -> int:
        """Slots of ``size`` and ``priority`` in the pool (lapsed ones included until the next take)."""
        shelf = self._shelves.get((size, priority))
        return len(shelf.slots) if shelf is not None else 0

    def add(self, size: int, priority: int, lease: int, slots: tuple[SlotRef | str | None, ...],
            lease_ms: int, asked_at: float) -> None:
        """Shelve the slots of a grant answer (nil ones got no room); ``asked_at``: the clock
        when the grant was sent, from which its lease runs at the latest."""
        if not lease:
            return
        shelf = self._shelves.setdefault((size, priority), _Shelf())
        shelf.until[lease] = asked_at + LEASE_MARGIN * lease_ms / 1000
        for position, slot in enumerate(slots):
            if slot is not None and not isinstance(slot, str):
                shelf.slots.append(Granted(lease, position, slot))

    def drop(self, leases: set[int]) -> None:
        """Forget every slot of ``leases`` (a copy into some of them failed): they are released."""
        for shelf in self._shelves.values():
            shelf.slots = deque(g for g in shelf.slots if g.lease not in leases)
            for lease in leases & shelf.until.keys():
                del shelf.until[lease]
        self._stale.extend(leases)

    def take_stale(self) -> list[int]:
        """Leases to release (lapsed or dropped), each once."""
        stale, self._stale = self._stale, []
        return stale

    def now(self) -> float:
        return self._clock()

    def _expire(self, shelf: _Shelf) -> None:
        now = self._clock()
        lapsed = {lease for lease, until in shelf.until.items() if until <= now}
        if lapsed:
            shelf.slots = deque(g for g in shelf.slots if g.lease not in lapsed)
            for lease in lapsed:
                del shelf.until[lease]
            self._stale.extend(lapsed)


def pool_limit(grant_bytes: int, segment_bytes: int) -> int:
    """The most bytes a connection's pool holds: ``grant_bytes``, at most 1/HOST_FRACTION of the
    daemon's host segments (``segment_bytes``)."""
    return min(grant_bytes, segment_bytes // HOST_FRACTION)


__all__ = ["HOST_FRACTION", "LEASE_MARGIN", "GrantPool", "Granted", "pool_limit"]
