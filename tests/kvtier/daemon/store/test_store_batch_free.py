"""The batched delete, eviction and event paths (issue 28) against the per-block ones they replace:
the same slots freed, host-journal records, events (kinds, order, fields), counters and accounting.

Each pair runs on two real stores (or allocators, journals, indexes) given the same operations,
one through the batch step and one block by block, and compares everything observable.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.header import decode_header

from kvtier.daemon.store.allocator import SlabAllocator
from kvtier.daemon.store.host_journal import COMMIT, FREE, SlotJournal, _entry, read_journal, replay
from kvtier.daemon.store.index import BlockIndex
from kvtier.daemon.store.shm import unique_name, unlink_segment
from kvtier.daemon.store.stats import EventKind, EventLog, StoreCounters, StoreEvent
from kvtier.daemon.store.types import Slot, Tier
from tests.kvtier.daemon.store.storekit import BLOCK, NS, make_rec, put

KIB, MIB = 1 << 10, 1 << 20


def _events(store) -> list[tuple]:
    return [(e.kind, e.tier, e.ns_id, e.chain_hash, e.parent_hash, e.num_tokens) for e in store.take_events()]


def _journal(store) -> bytes:
    store.host.journal_flush()
    data = read_journal(store.host.journal.name)
    assert data is not None
    return data


def _state(store) -> tuple:
    """What the two stores of a pair must agree on after the same operations."""
    alloc = store.host.allocator
    alloc.check()
    assert store.index.accounting_errors() == []
    g = store.gauges()
    return (g.tiers, g.blocks, g.pending, alloc.stats(), store.counters.copy(),
            sorted(replay(_journal(store)).live.items()))


def test_allocator_free_many_equals_free_one_by_one():
    """Slab slots of several classes and dedicated extents, freed in a random order by
    free_many and by free: the same allocator state, and the same slots handed out after."""
    rng = random.Random(28)
    sizes = [rng.choice([4 * KIB, 60 * KIB, 64 * KIB, 300 * KIB] * 3 + [3 * MIB]) for _ in range(200)]  # ~40 MiB
    one, many = (SlabAllocator(64 * MIB, segment_bytes=16 * MIB, slab_bytes=1 * MIB) for _ in range(2))
    got = [one.allocate(n) for n in sizes]
    assert got == [many.allocate(n) for n in sizes]
    slots = [s for s in got if s is not None]
    assert len(slots) >= 150 and any(s.length == 3 * MIB for s in slots), "slabs and extents"
    rng.shuffle(slots)
    for batch in (slots[:150], slots[150:]):
        for slot in batch:
            one.free(slot)
        many.free_many(batch)
        one.check()
        many.check()
        assert one.stats() == many.stats()
        again = [rng.choice(sizes) for _ in range(40)]
        taken = [one.allocate(n) for n in again]
        assert taken == [many.allocate(n) for n in again]
        for slot in taken:
            one.free(slot)
        many.free_many(taken)


def test_allocator_free_many_refuses_a_slot_it_did_not_hand_out():
    """The slots before the bad one are freed; the bad one's live slot stays handed out."""
    alloc = SlabAllocator(8 * MIB, segment_bytes=8 * MIB, slab_bytes=1 * MIB)
    a, b = alloc.allocate(4 * KIB), alloc.allocate(4 * KIB)
    with pytest.raises(InvalidRequest):
        alloc.free_many([a, Slot(b.segment, b.offset, b.length + 1)])
    alloc.check()
    with pytest.raises(InvalidRequest):
        alloc.free(a)  # freed by the batch already
    alloc.free(b)
    assert alloc.stats().allocated_bytes == 0


def test_journal_free_many_and_commit_many_write_the_same_entries():
    names = [unique_name("kvtier-jtest") for _ in range(2)]
    one, many = SlotJournal(names[0]), SlotJournal(names[1])
    try:
        slots = [Slot(i % 2, (i // 2) * 4096, 4000 + i) for i in range(50)]
        items = [(s, i % 3, bytes([i]) * (10 + i)) for i, s in enumerate(slots)]
        for s, p, h in items:
            one.commit(s, p, h)
        many.commit_many(items)
        one.commit(slots[3], 2, b"again")  # a slot journaled twice: the live bytes follow
        many.commit_many([(slots[3], 2, b"again")])
        freed = slots[::3] + [Slot(9, 0, 1)]  # one never journaled: ignored
        for s in freed:
            one.free(s)
        many.free_many(freed)
        one.flush()
        many.flush()
        data = read_journal(names[0])
        assert data == read_journal(names[1])
        expect = b"".join(_entry(COMMIT, s, p, h) for s, p, h in items) + _entry(COMMIT, slots[3], 2, b"again") \
            + b"".join(_entry(FREE, s, 0, b"") for s in slots[::3])
        assert data.endswith(expect)
        assert one.live == many.live and one._live_bytes == many._live_bytes
        assert replay(data).live == replay(read_journal(names[1])).live
    finally:
        for j, name in zip((one, many), names):
            j.close(remove=True)
            unlink_segment(name + ".tmp")


def test_index_unplace_many_equals_unplace_then_unlink():
    """Host copies of blocks also on disk, leased, pending and plain: unplace_many against
    unplace + unlink of those left in no tier, block by block."""
    indexes = [BlockIndex({Tier.HOST: 100 * BLOCK, Tier.DISK: 100 * BLOCK}, num_classes=2) for _ in range(2)]
    metas = []
    for index in indexes:
        ms = index.add_reserved_many([NS + bytes([i]) * 32 for i in range(12)], BLOCK, Tier.HOST,
                                     [Slot(0, i * BLOCK, BLOCK) for i in range(12)], 0)
        for i, m in enumerate(ms[:10]):
            index.commit_reserved(m, b"h" * 40, None, 16, i, 0.0, checked=True)
        for m in ms[:3]:
            index.place(m, Tier.DISK)
        index.lease(ms[4])
        metas.append(ms)
    one, many = indexes
    pick = [0, 2, 4, 5, 6, 9, 10, 11]  # on disk, leased, plain, pending (10, 11)
    slots = []
    for i in pick:
        slots.append(one.unplace(metas[0][i], Tier.HOST))
        if not metas[0][i].tiers:
            one.unlink(metas[0][i])
    assert many.unplace_many([metas[1][i] for i in pick], Tier.HOST) == slots
    for index, ms in zip(indexes, metas):
        assert index.accounting_errors([m for m in ms if not m.linked and m.leases]) == []
    assert (one.used, one.count, one.pending, len(one)) == (many.used, many.count, many.pending, len(many))
    for a, b in zip(*metas):
        assert (a.linked, a.queued, a.host_slot, a.host_checked, a.on_disk) == \
            (b.linked, b.queued, b.host_slot, b.host_checked, b.on_disk)
    assert [m.key for m in one.victims(Tier.DISK)] == [m.key for m in many.victims(Tier.DISK)]
    assert [m.key for m in one.victims(Tier.HOST)] == [m.key for m in many.victims(Tier.HOST)]


def test_event_log_extend_equals_append_and_drops_the_oldest_the_same():
    events = [StoreEvent(EventKind.STORED, Tier.HOST, NS, bytes([i]) * 32, None, 16) for i in range(30)]
    for bound in (0, 5, 12, 100):
        c1, c2 = StoreCounters(), StoreCounters()
        one, many = EventLog(bound, c1), EventLog(bound, c2)
        for e in events[:7]:
            one.append(e)
        many.extend(events[:7])
        for e in events[7:]:
            one.append(e)
        many.extend(events[7:])
        assert one.take() == many.take() and c1.events_dropped == c2.events_dropped
        assert one.enabled == many.enabled == (bound > 0)


async def _pair(open_store, tmp_path, **overrides):
    a = await open_store(host_bytes=64 * BLOCK, host_segment_bytes=64 * BLOCK, disk_path=str(tmp_path / "a"),
                         **overrides)
    b = await open_store(host_bytes=64 * BLOCK, host_segment_bytes=64 * BLOCK, disk_path=str(tmp_path / "b"),
                         **overrides)
    return a, b


async def test_free_copies_equals_free_copy_one_by_one(open_store, tmp_path):
    """Host copies freed by Mover.free_copies and by free_copy, block by block, on two stores
    given the same puts: the same REMOVED events, journal bytes, allocator, index and counters;
    some of the blocks are on disk too (they stay, linked), the others leave the index."""
    a, b = await _pair(open_store, tmp_path)
    recs = [make_rec(i) for i in range(24)]
    for store in (a, b):
        assert await put(store, recs) == [True] * 24
        metas = [store.index.get(NS + r.chain_hash) for r in recs]
        assert await store.mover.write_disk_verified(metas[::4]) == metas[::4]
        _events(store)
    assert _journal(a) == _journal(b)
    pick = [NS + recs[i].chain_hash for i in (5, 0, 7, 8, 3, 23, 12)]
    a.mover.free_copies([a.index.get(k) for k in pick], Tier.HOST)
    for k in pick:
        b.mover.free_copy(b.index.get(k), Tier.HOST)
    parent = {NS + r.chain_hash: decode_header(r.header)[0].parent_hash for r in recs}
    assert _events(a) == _events(b) == [(EventKind.REMOVED, Tier.HOST, NS, k[16:], parent[k], 16) for k in pick]
    assert _journal(a) == _journal(b)
    assert _state(a) == _state(b)
    assert [k in a.index for k in pick] == [k in b.index for k in pick] == [i % 4 == 0 for i in (5, 0, 7, 8, 3, 23, 12)]


async def test_emit_many_equals_emit_one_by_one(open_store, tmp_path):
    """STORED events of host copies (journaled) and REMOVED events of disk copies through
    emit_many and through emit: the same events and journal bytes."""
    a, b = await _pair(open_store, tmp_path)
    recs = [make_rec(i) for i in range(10)]
    for store in (a, b):
        assert await put(store, recs) == [True] * 10
    assert _events(a) == _events(b)
    assert _journal(a) == _journal(b)
    for kind, tier in ((EventKind.STORED, Tier.HOST), (EventKind.REMOVED, Tier.DISK)):
        a.mover.emit_many(kind, tier, [a.index.get(NS + r.chain_hash) for r in recs])
        for r in recs:
            b.mover.emit(kind, tier, b.index.get(NS + r.chain_hash))
        assert _events(a) == _events(b)
        assert _journal(a) == _journal(b)


async def test_delete_frees_and_announces_each_block_as_before(open_store, tmp_path):
    """A delete of host blocks (some on disk too, one key absent, one only on disk): the
    events are each disk copy's REMOVED, in order, then each host copy's, as the per-block
    loop announced them; the journal gets one FREE per host slot, in order; the allocator,
    index and counters are left as by deleting the keys one at a time."""
    a, b = await _pair(open_store, tmp_path)
    recs = [make_rec(i) for i in range(16)]
    for store in (a, b):
        assert await put(store, recs) == [True] * 16
        metas = [store.index.get(NS + r.chain_hash) for r in recs]
        await store.mover.write_disk_verified(metas[::3])
        store.mover.free_copy(metas[6], Tier.HOST)  # block 6: on disk only
        _events(store)
    keys = [recs[i].chain_hash for i in (9, 6, 0, 1, 2, 3)] + [make_rec(99).chain_hash]
    slots = [a.index.get(NS + recs[i].chain_hash).host_slot for i in (9, 0, 1, 2, 3)]
    before = _journal(a)
    assert await a.delete(NS, keys) == 6
    for k in keys:
        await b.delete(NS, [k])
    disk_first = [(EventKind.REMOVED, Tier.DISK, NS, recs[i].chain_hash) for i in (9, 6, 0, 3)]
    host_then = [(EventKind.REMOVED, Tier.HOST, NS, recs[i].chain_hash) for i in (9, 0, 1, 2, 3)]
    assert [e[:4] for e in _events(a)] == disk_first + host_then
    after = _journal(a)
    assert after == before + b"".join(_entry(FREE, s, 0, b"") for s in slots)
    assert sorted(replay(after).live.items()) == sorted(replay(_journal(b)).live.items())
    assert _state(a) == _state(b)
    assert a.counters.deletes == b.counters.deletes == 6
    assert all(NS + k not in a.index for k in keys)


async def test_eviction_frees_the_oldest_blocks_and_announces_them_first(open_store):
    """A put into a full host tier (no disk) evicts the least recently used blocks: their
    REMOVED events, in eviction order, come before the new blocks' STORED events, and every
    count and charge adds up."""
    store = await open_store(host_bytes=8 * BLOCK, host_segment_bytes=8 * BLOCK, disk_path=None, disk_bytes=0)
    recs = [make_rec(i) for i in range(16)]
    assert await put(store, recs[:8]) == [True] * 8
    _events(store)
    assert await put(store, recs[8:12]) == [True] * 4
    got = _events(store)
    assert [(e[0], e[1], e[3]) for e in got] == \
        [(EventKind.REMOVED, Tier.HOST, r.chain_hash) for r in recs[:4]] + \
        [(EventKind.STORED, Tier.HOST, r.chain_hash) for r in recs[8:12]]
    assert store.counters.tiers[Tier.HOST].evictions == 4
    assert store.index.accounting_errors() == []
    store.host.allocator.check()
    assert [NS + r.chain_hash in store.index for r in recs[:12]] == [False] * 4 + [True] * 8


def test_index_visible_many_equals_visible_of_each():
    """Committed, pending and absent keys, in any order: the committed blocks, in order."""
    index = BlockIndex({Tier.HOST: 100 * BLOCK}, num_classes=2)
    keys = [NS + bytes([i]) * 32 for i in range(8)]
    ms = index.add_reserved_many(keys[:6], BLOCK, Tier.HOST, [Slot(0, i * BLOCK, BLOCK) for i in range(6)], 0)
    for m in ms[::2]:
        index.commit_reserved(m, b"h", None, 16, 0, 0.0, checked=False)
    ask = [keys[i] for i in (7, 4, 1, 0, 6, 2, 4)]
    assert index.visible_many(ask) == [m for m in map(index.visible, ask) if m is not None] == [ms[4], ms[0], ms[2], ms[4]]


def test_index_commit_reserved_many_queues_the_blocks_as_commit_reserved_does():
    """Host blocks (one leased twice, one pinned higher, one moving) committed in one pass and
    one by one: the same LRU queues, in the same order, and sound accounting."""
    indexes = [BlockIndex({Tier.HOST: 100 * BLOCK}, num_classes=2) for _ in range(2)]
    metas = []
    for index in indexes:
        keys = [NS + bytes([i]) * 32 for i in range(8)]
        ms = index.add_reserved_many(keys, BLOCK, Tier.HOST, [Slot(0, i * BLOCK, BLOCK) for i in range(8)], 0)
        ms[5].priority = 1  # a put of priority 1 among them (reserved so by add_reserved)
        index.lease(ms[2])
        index.set_moving(ms[6], True)
        metas.append(ms)
    h = SimpleNamespace(parent_hash=None, num_tokens=16, checksum=7)
    one, many = indexes
    for m in metas[0]:
        one.commit_reserved(m, b"h", None, 16, 7, 1.0, checked=True)
    many.commit_reserved_many(metas[1], [b"h"] * 8, [h] * 8, 1.0, True)
    for index, ms in zip(indexes, metas):
        index.set_moving(ms[6], False)
        assert index.accounting_errors() == []
    assert [m.key for m in one.victims(Tier.HOST)] == [m.key for m in many.victims(Tier.HOST)]
    assert [(m.queued, m.leases, m.host_checked) for m in metas[0]] == \
        [(m.queued, m.leases, m.host_checked) for m in metas[1]]


def test_index_place_many_queues_the_blocks_as_rename_and_commit_reserved_do():
    """Granted host slots (one leased twice, one moving) placed in one pass and renamed and
    committed one by one: the same LRU queues, in the same order, and sound accounting."""
    indexes = [BlockIndex({Tier.HOST: 100 * BLOCK}, num_classes=2) for _ in range(2)]
    grant_ns = bytes([0xFF]) * 16
    metas = []
    for index in indexes:
        ms = index.add_reserved_many([grant_ns + bytes([i]) * 32 for i in range(8)], BLOCK, Tier.HOST,
                                     [Slot(0, i * BLOCK, BLOCK) for i in range(8)], 1)
        index.lease(ms[2])
        index.set_moving(ms[6], True)
        metas.append(ms)
    keys = [NS + bytes([i]) * 32 for i in range(8)]
    h = SimpleNamespace(parent_hash=None, num_tokens=16, checksum=7)
    one, many = indexes
    for m, k in zip(metas[0], keys):
        one.rename(m, k, 3)
        one.commit_reserved(m, b"h", None, 16, 7, 1.0, checked=True)
    many.place_many(metas[1], keys, lambda key: 3, [b"h"] * 8, [h] * 8, 1.0, True)
    for index, ms in zip(indexes, metas):
        index.set_moving(ms[6], False)
        assert index.accounting_errors() == []
    assert [m.key for m in one.victims(Tier.HOST)] == [m.key for m in many.victims(Tier.HOST)] != []
    assert [(m.key, m.queued, m.leases, m.prior_accesses) for m in metas[0]] == \
        [(m.key, m.queued, m.leases, m.prior_accesses) for m in metas[1]]
