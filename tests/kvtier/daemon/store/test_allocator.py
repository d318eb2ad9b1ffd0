"""SlabAllocator: invariants under random operation sequences, against a reference model of live ranges."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvtier_protocol.errors import CapacityError, InvalidRequest

from kvtier.daemon.store.allocator import SlabAllocator
from kvtier.daemon.store.types import Slot

KIB, MIB = 1 << 10, 1 << 20


class Model:
    """What the allocator handed out, checked independently of its internals."""

    def __init__(self, alloc: SlabAllocator) -> None:
        self.alloc = alloc
        self.live: dict[tuple[int, int], Slot] = {}

    def allocate(self, nbytes: int) -> Slot | None:
        before = self.alloc.stats()
        slot = self.alloc.allocate(nbytes)
        if slot is None:
            # "Full" only when no uncarved extent could hold the block (a partly used slab of its
            # class would have served it).
            assert before.largest_free_extent < self.alloc.size_class(nbytes)
            return None
        assert slot.length == nbytes
        assert slot.offset % self.alloc.alignment == 0
        assert 0 <= slot.offset and slot.offset + nbytes <= self.alloc.segment_sizes[slot.segment]
        assert (slot.segment, slot.offset) not in self.live
        self.live[(slot.segment, slot.offset)] = slot
        return slot

    def free(self, slot: Slot) -> None:
        self.alloc.free(slot)
        del self.live[(slot.segment, slot.offset)]

    def verify(self) -> None:
        self.alloc.check()
        by_segment: dict[int, list[Slot]] = {}
        for slot in self.live.values():
            by_segment.setdefault(slot.segment, []).append(slot)
        for slots in by_segment.values():
            slots.sort(key=lambda s: s.offset)
            for a, b in zip(slots, slots[1:]):
                assert a.offset + a.length <= b.offset, f"{a} overlaps {b}"
        st_ = self.alloc.stats()
        assert st_.requested_bytes == sum(s.length for s in self.live.values())
        assert st_.requested_bytes <= st_.allocated_bytes <= st_.reserved_bytes <= st_.capacity
        assert 0.0 <= st_.internal_fragmentation <= 1.0
        assert 0.0 <= st_.external_fragmentation <= 1.0
        assert st_.num_slots == len(self.live)


def _empty_again(alloc: SlabAllocator) -> None:
    st_ = alloc.stats()
    assert (st_.allocated_bytes, st_.requested_bytes, st_.reserved_bytes, st_.num_slots) == (0, 0, 0, 0)
    assert st_.largest_free_extent == max(alloc.segment_sizes)
    assert st_.external_fragmentation == 0.0 or len(alloc.segment_sizes) > 1


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_invariants(seed: int) -> None:
    rng = random.Random(seed)
    alloc = SlabAllocator(48 * MIB + 12 * KIB, segment_bytes=16 * MIB, slab_bytes=4 * MIB)
    model = Model(alloc)
    # A few sizes dominate (namespaces), plus odd sizes and blocks larger than a slab.
    common = [rng.randrange(1, 3 * MIB) for _ in range(3)]
    for step in range(1500):
        if model.live and rng.random() < 0.45:
            model.free(model.live[rng.choice(list(model.live))])
        else:
            r = rng.random()
            size = rng.choice(common) if r < 0.7 else rng.randrange(1, 6 * MIB) if r < 0.95 else rng.randrange(1, 16 * MIB)
            model.allocate(size)
        if step % 50 == 0:
            model.verify()
    model.verify()
    for slot in list(model.live.values()):
        model.free(slot)
    model.verify()
    _empty_again(alloc)


class AllocatorMachine(RuleBasedStateMachine):
    slots = Bundle("slots")

    def __init__(self) -> None:
        super().__init__()
        self.model = Model(SlabAllocator(8 * MIB, segment_bytes=3 * MIB, slab_bytes=1 * MIB))

    @rule(target=slots, nbytes=st.one_of(st.sampled_from([4096, 100_000, 300_000]), st.integers(1, 3 * MIB)))
    def allocate(self, nbytes: int) -> Slot | None:
        return self.model.allocate(nbytes)

    @rule(slot=consumes(slots))
    def free(self, slot: Slot | None) -> None:
        if slot is not None:
            self.model.free(slot)

    @invariant()
    def consistent(self) -> None:
        self.model.verify()

    def teardown(self) -> None:
        for slot in list(self.model.live.values()):
            self.model.free(slot)
        self.model.verify()
        _empty_again(self.model.alloc)


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)


def test_same_size_blocks_fill_the_pool_with_little_waste() -> None:
    alloc = SlabAllocator(256 * MIB, segment_bytes=64 * MIB)
    size = 2 * MIB + 352  # a 2 MiB payload plus a header
    slots = []
    while (slot := alloc.allocate(size)) is not None:
        slots.append(slot)
    alloc.check()
    st_ = alloc.stats()
    # Every segment is filled up to its last whole slot: a block never spans two segments.
    assert len(slots) == 4 * (64 * MIB // alloc.size_class(size))
    assert alloc.size_class(size) - size < 8 * KIB
    assert st_.internal_fragmentation < 0.01
    for slot in slots:
        alloc.free(slot)
    alloc.check()
    _empty_again(alloc)


def test_empty_slabs_return_to_the_segment_for_other_sizes() -> None:
    alloc = SlabAllocator(16 * MIB, segment_bytes=16 * MIB, slab_bytes=4 * MIB)
    small = [alloc.allocate(64 * KIB) for _ in range(200)]
    assert all(s is not None for s in small)
    for s in small:
        alloc.free(s)
    big = alloc.allocate(16 * MIB)  # needs the whole segment: every slab must have gone back
    assert big is not None and big.offset == 0
    assert alloc.allocate(4096) is None
    alloc.free(big)
    alloc.check()


def test_full_returns_none_and_never_exceeds_capacity() -> None:
    alloc = SlabAllocator(8 * MIB, segment_bytes=4 * MIB)
    got = [alloc.allocate(MIB) for _ in range(8)]
    assert all(got)
    assert alloc.allocate(MIB) is None
    assert alloc.allocated_bytes == alloc.capacity == 8 * MIB
    assert alloc.free_bytes == 0


def test_capacity_errors_and_bad_frees() -> None:
    alloc = SlabAllocator(10 * MIB, segment_bytes=4 * MIB)
    assert alloc.segment_sizes == (4 * MIB, 4 * MIB, 2 * MIB)
    assert alloc.can_ever_fit(4 * MIB) and not alloc.can_ever_fit(4 * MIB + 1) and not alloc.can_ever_fit(0)
    for bad in (0, -1, 4 * MIB + 1):
        with pytest.raises(CapacityError):
            alloc.allocate(bad)
    slot = alloc.allocate(1000)
    assert slot is not None
    with pytest.raises(InvalidRequest):
        alloc.free(Slot(slot.segment, slot.offset, 999))  # not what was handed out
    alloc.free(slot)
    with pytest.raises(InvalidRequest):
        alloc.free(slot)  # double free
    with pytest.raises(CapacityError):
        SlabAllocator(100, segment_bytes=4096)
    with pytest.raises(ValueError):
        SlabAllocator(MIB, segment_bytes=MIB, alignment=3000)


def test_size_classes_bound_internal_waste() -> None:
    alloc = SlabAllocator(64 * MIB, segment_bytes=64 * MIB, slab_bytes=16 * MIB)
    for n in (1, 4095, 4097, 100_000, 2 * MIB, 2 * MIB + 1, 5 * MIB + 7, 16 * MIB, 16 * MIB + 1, 40 * MIB):
        cb = alloc.size_class(n)
        assert cb >= n and cb % alloc.alignment == 0
        assert cb - n < max(alloc.alignment, n / 256 + alloc.alignment)
    assert alloc.size_class(2 * MIB) == 2 * MIB


@pytest.mark.parametrize("nbytes", [64 * KIB, 2 * MIB + 352, 6 * MIB])
def test_allocate_run_hands_out_what_allocate_would_one_by_one(nbytes: int) -> None:
    """The batch path (a grant's slots of one size) equals allocate called in a loop: the same
    slots in the same order, the same accounting, the same stop when the pool is full; and what
    it handed out frees like any slot (6 MiB > slab_bytes: dedicated extents)."""
    def fresh() -> SlabAllocator:
        return SlabAllocator(24 * MIB, segment_bytes=12 * MIB, slab_bytes=4 * MIB)

    one, run = fresh(), fresh()
    keep = one.allocate(4096), run.allocate(4096)  # another class already there
    assert keep[0] == keep[1]
    want = 10_000  # more than fit
    singles = []
    while len(singles) < want and (slot := one.allocate(nbytes)) is not None:
        singles.append(slot)
    batch = run.allocate_run(nbytes, want)
    assert batch == singles and len(batch) < want
    assert run.stats() == one.stats()
    assert run.allocate_run(nbytes, 5) == [] and run.allocate_run(nbytes, 0) == []
    run.check()
    for slot in batch[::2]:
        run.free(slot)
    again = run.allocate_run(nbytes, 3)  # the pool was full: the room freed just now is reused
    assert len(again) == min(3, len(batch[::2])) and all(s.length == nbytes for s in again)
    run.check()
    for slot in again + run.allocate_run(nbytes, 10_000):
        run.free(slot)
    for slot in batch[1::2]:
        run.free(slot)
    run.check()


def test_allocate_run_refuses_what_allocate_refuses() -> None:
    alloc = SlabAllocator(8 * MIB, segment_bytes=4 * MIB)
    with pytest.raises(CapacityError):
        alloc.allocate_run(5 * MIB, 2)
    with pytest.raises(CapacityError):
        alloc.allocate_run(0, 2)
    assert alloc.allocated_bytes == 0
