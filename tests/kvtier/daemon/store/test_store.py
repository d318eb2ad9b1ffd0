"""TieredStore: prefix lookup, put/get, leases, delete/clear, counters, lifecycle, bad input.

Eviction, moves and integrity are in test_store_moves.py.
"""

from __future__ import annotations

import asyncio

import pytest

from kvtier_protocol.errors import (CapacityError, HeaderError, InvalidKey, InvalidRequest, LeaseError,
                                    NamespaceError)
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.store.config import StoreConfig, StoreConfigError, ZeroCapacity
from kvtier.daemon.store.results import PutStatus
from kvtier.daemon.store.types import Tier
from tests.kvtier.daemon.store.storekit import BLOCK, NS, Clock, get, make_rec, put

NS2 = bytes(range(16, 32))


def hashes(recs):
    return [r.chain_hash for r in recs]


# --- lookup and put/get ------------------------------------------------------------------------


async def test_lookup_counts_the_consecutive_prefix(open_store):
    store = await open_store(disk_path=None)
    recs = [make_rec(i) for i in range(4)]
    assert await put(store, [recs[0], recs[1]]) == [True, True]
    assert await put(store, [recs[3]]) == [True]
    res = store.lookup(NS, hashes(recs))
    assert res.num_hits == 2 and res.tiers == [Tier.HOST, Tier.HOST]
    assert store.lookup(NS, hashes(recs[2:])).num_hits == 0  # a gap at the start: nothing
    assert store.lookup(NS2, hashes(recs)).num_hits == 0  # another namespace: nothing
    assert store.lookup(NS, []).num_hits == 0
    assert store.lookup_names(NS, hashes(recs)) == (2, ["host", "host"])
    assert store.lookup_names(NS2, hashes(recs)) == (0, [])
    assert store.counters.lookups == 6 and store.counters.lookup_hits == 4


async def test_lookup_and_lookup_names_refuse_the_same_keys(open_store):
    store = await open_store(disk_path=None)
    good = make_rec(0).chain_hash
    bad_cases = [(NS[:15], [good]), (bytearray(NS), [good]), (NS, [good[:-1]]), (NS, [good, good + b"x"]),
                 (NS, [bytearray(good)]), (NS, [good, None]), (NS, [good] * (store.config.max_batch + 1))]
    for ns_id, hs in bad_cases:
        errors = []
        for call in (store.lookup, store.lookup_names):
            with pytest.raises((InvalidKey, InvalidRequest)) as exc:
                call(ns_id, hs)
            errors.append(type(exc.value))
        assert errors[0] is errors[1], (ns_id, hs)


async def test_put_then_get_returns_header_and_payload_byte_identical(open_store):
    store = await open_store()
    recs = [make_rec(i) for i in range(3)]
    await put(store, recs)
    assert await get(store, NS, hashes(recs)) == [(r.header, r.payload) for r in recs]


async def test_reserve_reports_stored_and_pending_keys_without_rewriting(open_store):
    store = await open_store()
    a, b, c = (make_rec(i) for i in range(3))
    await put(store, [a])
    first = await store.reserve(NS, hashes([b]), [BLOCK])
    res = await store.reserve(NS, hashes([a, b, c]), [BLOCK] * 3)
    assert res.status == [PutStatus.STORED, PutStatus.PENDING, PutStatus.RESERVED]
    assert res.slots[0] is None and res.slots[1] is None and res.slots[2] is not None
    store.host.view(res.slots[2])[:] = c.payload
    assert await store.commit(res.lease_id, [None, None, c.header]) == [False, False, True]
    assert store.release(first.lease_id)  # abandon b
    assert store.lookup(NS, hashes([a, b])).num_hits == 1
    assert store.gauges().tiers[Tier.HOST].used_bytes == 2 * BLOCK


async def test_commit_with_none_header_abandons_that_slot(open_store):
    store = await open_store()
    a, b = make_rec(0), make_rec(1)
    res = await store.reserve(NS, hashes([a, b]), [BLOCK, BLOCK])
    store.host.view(res.slots[0])[:] = a.payload
    assert await store.commit(res.lease_id, [a.header, None]) == [True, False]
    assert store.index.used[Tier.HOST] == BLOCK and store.gauges().pending == 0
    with pytest.raises(LeaseError):
        await store.commit(res.lease_id, [a.header, None])  # a lease commits once


# --- leases -------------------------------------------------------------------------------------


async def test_leased_blocks_are_never_evicted_and_leases_expire(open_store):
    clock = Clock()
    store = await open_store(disk_path=None, host_bytes=2 * BLOCK, now=clock, lease_seconds=5.0)
    a, b, c = (make_rec(i) for i in range(3))
    await put(store, [a, b])
    acq = await store.acquire(NS, hashes([a, b]))
    res = await store.reserve(NS, [c.chain_hash], [BLOCK])
    assert res.status == [PutStatus.FULL] and res.lease_id == 0  # both blocks leased: no room
    clock.t += 5.0
    assert store.reclaim_expired() == 1 and store.counters.lease_expiries == 1
    assert store.release(acq.lease_id) is False  # already reclaimed
    assert await put(store, [c]) == [True]  # now a leased block could be evicted


async def test_expired_put_lease_frees_its_slots(open_store):
    clock = Clock()
    store = await open_store(now=clock)
    rec = make_rec(0)
    res = await store.reserve(NS, [rec.chain_hash], [BLOCK], lease_s=2.0)
    assert store.index.used[Tier.HOST] == BLOCK
    clock.t += 2.5
    assert store.lookup(NS, [rec.chain_hash]).num_hits == 0  # any call reclaims lazily
    assert store.index.used[Tier.HOST] == 0 and store.gauges().pending == 0
    with pytest.raises(LeaseError):
        await store.commit(res.lease_id, [rec.header])


async def test_delete_of_a_leased_block_frees_its_slot_at_release(open_store):
    store = await open_store()
    recs = [make_rec(i) for i in range(2)]
    await put(store, recs)
    acq = await store.acquire(NS, hashes(recs))
    assert await store.delete(NS, hashes(recs[:1])) == 1
    assert store.lookup(NS, hashes(recs)).num_hits == 0
    assert bytes(store.host.view(acq.blocks[0].slot)) == recs[0].payload  # the reader still copies
    assert store.index.used[Tier.HOST] == 2 * BLOCK
    store.release(acq.lease_id)
    assert store.index.used[Tier.HOST] == BLOCK
    assert (await store.check()).ok


async def test_clear_removes_one_namespace_from_every_tier(open_store):
    store = await open_store(host_bytes=2 * BLOCK)
    mine = [make_rec(i) for i in range(3)]
    other = make_rec(0, ns=NS2)
    for r in mine:
        await put(store, [r])
    await put(store, [other])
    assert await store.clear(NS) == 3
    assert store.lookup(NS, hashes(mine)).num_hits == 0
    assert store.lookup(NS2, [other.chain_hash]).num_hits == 1
    assert store.disk.num_records <= 1 and (await store.check()).ok


async def test_concurrent_puts_and_gets_stay_consistent(open_store):
    store = await open_store(host_bytes=8 * BLOCK, write_through=True)
    recs = [make_rec(i) for i in range(24)]

    async def writer(chunk):
        for r in chunk:
            assert await put(store, [r]) == [True]

    async def reader():
        for _ in range(10):
            got = await get(store, NS, hashes(recs[:6]))
            assert got == [(r.header, r.payload) for r in recs[:len(got)]]
            await asyncio.sleep(0)

    await asyncio.gather(writer(recs[:12]), writer(recs[12:]), reader(), reader())
    assert store.lookup(NS, hashes(recs[:12])).num_hits == 12  # all on disk at least
    assert (await store.check()).ok


# --- counters ------------------------------------------------------------------------------------


async def test_take_counters_returns_deltas(open_store):
    store = await open_store()
    await put(store, [make_rec(0)])
    assert store.take_counters().commits == 1
    await put(store, [make_rec(1)])
    delta = store.take_counters()
    assert delta.commits == 1 and delta.tiers[Tier.HOST].bytes_in == BLOCK
    assert store.counters.commits == 2


# --- bad input ----------------------------------------------------------------------------------


async def test_bad_input_raises_typed_errors_and_loses_nothing(open_store):
    store = await open_store(host_bytes=4 * BLOCK)
    kept = [make_rec(i) for i in range(3)]
    await put(store, kept)
    with pytest.raises(CapacityError):
        await store.reserve(NS, [make_rec(5).chain_hash], [5 * BLOCK])  # larger than the tier
    with pytest.raises(InvalidKey):
        await store.reserve(NS, [b"short"], [BLOCK])
    with pytest.raises(InvalidKey):
        store.lookup(b"x" * 15, [kept[0].chain_hash])
    with pytest.raises(InvalidRequest):
        await store.reserve(NS, hashes([kept[0], kept[0]]), [BLOCK, BLOCK])
    with pytest.raises(InvalidRequest):
        await store.reserve(NS, [make_rec(5).chain_hash], [0])
    assert await get(store, NS, hashes(kept)) == [(r.header, r.payload) for r in kept]


async def test_commit_refuses_headers_that_do_not_match_and_keeps_the_lease(open_store):
    store = await open_store()
    ns = Namespace(model="m", revision="r", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
                   kv_dtype="float16", block_tokens=16, hash_tokens=16)
    store.register_namespace(ns)
    good = make_rec(0, ns=ns.ns_id)
    res = await store.reserve(ns.ns_id, [good.chain_hash], [BLOCK])
    store.host.view(res.slots[0])[:] = good.payload
    with pytest.raises(HeaderError):
        await store.commit(res.lease_id, [make_rec(1, ns=ns.ns_id).header])  # another key
    with pytest.raises(HeaderError):
        await store.commit(res.lease_id, [good.header + b"x"])
    other_geometry = Namespace(model="m", revision="r", attention="mha", num_layers=2, num_kv_heads=1,
                               head_dim=64, kv_dtype="float16", block_tokens=16, hash_tokens=16)
    store.register_namespace(Namespace(**{**_fields(other_geometry)}))
    wrong = make_rec(0, ns=other_geometry.ns_id)  # 1 layer, the namespace says 2
    res2 = await store.reserve(other_geometry.ns_id, [wrong.chain_hash], [BLOCK])
    with pytest.raises(NamespaceError):
        await store.commit(res2.lease_id, [wrong.header])
    assert await store.commit(res.lease_id, [good.header]) == [True]  # the lease survived the errors
    with pytest.raises(InvalidRequest):
        await store.commit(res2.lease_id, [])


def _fields(ns: Namespace) -> dict:
    return {k: getattr(ns, k) for k in ("model", "revision", "attention", "num_layers", "num_kv_heads",
                                        "head_dim", "kv_dtype", "block_tokens", "hash_tokens")}


async def test_a_store_starts_once_and_closes_idempotently(open_store):
    store = await open_store()
    with pytest.raises(InvalidRequest):
        await store.start()
    await store.close()
    await store.close()
    with pytest.raises(InvalidRequest):
        await store.acquire(NS, [make_rec(0).chain_hash])


@pytest.mark.parametrize("settings, error", [
    (dict(host_bytes=0), ZeroCapacity),
    (dict(host_bytes=1 << 20, disk_path="/tmp/x", disk_bytes=0), ZeroCapacity),
    (dict(host_bytes=1 << 20, write_through=True), StoreConfigError),
    (dict(host_bytes=1 << 20, lease_seconds=0), StoreConfigError),
    (dict(host_bytes=1 << 20, lease_seconds=100, max_lease_seconds=10), StoreConfigError),
    (dict(host_bytes=1 << 20, priority_classes=0), StoreConfigError),
    (dict(host_bytes=True), StoreConfigError),
    (dict(host_bytes=1 << 20, gpu_bytes=1 << 20, gpu_device="gpu 0"), StoreConfigError),
    (dict(host_bytes=1 << 20, gpu_bytes=-1), StoreConfigError),
    (dict(host_bytes=1 << 20, flush_on_close=1), StoreConfigError),
])
def test_config_errors_are_typed_value_errors(settings, error):
    with pytest.raises(error) as info:
        StoreConfig(**settings)
    assert isinstance(info.value, ValueError)
