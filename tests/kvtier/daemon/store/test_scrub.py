"""The commit scrubber: committed host copies are checked once, off the request path; a copy that
does not match its checksum is deleted and counted, never reported checked."""

from __future__ import annotations

import asyncio

from kvtier_protocol.header import payload_checksum

from kvtier.daemon.store.scrub import HASH_CHUNK, _digests
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put


def hashes(recs):
    return [r.chain_hash for r in recs]


async def checked_flags(store, recs):
    acq = await store.acquire(NS, hashes(recs))
    try:
        return [b.checked for b in acq.blocks]
    finally:
        if acq.lease_id:
            store.release(acq.lease_id)


async def test_committed_host_copies_become_checked(open_store):
    store = await open_store()
    recs = [make_rec(i) for i in range(4)]
    assert await put(store, recs) == [True] * 4
    await store.drain_scrub()
    assert await checked_flags(store, recs) == [True] * 4
    assert store.counters.checksum_failures == 0
    assert await get(store, NS, hashes(recs)) == [(r.header, r.payload) for r in recs]


async def test_a_payload_that_does_not_match_its_header_is_deleted_not_checked(open_store):
    store = await open_store()
    recs = [make_rec(i) for i in range(3)]
    res = await store.reserve(NS, hashes(recs), [BLOCK] * 3)
    for i, (rec, slot) in enumerate(zip(recs, res.slots)):
        payload = bytearray(rec.payload)
        if i == 1:
            payload[100] ^= 0x40  # the client wrote other bytes than it checksummed
        store.host.view(slot)[:] = payload
    assert await store.commit(res.lease_id, [r.header for r in recs]) == [True] * 3
    await store.drain_scrub()
    assert store.counters.checksum_failures == 1
    assert store.lookup(NS, hashes(recs)).num_hits == 1  # the prefix ends before the bad block
    assert store.lookup(NS, [recs[2].chain_hash]).num_hits == 1  # the good one after it stays
    assert await checked_flags(store, recs) == [True]
    assert store.index.accounting_errors() == []


async def test_a_copy_a_move_is_still_filling_is_not_judged(open_store):
    # A committed block queued for the scrub, evicted and being promoted back when the scrub gets
    # to it: its host slot holds a partial copy (here: other bytes) while the block is in a move.
    # The move verifies what it copies; the scrub must not count or delete it (a soak saw both).
    store = await open_store()
    rec = make_rec(0)
    assert await put(store, [rec]) == [True]  # queued; the scrub waits for commits to pause
    meta = store.index.get(make_key(NS, rec.chain_hash))
    view = store.host.view(meta.host_slot)
    store.index.set_moving(meta, True)
    view[:] = bytes(len(view))  # the promotion's copy, not yet complete
    await store.drain_scrub()
    view[:] = rec.payload  # the copy completes
    store.index.set_moving(meta, False)
    assert store.counters.checksum_failures == 0
    assert await get(store, NS, [rec.chain_hash]) == [(rec.header, rec.payload)]


async def test_without_scrub_commits_nothing_is_reported_checked(open_store):
    store = await open_store(scrub_commits=False)
    recs = [make_rec(i) for i in range(2)]
    await put(store, recs)
    await store.drain_scrub()  # returns at once
    assert await checked_flags(store, recs) == [False, False]


async def test_promoted_copies_are_checked_and_eviction_forgets_the_mark(open_store):
    store = await open_store(host_bytes=2 * BLOCK, host_segment_bytes=2 * BLOCK, scrub_commits=False)
    recs = [make_rec(i) for i in range(4)]
    for r in recs:
        await put(store, [r])  # 0 and 1 are demoted to disk, never checked in host
    # 0 and 1 come back from disk: verified on the way in, so reported checked.
    assert await checked_flags(store, recs[:2]) == [True, True]
    evicted = [m for m in store.index.blocks() if m.host_slot is None]
    assert evicted and all(not m.host_checked for m in evicted)


async def test_a_gpu_reserved_block_is_not_scrubbed_in_host(open_store):
    store = await open_store(gpu_bytes=4 * BLOCK, gpu_device="cpu")
    rec = make_rec(0)
    assert await put(store, [rec], tier=Tier.GPU) == [True]
    await store.drain_scrub()
    meta = next(iter(store.index.blocks()))
    assert meta.host_slot is None and not meta.host_checked


async def test_one_batch_judges_each_block_on_its_own(open_store):
    # Every committed block goes to the I/O pool in one batch; the bad ones among them (first,
    # middle, last) are dropped and counted, each good one is marked, whatever its neighbours.
    store = await open_store(host_bytes=64 * BLOCK, host_segment_bytes=64 * BLOCK)
    recs = [make_rec(i) for i in range(24)]
    bad = {0, 11, 23}
    res = await store.reserve(NS, hashes(recs), [BLOCK] * len(recs))
    for i, (rec, slot) in enumerate(zip(recs, res.slots)):
        payload = bytearray(rec.payload)
        if i in bad:
            payload[7] ^= 0x01
        store.host.view(slot)[:] = payload
    assert await store.commit(res.lease_id, [r.header for r in recs]) == [True] * len(recs)
    await store.drain_scrub()
    assert store.counters.checksum_failures == len(bad)
    assert store._scrubber.checked == len(recs) - len(bad) and store._scrubber.dropped == len(bad)
    for i, rec in enumerate(recs):
        assert store.lookup(NS, [rec.chain_hash]).num_hits == (i not in bad)
    good = [r for i, r in enumerate(recs) if i not in bad]
    assert await checked_flags(store, good[:10]) == [True] * 10  # a run of consecutive good blocks
    assert store.index.accounting_errors() == []


def test_a_stopping_or_yielding_scrub_leaves_the_rest_of_its_batch_unhashed():
    # Flags the hashing thread reads between blocks: stop() (the slots are about to be unmapped)
    # ends every batch; a commit ends only a batch hashed in a pause (yielding), whose unhashed
    # blocks go back to the queue. None: not hashed, so not judged.
    views = [memoryview(make_rec(i).payload) for i in range(3)]
    flags = [False, False]
    assert _digests(views, flags, True) == [payload_checksum(v) for v in views]
    big = memoryview(bytes(range(256)) * (HASH_CHUNK // 64))  # four chunks: hashed piecewise
    assert _digests([big], flags, True) == [payload_checksum(big)]
    flags[1] = True  # a commit came
    assert _digests(views, flags, False) == [payload_checksum(v) for v in views]  # overdue blocks: to the end
    assert _digests(views, flags, True) == [None, None, None]
    flags[:] = [True, False]  # stop()
    assert _digests(views, flags, False) == [None, None, None]


async def test_blocks_a_commit_interrupted_are_checked_in_the_next_pause(open_store):
    # Commits keep arriving while the scrub hashes: whatever it yields goes back to the queue,
    # and every block ends up checked once the commits pause.
    store = await open_store(host_bytes=64 * BLOCK, host_segment_bytes=64 * BLOCK)
    recs = [make_rec(i) for i in range(40)]
    for i in range(0, 40, 4):
        assert await put(store, recs[i:i + 4]) == [True] * 4
        await asyncio.sleep(0)  # let the scrub start on what is queued, if it is due
    await store.drain_scrub()
    assert store._scrubber.checked == 40 and store.counters.checksum_failures == 0
    assert await checked_flags(store, recs) == [True] * 40
