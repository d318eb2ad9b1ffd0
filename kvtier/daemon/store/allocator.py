"""Slab allocator for variable-sized blocks over fixed-size memory segments. Pure Python: no torch, no I/O.

The host tier (shared-memory segments) and the GPU tier (device pools) hand out byte ranges of
their segments through this allocator; it only does the bookkeeping.

Layout of one segment::

    0                                                                         segment size
    |-- slab (class 2 MiB+8 KiB) --|-- free extent --|-- dedicated extent (96 MiB) --|-- free --|
    | slot 0 | slot 1 | ... | n-1 |

* A request is rounded up to a **size class**: a multiple of ``alignment`` and of a granule that
  grows with the size (``2**floor(log2(n)) / classes_per_doubling``), so internal waste stays
  below ``1/classes_per_doubling`` of the block while the number of distinct classes stays bounded.
* A **slab** is an extent carved from a segment's free space and cut into equal slots of one
  class. It holds a whole number of slots (no tail waste). A class's first slab is small and each
  new one doubles the class's footprint up to ``slab_bytes``, so rarely used classes hoard little.
* A slab whose last slot is freed goes back to the segment's free extents, coalesced with its
  neighbours, so memory moves between classes as the mix of block sizes changes.
* A block larger than ``slab_bytes`` gets a **dedicated extent** of its own.

The common case (every block of a namespace has the same size) is O(1): pop a free slot from a
partly used slab of the class. Carving or returning a slab scans the segments' free extents.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier_protocol.errors import CapacityError, InvalidRequest

from kvtier.daemon.store.types import Slot

MIB = 1 << 20
_MIN_SLAB_BYTES = 1 * MIB  # a class's first slab: small, so a size used once wastes little
_new_slot = tuple.__new__  # Slot(...), _Live(...) without their generated __new__: the slab path runs per block


@dataclass(frozen=True, slots=True)
class AllocatorStats:
    """A snapshot of an allocator's occupancy."""

    capacity: int  # bytes of all segments
    allocated_bytes: int  # bytes of the slots handed out, rounded up to their size class
    requested_bytes: int  # bytes the callers asked for
    reserved_bytes: int  # bytes carved out of segments (slabs + dedicated extents)
    free_bytes: int  # capacity - allocated_bytes (includes free slots inside slabs)
    largest_free_extent: int  # the largest block of uncarved segment space
    num_slots: int  # slots handed out
    internal_fragmentation: float  # 1 - requested / reserved: rounding and free slots in slabs
    external_fragmentation: float  # 1 - largest free extent / all free extent bytes


@dataclass(eq=False, slots=True)
class _Slab:
    segment: int
    offset: int
    slot_bytes: int
    num_slots: int
    free: list[int]  # free slot indices; a stack, lowest index on top when fresh

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots


class _Live(NamedTuple):
    """What one handed-out slot took. A named tuple (read-only), built with ``tuple.__new__`` on
    the slab path: one is made per block reserved, where a dataclass's ``__init__`` costs a call."""

    slab: _Slab | None  # None: a dedicated extent
    reserved: int  # bytes this slot takes (class size, or the extent length)
    requested: int


@dataclass(slots=True)
class _FreeExtents:
    """The uncarved space of one segment: disjoint, coalesced (offset, length) extents."""

    starts: list[int] = field(default_factory=list)  # sorted
    length_at: dict[int, int] = field(default_factory=dict)  # start -> length
    start_of_end: dict[int, int] = field(default_factory=dict)  # end -> start

    def add(self, offset: int, length: int) -> None:
        """Return an extent, merging it with the free extents that touch it."""
        before = self.start_of_end.pop(offset, None)
        if before is not None:
            length += offset - before
            offset = before
            del self.length_at[offset]
            self.starts.pop(bisect_left(self.starts, offset))
        after_len = self.length_at.pop(offset + length, None)
        if after_len is not None:
            del self.start_of_end[offset + length + after_len]
            self.starts.pop(bisect_left(self.starts, offset + length))
            length += after_len
        insort(self.starts, offset)
        self.length_at[offset] = length
        self.start_of_end[offset + length] = offset

    def take_range(self, offset: int, length: int) -> bool:
        """Carve ``[offset, offset + length)`` out of the free extent holding it, wherever it lies
        in it; False (nothing changed) when no free extent holds all of it."""
        i = bisect_right(self.starts, offset) - 1
        if i < 0:
            return False
        start = self.starts[i]
        have = self.length_at[start]
        if start + have < offset + length:
            return False
        self.take(start, have)
        if offset > start:
            self.add(start, offset - start)
        if start + have > offset + length:
            self.add(offset + length, start + have - offset - length)
        return True

    def take(self, offset: int, length: int) -> None:
        """Carve ``length`` bytes from the start of the free extent at ``offset``."""
        have = self.length_at.pop(offset)
        assert have >= length, "carving more than the extent holds"
        del self.start_of_end[offset + have]
        self.starts.pop(bisect_left(self.starts, offset))
        if have > length:
            rest = offset + length
            insort(self.starts, rest)
            self.length_at[rest] = have - length
            self.start_of_end[offset + have] = rest


class SlabAllocator:
    """Hands out byte ranges (:class:`Slot`) of a set of equal-sized segments.

    Args:
        capacity: total bytes; rounded down to ``alignment`` and split into segments of
            ``segment_bytes`` (the last one takes the remainder).
        segment_bytes: size of one segment; a block never spans two, so this bounds a block.
        alignment: every slot starts at a multiple of it (4096: page-aligned for DMA and pinning).
        slab_bytes: largest slab; blocks of a class larger than this get a dedicated extent.
        classes_per_doubling: size-class granularity (a power of two); internal waste per block
            is below ``1 / classes_per_doubling`` of its size (or ``alignment`` for small blocks).

    Raises:
        CapacityError: the capacity rounds down to zero bytes.
        ValueError: an argument is out of range.
    """

    def __init__(self, capacity: int, *, segment_bytes: int, alignment: int = 4096,
                 slab_bytes: int = 64 * MIB, classes_per_doubling: int = 256) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if classes_per_doubling <= 0 or classes_per_doubling & (classes_per_doubling - 1):
            raise ValueError(f"classes_per_doubling must be a power of two, got {classes_per_doubling}")
        capacity -= capacity % alignment
        if capacity <= 0:
            raise CapacityError(f"capacity rounds down to zero bytes (alignment {alignment})")
        segment_bytes = min(segment_bytes - segment_bytes % alignment, capacity)
        if segment_bytes <= 0:
            raise ValueError(f"segment_bytes must be at least the alignment ({alignment})")
        self.alignment = alignment
        self.slab_bytes = max(alignment, min(slab_bytes - slab_bytes % alignment, segment_bytes))
        self._class_shift = classes_per_doubling.bit_length() - 1
        full, rest = divmod(capacity, segment_bytes)
        self.segment_sizes: tuple[int, ...] = (segment_bytes,) * full + ((rest,) if rest else ())
        self._max_segment = segment_bytes
        self._free = [_FreeExtents() for _ in self.segment_sizes]
        for seg, size in enumerate(self.segment_sizes):
            self._free[seg].add(0, size)
        self._slabs: dict[tuple[int, int], _Slab] = {}  # (segment, offset) -> slab
        self._partial: dict[int, dict[_Slab, None]] = {}  # class bytes -> slabs with a free slot
        self._class_bytes: dict[int, int] = {}  # class bytes -> bytes of its slabs
        self._live: dict[tuple[int, int], _Live] = {}  # (segment, offset) -> what was handed out
        self._allocated = 0
        self._requested = 0
        self._reserved = 0
        self._last_request: int | None = None  # memo of size_class() for the last request size
        self._last_class = 0

    # --- sizes ---------------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return sum(self.segment_sizes)

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    @property
    def requested_bytes(self) -> int:
        return self._requested

    @property
    def free_bytes(self) -> int:
        return self.capacity - self._allocated

    @property
    def fragmentation(self) -> float:
        """Internal fragmentation: 1 - requested / reserved bytes (0 when nothing is reserved)."""
        return 1.0 - self._requested / self._reserved if self._reserved else 0.0

    def size_class(self, nbytes: int) -> int:
        """Bytes a request of ``nbytes`` reserves."""
        a = self.alignment
        rounded = -(-nbytes // a) * a
        granule = max(a, (1 << (rounded.bit_length() - 1)) >> self._class_shift)
        cb = -(-rounded // granule) * granule
        return cb if cb <= self.slab_bytes else rounded  # a dedicated extent needs no class

    def can_ever_fit(self, nbytes: int) -> bool:
        """Whether a block of ``nbytes`` fits in an empty allocator."""
        return 0 < nbytes and self.size_class(nbytes) <= self._max_segment

    # --- allocate / free -----------------------------------------------------------------------

    def allocate(self, nbytes: int) -> Slot | None:
        """Reserve ``nbytes``; None when there is no room now (never raises for "full").

        Raises:
            CapacityError: ``nbytes`` is not positive or can never fit in a segment.
        """
        if nbytes == self._last_request:  # the common case: a namespace's blocks share one size
            cb = self._last_class
        else:
            if not self.can_ever_fit(nbytes):
                raise CapacityError(f"a block of {nbytes} bytes can never fit (segments of {self._max_segment} bytes)")
            cb = self.size_class(nbytes)
            self._last_request, self._last_class = nbytes, cb
        if cb > self.slab_bytes:
            return self._allocate_extent(nbytes, cb)
        partial = self._partial.get(cb)
        slab = next(iter(partial)) if partial else self._new_slab(cb)
        if slab is None:
            return None
        index = slab.free.pop()
        if not slab.free:
            del self._partial[cb][slab]
        offset = slab.offset + index * cb
        self._live[(slab.segment, offset)] = _new_slot(_Live, (slab, cb, nbytes))
        self._allocated += cb
        self._requested += nbytes
        return _new_slot(Slot, (slab.segment, offset, nbytes))

    def allocate_run(self, nbytes: int, count: int) -> list[Slot]:
        """Up to ``count`` slots of ``nbytes``, as :meth:`allocate` would hand them out one by one,
        stopping at the first that finds no room (so possibly fewer, possibly none).

        A grant's batch of same-sized slots: the slab's free slots are popped in one loop, and
        the slots of one slab share one (read-only) record of what they took.

        Raises:
            CapacityError: as :meth:`allocate`.
        """
        out: list[Slot] = []
        if count <= 0:
            return out
        first = self.allocate(nbytes)  # the size-class memo, the checks, the first slab
        if first is None:
            return out
        out.append(first)
        cb = self._last_class
        if cb > self.slab_bytes:  # dedicated extents: each one a best fit of its own
            while len(out) < count:
                slot = self._allocate_extent(nbytes, cb)
                if slot is None:
                    break
                out.append(slot)
            return out
        live, partial_of, new_slot, append = self._live, self._partial, _new_slot, out.append
        while len(out) < count:
            partial = partial_of.get(cb)
            slab = next(iter(partial)) if partial else self._new_slab(cb)
            if slab is None:
                break
            free, seg, base = slab.free, slab.segment, slab.offset
            took = new_slot(_Live, (slab, cb, nbytes))
            n = min(len(free), count - len(out))
            for _ in range(n):
                offset = base + free.pop() * cb
                live[(seg, offset)] = took
                append(new_slot(Slot, (seg, offset, nbytes)))
            if not free:
                del partial_of[cb][slab]
            self._allocated += n * cb
            self._requested += n * nbytes
        return out

    def free(self, slot: Slot) -> None:
        """Give a slot back.

        Raises:
            InvalidRequest: the slot was not handed out by this allocator (or was freed already).
        """
        at = (slot.segment, slot.offset)
        live = self._live.pop(at, None)  # one probe: put back below if the slot does not match
        if live is None or live.requested != slot.length:
            if live is not None:
                self._live[at] = live
            raise InvalidRequest(f"{slot} is not an allocated slot")
        self._allocated -= live.reserved
        self._requested -= live.requested
        slab = live.slab
        if slab is None:
            self._reserved -= live.reserved
            self._free[slot.segment].add(slot.offset, live.reserved)
            return
        if not slab.free:
            self._partial.setdefault(slab.slot_bytes, {})[slab] = None
        slab.free.append((slot.offset - slab.offset) // slab.slot_bytes)
        if len(slab.free) == slab.num_slots:
            self._drop_slab(slab)

    def free_many(self, slots: Sequence[Slot]) -> None:
        """:meth:`free` each of ``slots``, in order: a delete's or an eviction's batch, with the
        byte totals updated once for it. A slot of a slab goes back as :meth:`free` puts it back.

        Raises:
            InvalidRequest: as :meth:`free`; the slots before the bad one are freed.
        """
        live, partial_of = self._live, self._partial
        allocated = requested = 0
        try:
            for slot in slots:
                seg, offset = at = (slot[0], slot[1])
                got = live.pop(at, None)
                if got is None or got.requested != slot[2]:
                    if got is not None:
                        live[at] = got
                    raise InvalidRequest(f"{slot} is not an allocated slot")
                reserved = got.reserved
                allocated += reserved
                requested += got.requested
                slab = got.slab
                if slab is None:
                    self._reserved -= reserved
                    self._free[seg].add(offset, reserved)
                    continue
                free = slab.free
                if not free:
                    partial = partial_of.get(slab.slot_bytes)
                    if partial is None:
                        partial = partial_of[slab.slot_bytes] = {}
                    partial[slab] = None
                free.append((offset - slab.offset) // slab.slot_bytes)
                if len(free) == slab.num_slots:
                    self._drop_slab(slab)
        finally:
            self._allocated -= allocated
            self._requested -= requested

    def adopt(self, slots: Sequence[Slot]) -> list[bool]:
        """Mark ``slots`` handed out, where a previous allocator over the same segments put them
        (a host tier adopted after a crash: :mod:`kvtier.daemon.store.host`). Only before the
        first allocation. Each slot gets its size class, as :meth:`allocate` would have given it;
        runs of adjacent slots of one class become one (full) slab, a larger slot its dedicated
        extent. Per slot, whether it was taken: not when it lies outside the segments, is
        misaligned, or overlaps a slot taken before it (in offset order).
        """
        assert not self._live and not self._slabs, "adopt() fills an allocator that handed nothing out"
        ok = [False] * len(slots)
        run: list[int] = []  # indices of the adjacent same-class slots of the slab being formed

        def close_run() -> None:
            if not run:
                return
            first = slots[run[0]]
            cb = self.size_class(first.length)
            slab = _Slab(first.segment, first.offset, cb, len(run), [])
            self._slabs[(first.segment, first.offset)] = slab
            self._class_bytes[cb] = self._class_bytes.get(cb, 0) + slab.nbytes
            self._reserved += slab.nbytes
            for i in run:
                s = slots[i]
                self._live[(s.segment, s.offset)] = _Live(slab, cb, s.length)
                self._allocated += cb
                self._requested += s.length
                ok[i] = True
            run.clear()

        for i in sorted(range(len(slots)), key=lambda j: (slots[j].segment, slots[j].offset)):
            s = slots[i]
            if not (0 <= s.segment < len(self.segment_sizes) and s.offset % self.alignment == 0
                    and s.length > 0 and self.can_ever_fit(s.length)):
                continue
            cb = self.size_class(s.length)
            if not self._free[s.segment].take_range(s.offset, cb):
                continue  # overlaps a slot taken already, or runs past the segment's end
            if cb > self.slab_bytes:
                close_run()
                self._reserved += cb
                self._live[(s.segment, s.offset)] = _Live(None, cb, s.length)
                self._allocated += cb
                self._requested += s.length
                ok[i] = True
                continue
            if run:
                last = slots[run[-1]]
                if not (last.segment == s.segment and self.size_class(last.length) == cb
                        and last.offset + cb == s.offset):
                    close_run()
            run.append(i)
        close_run()
        return ok

    def _allocate_extent(self, nbytes: int, cb: int) -> Slot | None:
        found = self._best_fit(cb)
        if found is None:
            return None
        seg, offset, _ = found
        self._free[seg].take(offset, cb)
        self._reserved += cb
        self._live[(seg, offset)] = _Live(None, cb, nbytes)
        self._allocated += cb
        self._requested += nbytes
        return Slot(seg, offset, nbytes)

    def _new_slab(self, cb: int) -> _Slab | None:
        # Double the class's footprint each time, between 1 MiB and slab_bytes.
        target = min(self.slab_bytes, max(_MIN_SLAB_BYTES, self._class_bytes.get(cb, 0)))
        want = max(1, target // cb) * cb
        found = self._best_fit(want) or self._best_fit(cb, largest=True)
        if found is None:
            return None
        seg, offset, have = found
        num_slots = min(want, have) // cb
        slab = _Slab(seg, offset, cb, num_slots, list(range(num_slots - 1, -1, -1)))
        self._free[seg].take(offset, slab.nbytes)
        self._slabs[(seg, offset)] = slab
        self._partial.setdefault(cb, {})[slab] = None
        self._class_bytes[cb] = self._class_bytes.get(cb, 0) + slab.nbytes
        self._reserved += slab.nbytes
        return slab

    def _drop_slab(self, slab: _Slab) -> None:
        cb = slab.slot_bytes
        del self._partial[cb][slab]
        if not self._partial[cb]:
            del self._partial[cb]
        del self._slabs[(slab.segment, slab.offset)]
        self._class_bytes[cb] -= slab.nbytes
        if not self._class_bytes[cb]:
            del self._class_bytes[cb]
        self._reserved -= slab.nbytes
        self._free[slab.segment].add(slab.offset, slab.nbytes)

    def _best_fit(self, nbytes: int, *, largest: bool = False) -> tuple[int, int, int] | None:
        """The smallest free extent holding ``nbytes`` (or the largest one, if ``largest``)."""
        best: tuple[int, int, int] | None = None
        for seg, extents in enumerate(self._free):
            for offset, length in extents.length_at.items():
                if length < nbytes:
                    continue
                if best is None or (length > best[2] if largest else length < best[2]):
                    best = (seg, offset, length)
        return best

    # --- inspection ----------------------------------------------------------------------------

    def stats(self) -> AllocatorStats:
        """Occupancy and fragmentation figures."""
        extent_free = sum(sum(e.length_at.values()) for e in self._free)
        largest = max((max(e.length_at.values(), default=0) for e in self._free), default=0)
        return AllocatorStats(
            capacity=self.capacity,
            allocated_bytes=self._allocated,
            requested_bytes=self._requested,
            reserved_bytes=self._reserved,
            free_bytes=self.free_bytes,
            largest_free_extent=largest,
            num_slots=len(self._live),
            internal_fragmentation=self.fragmentation,
            external_fragmentation=1.0 - largest / extent_free if extent_free else 0.0,
        )

    def check(self) -> None:
        """Assert every internal invariant (for tests and the store's audit); O(size of state)."""
        for seg, size in enumerate(self.segment_sizes):
            spans = [(o, n, "free") for o, n in self._free[seg].length_at.items()]
            spans += [(s.offset, s.nbytes, "slab") for (sg, _), s in self._slabs.items() if sg == seg]
            spans += [(o, v.reserved, "extent") for (sg, o), v in self._live.items() if sg == seg and v.slab is None]
            spans.sort()
            pos, prev = 0, ""
            for offset, length, kind in spans:
                assert offset == pos, f"segment {seg}: gap or overlap at {pos} (next span at {offset})"
                assert length > 0 and offset % self.alignment == 0, f"segment {seg}: bad span {offset}+{length}"
                assert not (kind == prev == "free"), f"segment {seg}: uncoalesced free extents at {offset}"
                pos, prev = offset + length, kind
            assert pos == size, f"segment {seg}: spans end at {pos}, segment is {size}"
            fe = self._free[seg]
            assert fe.starts == sorted(fe.length_at), f"segment {seg}: free extent index out of order"
            assert fe.start_of_end == {o + n: o for o, n in fe.length_at.items()}, f"segment {seg}: end index"
        used: dict[_Slab, int] = {}
        allocated = requested = 0
        for (seg, offset), live in self._live.items():
            allocated += live.reserved
            requested += live.requested
            assert live.requested <= live.reserved, "a slot is shorter than its request"
            if live.slab is not None:
                slab = live.slab
                assert self._slabs.get((slab.segment, slab.offset)) is slab, "slot of an unknown slab"
                index, rem = divmod(offset - slab.offset, slab.slot_bytes)
                assert seg == slab.segment and rem == 0 and 0 <= index < slab.num_slots, "slot outside its slab"
                assert index not in slab.free, "a handed-out slot is on its slab's free list"
                used[slab] = used.get(slab, 0) + 1
        assert allocated == self._allocated and requested == self._requested, "byte counters drifted"
        reserved = sum(v.reserved for v in self._live.values() if v.slab is None)
        for slab in self._slabs.values():
            reserved += slab.nbytes
            assert len(set(slab.free)) == len(slab.free), "duplicate free slot"
            assert all(0 <= i < slab.num_slots for i in slab.free), "free slot index out of range"
            assert len(slab.free) + used.get(slab, 0) == slab.num_slots, "slab slots do not add up"
            assert used.get(slab, 0) > 0, "an empty slab was kept"
            assert (slab in self._partial.get(slab.slot_bytes, {})) == bool(slab.free), "partial list is stale"
        assert reserved == self._reserved, "reserved counter drifted"
        assert 0.0 <= self.fragmentation <= 1.0 and 0.0 <= self.stats().external_fragmentation <= 1.0
        assert self._allocated <= self.capacity
