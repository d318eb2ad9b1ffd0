"""TieredStore.grant / place: slots reserved before their keys are known, named when written."""

from __future__ import annotations

import pytest

from kvtier_protocol.errors import HeaderError, InvalidKey, InvalidRequest, LeaseError, ProtocolError

from kvtier.daemon.store.results import PlaceStatus, PutStatus
from kvtier.daemon.store.types import GRANT_NS, Tier
from tests.kvtier.daemon.store.storekit import BLOCK, NS, Clock, get, make_rec, put


def hashes(recs):
    return [r.chain_hash for r in recs]


async def test_placed_blocks_read_back_byte_identical_and_the_grant_ends_when_used_up(open_store):
    store = await open_store()
    recs = [make_rec(i) for i in range(3)]
    grant = await store.grant([BLOCK] * 3)
    assert grant.lease_id and grant.status == [PutStatus.RESERVED] * 3
    assert store.gauges().pending == 3 and store.lookup(NS, hashes(recs)).num_hits == 0
    for pos, rec in zip([1, 2, 0], recs):  # any slot for any block
        store.host.view(grant.slots[pos])[:] = rec.payload
    # Any positions, in any order, over several calls.
    assert await store.place(grant.lease_id, NS, hashes(recs[1:]), [2, 0], [r.header for r in recs[1:]]) \
        == [PlaceStatus.PLACED, PlaceStatus.PLACED]
    assert store.lookup(NS, hashes(recs)).num_hits == 0  # block 0 not placed yet: no prefix
    assert await store.place(grant.lease_id, NS, hashes(recs[:1]), [1], [recs[0].header]) == [PlaceStatus.PLACED]
    assert store.gauges().pending == 0
    assert await get(store, NS, hashes(recs)) == [(r.header, r.payload) for r in recs]
    with pytest.raises(LeaseError):  # used up: the grant ended
        await store.place(grant.lease_id, NS, hashes(recs[:1]), [1], [recs[0].header])
    await store.drain_scrub()
    assert store.counters.checksum_failures == 0


async def test_open_grants_keep_the_store_consistent_and_out_of_every_listing(open_store):
    store = await open_store()
    a = make_rec(0)
    await put(store, [a])
    grant = await store.grant([BLOCK] * 2)
    assert (await store.check()).ok  # the audit counts granted slots as reservations
    assert [ns.ns_id for ns in store.namespaces()] == []  # a put registers no namespace here
    assert [b.chain_hash for b in store.iter_blocks()] == [a.chain_hash]
    assert list(store.iter_blocks(GRANT_NS)) == [] and store.lookup(NS, [a.chain_hash]).num_hits == 1
    assert store.gauges().pending == 2
    assert store.release(grant.lease_id) and (await store.check()).ok


async def test_a_key_already_stored_frees_its_granted_slot(open_store):
    store = await open_store(host_bytes=4 * BLOCK, host_segment_bytes=4 * BLOCK)
    a, b = make_rec(0), make_rec(1)
    await put(store, [a])
    pending = await store.reserve(NS, hashes([b]), [BLOCK])  # b is being written by someone else
    grant = await store.grant([BLOCK] * 2)
    assert store.index.used[Tier.HOST] == 4 * BLOCK
    for slot, rec in zip(grant.slots, (a, b)):
        store.host.view(slot)[:] = rec.payload
    assert await store.place(grant.lease_id, NS, hashes([a, b]), [0, 1], [a.header, b.header]) \
        == [PlaceStatus.EXISTS, PlaceStatus.EXISTS]
    assert store.index.used[Tier.HOST] == 2 * BLOCK  # both granted slots freed
    assert store.release(pending.lease_id)
    assert store.lookup(NS, hashes([a, b])).num_hits == 1


async def test_release_and_expiry_free_the_slots_not_placed(open_store):
    clock = Clock()
    store = await open_store(now=clock, lease_seconds=5.0)
    a = make_rec(0)
    grant = await store.grant([BLOCK] * 3)
    store.host.view(grant.slots[1])[:] = a.payload
    assert await store.place(grant.lease_id, NS, [a.chain_hash], [1], [a.header]) == [PlaceStatus.PLACED]
    assert store.release(grant.lease_id) and store.index.used[Tier.HOST] == BLOCK
    assert not store.release(grant.lease_id)
    second = await store.grant([BLOCK] * 2, lease_s=5.0)
    assert store.index.used[Tier.HOST] == 3 * BLOCK
    clock.t += 6
    assert store.reclaim_expired() == 1 and store.index.used[Tier.HOST] == BLOCK
    with pytest.raises(LeaseError):
        await store.place(second.lease_id, NS, [make_rec(1).chain_hash], [0], [make_rec(1).header])
    assert store.lookup(NS, [a.chain_hash]).num_hits == 1 and store.gauges().pending == 0


async def test_grants_make_room_like_reservations_and_answer_full_past_it(open_store):
    store = await open_store(disk_path=None, host_bytes=4 * BLOCK, host_segment_bytes=4 * BLOCK)
    old = [make_rec(i) for i in range(3)]
    await put(store, old)
    grant = await store.grant([BLOCK] * 5)
    assert grant.status == [PutStatus.RESERVED] * 4 + [PutStatus.FULL] and grant.slots[4] is None
    assert store.lookup(NS, hashes(old)).num_hits == 0  # evicted for the granted slots
    with pytest.raises(InvalidRequest):  # the position that got no slot
        await store.place(grant.lease_id, NS, [old[0].chain_hash], [4], [old[0].header])
    assert store.release(grant.lease_id) and store.index.used[Tier.HOST] == 0


async def test_bad_places_change_nothing(open_store):
    store = await open_store()
    a, b = make_rec(0), make_rec(1)
    big = make_rec(2, nbytes=2 * BLOCK)
    grant = await store.grant([BLOCK] * 2)
    reservation = await store.reserve(NS, [big.chain_hash], [2 * BLOCK])
    cases = [
        (InvalidRequest, dict(positions=[0, 0], hs=hashes([a, b]), headers=[a.header, b.header])),
        (InvalidRequest, dict(positions=[2], hs=hashes([a]), headers=[a.header])),
        (InvalidRequest, dict(positions=[-1], hs=hashes([a]), headers=[a.header])),
        (InvalidRequest, dict(positions=[0, 1], hs=hashes([a]), headers=[a.header])),
        (InvalidRequest, dict(positions=[0, 1], hs=[a.chain_hash] * 2, headers=[a.header] * 2)),
        (HeaderError, dict(positions=[0], hs=hashes([a]), headers=[b.header])),  # names another block
        (ProtocolError, dict(positions=[0], hs=hashes([a]), headers=[a.header[:-3]])),
        (InvalidKey, dict(positions=[0], hs=[a.chain_hash[:-1]], headers=[a.header])),
    ]
    for exc, case in cases:
        with pytest.raises(exc):
            await store.place(grant.lease_id, NS, case["hs"], case["positions"], case["headers"])
    with pytest.raises(InvalidKey):  # the placeholders' namespace is the daemon's own
        await store.place(grant.lease_id, GRANT_NS, hashes([a]), [0], [a.header])
    with pytest.raises(InvalidKey):
        await store.reserve(GRANT_NS, hashes([a]), [BLOCK])
    with pytest.raises(LeaseError):  # a reservation is not a grant, nor a grant a reservation
        await store.place(reservation.lease_id, NS, [big.chain_hash], [0], [big.header])
    with pytest.raises(LeaseError):
        await store.commit(grant.lease_id, [a.header, b.header])
    with pytest.raises(HeaderError):  # a header whose size is not the granted slot's
        await store.place(grant.lease_id, NS, [big.chain_hash], [0], [big.header])
    with pytest.raises(InvalidRequest):
        await store.grant([BLOCK] * (store.config.max_batch + 1))
    # Nothing was placed: both slots still granted and usable.
    for slot, rec in zip(grant.slots, (a, b)):
        store.host.view(slot)[:] = rec.payload
    assert await store.place(grant.lease_id, NS, hashes([a, b]), [0, 1], [a.header, b.header]) \
        == [PlaceStatus.PLACED] * 2
    assert await get(store, NS, hashes([a, b])) == [(a.header, a.payload), (b.header, b.payload)]


async def test_verify_on_commit_fails_a_placed_block_with_a_bad_payload(open_store):
    store = await open_store(verify_on_commit=True)
    a, b = make_rec(0), make_rec(1)
    grant = await store.grant([BLOCK] * 2)
    store.host.view(grant.slots[0])[:] = a.payload
    store.host.view(grant.slots[1])[:] = a.payload  # not b's bytes
    assert await store.place(grant.lease_id, NS, hashes([a, b]), [0, 1], [a.header, b.header]) \
        == [PlaceStatus.PLACED, PlaceStatus.FAILED]
    assert store.lookup(NS, hashes([a, b])).num_hits == 1 and store.counters.checksum_failures == 1
    assert store.index.used[Tier.HOST] == BLOCK


async def test_the_batched_place_keeps_the_index_as_renaming_and_committing_one_by_one_would(open_store):
    # The common place (every key new, no verify): renamed and committed in one pass
    # (BlockIndex.place_many); blocks, namespaces, LRU queues, charges and leases as before.
    store = await open_store()
    recs = [make_rec(i) for i in range(6)]
    grant = await store.grant([BLOCK] * 6)
    for slot, rec in zip(grant.slots, recs):
        store.host.view(slot)[:] = rec.payload
    assert await store.place(grant.lease_id, NS, hashes(recs[:4]), [0, 1, 2, 3], [r.header for r in recs[:4]],
                             checked=True) == [PlaceStatus.PLACED] * 4
    assert store.index.accounting_errors() == []
    assert store.gauges().pending == 2 and store.lookup(NS, hashes(recs)).num_hits == 4
    assert list(store.iter_blocks(GRANT_NS)) == [] and len(store.index.namespace(GRANT_NS)) == 2
    assert all(store.index.visible(NS + r.chain_hash).host_checked for r in recs[:4])
    before = store.counters
    assert await store.place(grant.lease_id, NS, hashes(recs[4:]), [4, 5], [r.header for r in recs[4:]]) \
        == [PlaceStatus.PLACED] * 2
    after = store.counters
    assert after.commits - before.commits == 2
    assert after.tiers[Tier.HOST].bytes_in - before.tiers[Tier.HOST].bytes_in == 2 * BLOCK
    assert store.index.namespace(GRANT_NS) == [] and store.index.accounting_errors() == []
    events = [e for e in store.take_events() if e.ns_id == NS]
    assert [e.chain_hash for e in events] == hashes(recs)  # one STORED each, in order
    assert await get(store, NS, hashes(recs)) == [(r.header, r.payload) for r in recs]
    assert store.index.accounting_errors() == [] and (await store.check()).ok


async def test_a_grant_past_the_room_left_grants_a_prefix_and_answers_full_for_the_rest(open_store):
    store = await open_store(host_bytes=4 * BLOCK, host_segment_bytes=4 * BLOCK)
    await put(store, [make_rec(9)])
    # A pending block is never evicted: the grant gets the 3 slots left beside it, a prefix.
    held = await store.reserve(NS, hashes([make_rec(8)]), [BLOCK])
    grant = await store.grant([BLOCK] * 5)
    assert grant.status == [PutStatus.RESERVED] * 3 + [PutStatus.FULL] * 2  # block 9 was evicted for them
    assert grant.slots[3:] == [None, None] and all(s is not None for s in grant.slots[:3])
    assert store.index.accounting_errors() == [] and store.gauges().pending == 4
    assert store.release(grant.lease_id) and store.release(held.lease_id)
    assert store.gauges().pending == 0 and store.index.accounting_errors() == []
