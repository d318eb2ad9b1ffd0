"""Eviction order and disk admission. Torch-free, I/O-free.

* :class:`PriorityLru` — one LRU queue per priority class for one tier. Victims come from the
  lowest class first and, inside a class, least recently used first. Insert, touch, remove and
  taking the next victim are O(1) (``OrderedDict`` keeps a linked list under the hood).
* :class:`AdmissionFilter` — frequency filter in front of the disk tier: a block evicted from host
  memory is written down only once it has been accessed ``threshold`` times. Counts of dropped
  blocks are remembered in a bounded "ghost" table so a block that keeps coming back earns its
  place even if it never stays in host memory long enough on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class PriorityLru(Generic[T]):
    """LRU order with priority classes, for one tier; holds hashable items (block metadata).

    Args:
        num_classes: number of priority classes; class 0 is evicted first, the highest last.
    """

    def __init__(self, num_classes: int) -> None:
        assert num_classes >= 1, "at least one priority class"
        # An OrderedDict is a hash map threaded on a doubly linked list: O(1) insert, move to the
        # end, delete and "first item", which is all an LRU needs.
        self._classes: list[OrderedDict[T, None]] = [OrderedDict() for _ in range(num_classes)]

    @property
    def num_classes(self) -> int:
        return len(self._classes)

    @property
    def classes(self) -> list[OrderedDict[T, None]]:
        """The queue of each class, least recent first: for a caller's per-block hot path
        (``BlockIndex.lease_all``), which may insert an item not queued yet (most recent) or
        delete a queued one, and nothing else."""
        return self._classes

    def __len__(self) -> int:
        return sum(len(c) for c in self._classes)

    def contains(self, item: T, priority: int) -> bool:
        """O(1) membership test in one class."""
        return item in self._classes[priority]

    def push(self, item: T, priority: int) -> None:
        """Insert as most recently used of ``priority``, or move there if present."""
        cls = self._classes[priority]
        cls[item] = None
        cls.move_to_end(item)

    def touch(self, item: T, priority: int) -> bool:
        """Mark ``item`` most recently used; False when it is not queued in that class."""
        cls = self._classes[priority]
        if item not in cls:
            return False
        cls.move_to_end(item)
        return True

    def remove(self, item: T, priority: int) -> bool:
        """Take ``item`` out of the queue; False when it was not there."""
        cls = self._classes[priority]
        if item not in cls:
            return False
        del cls[item]
        return True

    def peek(self) -> T | None:
        """The next victim, without removing it; None when the queue is empty."""
        for cls in self._classes:
            if cls:
                return next(iter(cls))
        return None

    def victims(self) -> Iterator[T]:
        """All queued items in eviction order (lowest class, least recent first).

        The caller must not change the queue while iterating; collect first, then act.
        """
        for cls in self._classes:
            yield from cls


class AdmissionFilter(Generic[T]):
    """Admit a block to disk once it has been accessed ``threshold`` times.

    One access is the commit that stored the block; each acquire that served it adds one. So
    ``threshold`` 0 or 1 admits everything, 2 means "stored and read at least once".

    Args:
        threshold: accesses needed for admission.
        ghost_capacity: how many dropped keys keep their access count (oldest forgotten first).
    """

    def __init__(self, threshold: int, ghost_capacity: int = 65536) -> None:
        assert threshold >= 0 and ghost_capacity >= 0, "validated by StoreConfig"
        self.threshold = threshold
        self._ghost_capacity = ghost_capacity
        self._ghosts: OrderedDict[T, int] = OrderedDict()

    def admits(self, accesses: int) -> bool:
        """Whether a block with ``accesses`` accesses may be written to disk."""
        return accesses >= self.threshold

    def forget(self, key: T, accesses: int) -> None:
        """Remember the access count of a block that was dropped instead of demoted."""
        if self._ghost_capacity == 0 or self.threshold <= 1:
            return  # nothing to remember: every block is admitted anyway
        self._ghosts[key] = accesses
        self._ghosts.move_to_end(key)
        while len(self._ghosts) > self._ghost_capacity:
            self._ghosts.popitem(last=False)

    def recall(self, key: T) -> int:
        """Accesses a returning block had before it was dropped (0 if unknown); forgets them."""
        return self._ghosts.pop(key, 0)

    def __len__(self) -> int:
        return len(self._ghosts)
