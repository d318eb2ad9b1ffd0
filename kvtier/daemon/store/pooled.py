"""What every memory tier carved by a :class:`SlabAllocator` shares: the host and GPU tiers."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.daemon.store.allocator import AllocatorStats, SlabAllocator
from kvtier.daemon.store.types import Slot


class SlabBackedTier:
    """Slot allocation and accounting, delegated to the tier's allocator (``self._alloc``).

    A subclass creates ``self._alloc`` and adds how slots are reached (views, tensors).
    """

    _alloc: SlabAllocator

    def allocate(self, nbytes: int) -> Slot | None:
        """A slot of ``nbytes``, or None when the tier has no room now.

        Raises:
            CapacityError: the block can never fit in a segment.
        """
        return self._alloc.allocate(nbytes)

    def allocate_run(self, nbytes: int, count: int) -> list[Slot]:
        """Up to ``count`` slots of ``nbytes``, stopping at the first that finds no room (see
        :meth:`SlabAllocator.allocate_run`).

        Raises:
            CapacityError: the block can never fit in a segment.
        """
        return self._alloc.allocate_run(nbytes, count)

    def free(self, slot: Slot) -> None:
        """Return a slot. Raises InvalidRequest for a slot that is not allocated."""
        self._alloc.free(slot)

    def free_many(self, slots: Sequence[Slot]) -> None:
        """:meth:`free` each of ``slots``, in order, in one pass (:meth:`SlabAllocator.free_many`)."""
        self._alloc.free_many(slots)

    @property
    def capacity(self) -> int:
        return self._alloc.capacity

    @property
    def allocated_bytes(self) -> int:
        return self._alloc.allocated_bytes

    @property
    def free_bytes(self) -> int:
        return self._alloc.free_bytes

    @property
    def stats(self) -> AllocatorStats:
        return self._alloc.stats()

    def can_ever_fit(self, nbytes: int) -> bool:
        return self._alloc.can_ever_fit(nbytes)

    @property
    def allocator(self) -> SlabAllocator:
        """The allocator (for audits: ``allocator.check()``)."""
        return self._alloc
