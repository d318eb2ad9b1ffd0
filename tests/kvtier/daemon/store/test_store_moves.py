"""TieredStore moves: eviction order, priorities, admission, demotion/promotion, integrity, audit."""

from __future__ import annotations

import pytest

from kvtier_protocol.errors import InvalidRequest

from kvtier.daemon.store.stats import EventKind
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put


def hashes(recs):
    return [r.chain_hash for r in recs]


# --- eviction order, priorities, admission ----------------------------------------------------


async def test_host_eviction_takes_the_least_recently_used_block(open_store):
    store = await open_store(disk_path=None, host_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(5)]
    for r in recs[:4]:
        await put(store, [r])
    assert store.touch(NS, hashes(recs[:1])) == 1  # 0 is now the most recent: 1 goes first
    await put(store, [recs[4]])
    present = [store.lookup(NS, [r.chain_hash]).num_hits for r in recs]
    assert present == [1, 0, 1, 1, 1]
    assert store.counters.tiers[Tier.HOST].evictions == 1


async def test_pinned_blocks_outlive_unpinned_ones(open_store):
    store = await open_store(disk_path=None, host_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(8)]
    await put(store, recs[:2])
    assert store.pin(NS, hashes(recs[:1]), priority=2) == 1
    for r in recs[2:8]:
        await put(store, [r])
    assert store.lookup(NS, hashes(recs[:1])).num_hits == 1  # the pinned, oldest block survives
    assert store.lookup(NS, hashes(recs[1:2])).num_hits == 0
    store.unpin(NS, hashes(recs[:1]))  # back in class 0, as its most recent block
    await put(store, [make_rec(20)])
    assert store.lookup(NS, hashes(recs[:1])).num_hits == 1
    await put(store, [make_rec(i) for i in range(21, 24)])
    assert store.lookup(NS, hashes(recs[:1])).num_hits == 0
    with pytest.raises(InvalidRequest):
        store.pin(NS, hashes(recs[:1]), priority=store.config.priority_classes)


async def test_admission_filter_demotes_only_blocks_read_often_enough(open_store):
    store = await open_store(host_bytes=2 * BLOCK, disk_admit_hits=2)
    a, b, c, d = (make_rec(i) for i in range(4))
    await put(store, [a])
    await put(store, [b])
    assert len(await get(store, NS, hashes([a]))) == 1  # a: commit + 1 hit = 2 accesses
    store.touch(NS, hashes([a]))
    await put(store, [c])  # evicts b (1 access): dropped
    await put(store, [d])  # evicts a: admitted, demoted
    assert store.lookup(NS, hashes([a])).tiers == [Tier.DISK]
    assert store.lookup(NS, hashes([b])).num_hits == 0
    assert store.counters.admission_rejects == 1 and store.counters.demotions == 1


async def test_admission_remembers_blocks_that_were_dropped(open_store):
    store = await open_store(host_bytes=BLOCK, disk_admit_hits=3)
    a, b = make_rec(0), make_rec(1)
    await put(store, [a])
    await get(store, NS, hashes([a]))  # 2 accesses
    await put(store, [b])  # a is dropped, its 2 accesses remembered
    assert store.lookup(NS, hashes([a])).num_hits == 0 and store.counters.admission_rejects == 1
    await put(store, [a])  # the third access: b is dropped, and a...
    await put(store, [b])  # ...is admitted when evicted now
    assert store.lookup(NS, hashes([a])).tiers == [Tier.DISK]


async def test_disk_over_capacity_evicts_its_least_recent_blocks(open_store):
    recs = [make_rec(i) for i in range(6)]
    record = max(len(r.header) for r in recs) + BLOCK
    store = await open_store(host_bytes=BLOCK, disk_bytes=3 * record)
    for r in recs:
        await put(store, [r])
    tiers = [store.lookup(NS, [r.chain_hash]).tiers for r in recs]
    assert tiers == [[], [], [Tier.DISK], [Tier.DISK], [Tier.DISK], [Tier.HOST]]
    assert store.index.used[Tier.DISK] <= 3 * record
    assert store.counters.tiers[Tier.DISK].evictions == 2
    assert not store.disk.contains(make_key(NS, recs[0].chain_hash))


# --- moves --------------------------------------------------------------------------------------


async def test_demote_then_promote_returns_identical_bytes(open_store):
    store = await open_store(host_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(8)]
    for r in recs:
        await put(store, [r])
    assert store.lookup(NS, hashes(recs[:4])).tiers == [Tier.DISK] * 4
    acq = await store.acquire(NS, hashes(recs[:4]))
    assert [b.tier for b in acq.blocks] == [Tier.DISK] * 4
    assert [(b.header, bytes(store.host.view(b.slot))) for b in acq.blocks] == [(r.header, r.payload) for r in recs[:4]]
    store.release(acq.lease_id)
    c = store.counters
    assert c.demotions >= 4 and c.promotions == 4 and c.tiers[Tier.DISK].hits == 4
    assert store.lookup(NS, hashes(recs[:4])).tiers == [Tier.HOST] * 4  # promoted, disk copy kept
    assert all(Tier.DISK in i.tiers for i in store.iter_blocks(NS) if i.chain_hash in hashes(recs[:4]))


async def test_acquire_promotes_disk_blocks_between_host_blocks(open_store):
    store = await open_store(host_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(6)]
    for r in recs:
        await put(store, [r])  # host 2 3 4 5, disk 0 1
    await get(store, NS, hashes(recs[2:3]))  # host LRU: 3 4 5 2
    await get(store, NS, hashes(recs[0:1]))  # 0 promoted, 3 demoted: host 4 5 2 0
    assert store.lookup(NS, hashes(recs[1:4])).tiers == [Tier.DISK, Tier.HOST, Tier.DISK]
    acq = await store.acquire(NS, hashes(recs[1:4]))
    assert [b.tier for b in acq.blocks] == [Tier.DISK, Tier.HOST, Tier.DISK]
    assert [bytes(store.host.view(b.slot)) for b in acq.blocks] == [r.payload for r in recs[1:4]]
    store.release(acq.lease_id)
    assert (await store.check()).ok


async def test_acquire_serves_what_fits_in_host_memory(open_store):
    store = await open_store(host_bytes=4 * BLOCK)
    recs = [make_rec(i) for i in range(8)]
    for r in recs:
        await put(store, [r])  # host 4..7, disk 0..7 minus host
    acq = await store.acquire(NS, hashes(recs))  # 4..7 are leased: no room to promote 0
    assert acq.blocks == [] and acq.lease_id == 0
    assert store.counters.tiers[Tier.HOST].misses == 1
    assert store.index.used[Tier.HOST] == 4 * BLOCK and (await store.check()).ok


async def test_events_announce_moves_destination_first(open_store):
    store = await open_store(host_bytes=BLOCK)
    a, b = make_rec(0), make_rec(1)
    await put(store, [a])
    await put(store, [b])
    ev = [(e.kind, e.tier, e.chain_hash) for e in store.take_events()]
    assert ev == [(EventKind.STORED, Tier.HOST, a.chain_hash),
                  (EventKind.STORED, Tier.DISK, a.chain_hash), (EventKind.REMOVED, Tier.HOST, a.chain_hash),
                  (EventKind.STORED, Tier.HOST, b.chain_hash)]
    assert store.take_events() == []


async def test_write_through_commit_is_on_disk_when_acknowledged(open_store):
    store = await open_store(write_through=True)
    recs = [make_rec(i) for i in range(3)]
    assert await put(store, recs) == [True] * 3
    for r in recs:
        record = store.disk.get(make_key(NS, r.chain_hash))
        assert record == r.header + r.payload
    assert store.counters.write_throughs == 3
    assert store.lookup(NS, hashes(recs)).tiers == [Tier.HOST] * 3


async def test_write_through_refuses_a_payload_that_fails_its_checksum(open_store):
    store = await open_store(write_through=True)
    rec = make_rec(0)
    res = await store.reserve(NS, [rec.chain_hash], [BLOCK])
    store.host.view(res.slots[0])[:] = bytes(BLOCK)  # not the bytes the header's checksum covers
    assert await store.commit(res.lease_id, [rec.header]) == [False]
    assert store.counters.checksum_failures == 1
    assert store.lookup(NS, [rec.chain_hash]).num_hits == 0 and store.index.used[Tier.HOST] == 0


async def test_verify_on_commit_checks_the_slot(open_store):
    store = await open_store(verify_on_commit=True, disk_path=None)
    a, b = make_rec(0), make_rec(1)
    res = await store.reserve(NS, hashes([a, b]), [BLOCK, BLOCK])
    store.host.view(res.slots[0])[:] = a.payload
    store.host.view(res.slots[1])[:] = a.payload  # wrong bytes for b
    assert await store.commit(res.lease_id, [a.header, b.header]) == [True, False]
    assert store.counters.checksum_failures == 1


async def test_a_failing_disk_write_is_not_acknowledged_and_leaks_nothing(open_store):
    store = await open_store(write_through=True)
    store.disk.close()  # every later disk call fails with StorageError
    assert await put(store, [make_rec(0)]) == [False]
    assert store.counters.storage_errors == 1
    assert store.index.used[Tier.HOST] == 0 and store.host.allocated_bytes == 0
    assert store.lookup(NS, [make_rec(0).chain_hash]).num_hits == 0


async def test_a_failing_demotion_drops_the_block_and_frees_the_slot(open_store):
    store = await open_store(host_bytes=BLOCK)
    await put(store, [make_rec(0)])
    store.disk.close()
    assert await put(store, [make_rec(1)]) == [True]  # 0 could not be written down: dropped
    assert store.lookup(NS, [make_rec(0).chain_hash]).num_hits == 0
    assert store.counters.storage_errors == 1 and store.index.accounting_errors() == []


# --- integrity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["payload", "header"])
async def test_flipped_byte_in_a_disk_record_is_a_counted_miss(open_store, where):
    store = await open_store(host_bytes=2 * BLOCK)
    recs = [make_rec(i) for i in range(4)]
    for r in recs:
        await put(store, [r])  # 0 and 1 are demoted to disk
    bad = recs[1]
    key = make_key(NS, bad.chain_hash)
    if where == "payload":
        flipped = bytearray(bad.payload)
        flipped[1000] ^= 0x01
        store.disk.put_many([(key, bad.header, bytes(flipped))])
    else:
        flipped = bytearray(bad.header)
        flipped[len(flipped) - 3] ^= 0x01  # inside the msgpack map
        store.disk.put_many([(key, bytes(flipped), bad.payload)])
    got = await get(store, NS, hashes(recs[:2]))
    assert got == [(recs[0].header, recs[0].payload)]  # the prefix ends at the bad block
    assert store.counters.checksum_failures == 1
    assert store.lookup(NS, [bad.chain_hash]).num_hits == 0  # dropped
    assert not store.disk.contains(key)


async def test_check_finds_and_fixes_orphans_missing_and_corrupt_copies(open_store):
    store = await open_store(host_bytes=2 * BLOCK)
    recs = [make_rec(i) for i in range(4)]
    for r in recs:
        await put(store, [r])  # 0, 1 on disk; 2, 3 in host
    orphan = make_rec(9)
    store.disk.put_many([(make_key(NS, orphan.chain_hash), orphan.header, orphan.payload)])
    store.disk.delete_many([make_key(NS, recs[0].chain_hash)])
    acq = await store.acquire(NS, hashes(recs[2:3]))
    store.host.view(acq.blocks[0].slot)[0] ^= 0xFF  # corrupt a host copy (a misbehaving client)
    store.release(acq.lease_id)
    report = await store.check()
    assert report.missing == [make_key(NS, recs[0].chain_hash)]
    assert report.orphans == [make_key(NS, orphan.chain_hash)]
    assert report.corrupt == [(make_key(NS, recs[2].chain_hash), Tier.HOST)]
    assert not report.ok and report.accounting == []
    fixed = await store.check(fix=True)
    assert fixed.adopted == [make_key(NS, orphan.chain_hash)]
    assert (await store.check()).ok
    assert await get(store, NS, [orphan.chain_hash]) == [(orphan.header, orphan.payload)]
    assert store.lookup(NS, hashes(recs)).num_hits == 0  # block 0 was forgotten
