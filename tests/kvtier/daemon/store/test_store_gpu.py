"""TieredStore with a GPU tier: put/lookup/acquire in GPU memory, the GPU → host → disk demotion
chain, leases, integrity and the flush at close.

The GPU tier runs on a CPU pool (``gpu_device="cpu"``: the same code as on a device); the
CUDA-marked test repeats the chain on a real device where one exists.
"""

from __future__ import annotations

import pytest
import torch

from kvtier_protocol.errors import CapacityError, InvalidRequest

from kvtier.daemon.store.config import StoreConfig, StoreConfigError
from kvtier.daemon.store.results import PutStatus
from kvtier.daemon.store.stats import EventKind
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put, read_block

GPU = Tier.GPU


def hashes(recs):
    return [r.chain_hash for r in recs]


async def gpu_store(open_store, *, device: str = "cpu", gpu_blocks: int = 2, **kw):
    return await open_store(gpu_bytes=gpu_blocks * BLOCK, gpu_device=device, **kw)


# --- put, lookup, acquire ------------------------------------------------------------------------


async def test_a_gpu_put_is_looked_up_as_gpu_and_served_in_place_or_copied_down(open_store):
    store = await gpu_store(open_store, gpu_blocks=4)
    recs = [make_rec(i) for i in range(3)]
    assert await put(store, recs, GPU) == [True] * 3
    assert store.lookup(NS, hashes(recs)).tiers == [GPU] * 3
    assert store.index.used[GPU] == 3 * BLOCK and store.index.used[Tier.HOST] == 0
    assert [(e.kind, e.medium) for e in store.take_events()] == [(EventKind.STORED, "GPU")] * 3

    acq = await store.acquire(NS, hashes(recs), tier=GPU)  # in place: no copy
    assert [(b.tier, b.pool) for b in acq.blocks] == [(GPU, GPU)] * 3
    assert [(b.header, read_block(store, b)) for b in acq.blocks] == [(r.header, r.payload) for r in recs]
    assert store.index.used[Tier.HOST] == 0
    store.release(acq.lease_id)

    acq = await store.acquire(NS, hashes(recs[:2]))  # default: copied down into host slots
    assert [(b.tier, b.pool) for b in acq.blocks] == [(GPU, Tier.HOST)] * 2
    assert [bytes(store.host.view(b.slot)) for b in acq.blocks] == [r.payload for r in recs[:2]]
    store.release(acq.lease_id)
    assert [i.tiers for i in store.iter_blocks(NS) if i.chain_hash in hashes(recs[:2])] == [[GPU, Tier.HOST]] * 2
    assert store.lookup(NS, hashes(recs)).tiers == [GPU] * 3  # fastest first
    c = store.counters
    assert c.tiers[GPU].hits == 5 and c.tiers[GPU].bytes_in == 3 * BLOCK
    assert c.tiers[GPU].bytes_out == 5 * BLOCK and c.tiers[Tier.HOST].bytes_in == 2 * BLOCK
    assert (await store.check()).ok


async def test_acquire_for_gpu_mixes_in_place_gpu_blocks_with_host_blocks(open_store):
    store = await gpu_store(open_store)
    a, b = make_rec(0), make_rec(1)
    await put(store, [a])
    await put(store, [b], GPU)
    acq = await store.acquire(NS, hashes([a, b]), tier=GPU)
    assert [(blk.tier, blk.pool) for blk in acq.blocks] == [(Tier.HOST, Tier.HOST), (GPU, GPU)]
    assert [read_block(store, blk) for blk in acq.blocks] == [a.payload, b.payload]
    store.release(acq.lease_id)


# --- the demotion chain --------------------------------------------------------------------------


async def _chain_scenario(store: TieredStore) -> None:
    """GPU 2 blocks, host 4, roomy disk: 8 GPU puts leave 6, 7 in GPU, 2..5 in host, 0, 1 on disk."""
    recs = [make_rec(i) for i in range(8)]
    for r in recs:
        assert await put(store, [r], GPU) == [True]
    assert store.lookup(NS, hashes(recs)).tiers == [Tier.DISK] * 2 + [Tier.HOST] * 4 + [GPU] * 2
    c = store.counters
    assert c.tiers[GPU].evictions == 6 and c.tiers[GPU].demotions == 6
    assert c.tiers[Tier.HOST].demotions == 2 and c.demotions == 8
    for tier in (GPU, Tier.HOST, Tier.DISK):
        assert store.index.used[tier] <= store.index.capacity[tier]

    assert await get(store, NS, hashes(recs[:4])) == [(r.header, r.payload) for r in recs[:4]]  # 0, 1 promoted
    acq = await store.acquire(NS, hashes(recs[4:]), tier=GPU)  # 4, 5 promoted; 6, 7 in place
    assert [b.pool for b in acq.blocks] == [Tier.HOST, Tier.HOST, GPU, GPU]
    assert [(b.header, read_block(store, b)) for b in acq.blocks] == [(r.header, r.payload) for r in recs[4:]]
    store.release(acq.lease_id)
    assert await get(store, NS, hashes(recs[6:])) == [(r.header, r.payload) for r in recs[6:]]  # copied down
    assert store.index.accounting_errors() == [] and (await store.check()).ok


async def test_gpu_evictions_demote_through_host_to_disk_byte_identical(open_store):
    store = await gpu_store(open_store, host_bytes=4 * BLOCK)
    await _chain_scenario(store)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_gpu_evictions_demote_through_host_to_disk_on_cuda(open_store):
    store = await gpu_store(open_store, device="cuda", host_bytes=4 * BLOCK)
    assert store.gpu.device.type == "cuda"
    await _chain_scenario(store)


async def test_a_gpu_demotion_is_announced_destination_first(open_store):
    store = await gpu_store(open_store, gpu_blocks=1)
    a, b = make_rec(0), make_rec(1)
    await put(store, [a], GPU)
    await put(store, [b], GPU)
    ev = [(e.kind, e.tier, e.chain_hash) for e in store.take_events()]
    assert ev == [(EventKind.STORED, GPU, a.chain_hash),
                  (EventKind.STORED, Tier.HOST, a.chain_hash), (EventKind.REMOVED, GPU, a.chain_hash),
                  (EventKind.STORED, GPU, b.chain_hash)]


async def test_a_gpu_block_whose_copy_went_bad_is_dropped_not_demoted(open_store):
    store = await gpu_store(open_store, gpu_blocks=1)
    a = make_rec(0)
    await put(store, [a], GPU)
    store.gpu.tensor(store.index.visible(make_key(NS, a.chain_hash)).gpu_slot)[7] ^= 0xFF
    await put(store, [make_rec(1)], GPU)
    assert store.lookup(NS, hashes([a])).num_hits == 0 and store.counters.checksum_failures == 1
    assert store.index.used[Tier.HOST] == 0 and store.host.allocated_bytes == 0


async def test_a_default_acquire_of_a_bad_gpu_copy_is_a_counted_miss(open_store):
    store = await gpu_store(open_store)
    a = make_rec(0)
    await put(store, [a], GPU)
    store.gpu.tensor(store.index.visible(make_key(NS, a.chain_hash)).gpu_slot)[0] ^= 0xFF
    assert await get(store, NS, hashes([a])) == []
    assert store.counters.checksum_failures == 1 and store.lookup(NS, hashes([a])).num_hits == 0
    assert store.index.used[GPU] == 0 and store.index.used[Tier.HOST] == 0


# --- leases, writes, removal, audit --------------------------------------------------------------


async def test_leases_pin_gpu_copies(open_store):
    store = await gpu_store(open_store)
    a, b, c = (make_rec(i) for i in range(3))
    await put(store, [a, b], GPU)
    acq = await store.acquire(NS, hashes([a, b]), tier=GPU)
    res = await store.reserve(NS, [c.chain_hash], [BLOCK], tier=GPU)
    assert res.status == [PutStatus.FULL] and res.lease_id == 0
    store.release(acq.lease_id)
    assert await put(store, [c], GPU) == [True]
    assert store.lookup(NS, hashes([a])).tiers == [Tier.HOST]  # a, the least recent, went down


async def test_write_through_of_a_gpu_block_is_on_disk_when_acknowledged(open_store):
    store = await gpu_store(open_store, write_through=True)
    a = make_rec(0)
    assert await put(store, [a], GPU) == [True]
    assert store.disk.get(make_key(NS, a.chain_hash)) == a.header + a.payload
    assert store.lookup(NS, hashes([a])).tiers == [GPU] and store.counters.write_throughs == 1


async def test_verify_on_commit_checks_a_gpu_slot(open_store):
    store = await gpu_store(open_store, verify_on_commit=True)
    a, b = make_rec(0), make_rec(1)
    res = await store.reserve(NS, hashes([a, b]), [BLOCK, BLOCK], tier=GPU)
    assert res.tier is GPU
    store.gpu.copy_in(res.slots[0], torch.frombuffer(bytearray(a.payload), dtype=torch.uint8))
    store.gpu.copy_in(res.slots[1], torch.frombuffer(bytearray(a.payload), dtype=torch.uint8))  # wrong for b
    assert await store.commit(res.lease_id, [a.header, b.header]) == [True, False]
    assert store.index.used[GPU] == BLOCK and store.gpu.allocated_bytes == BLOCK


async def test_delete_of_a_block_read_in_place_frees_its_gpu_slot_at_release(open_store):
    store = await gpu_store(open_store)
    a = make_rec(0)
    await put(store, [a], GPU)
    acq = await store.acquire(NS, hashes([a]), tier=GPU)
    assert await store.delete(NS, hashes([a])) == 1
    assert read_block(store, acq.blocks[0]) == a.payload and store.index.used[GPU] == BLOCK
    store.release(acq.lease_id)
    assert store.index.used[GPU] == 0 and store.gpu.allocated_bytes == 0
    assert [(e.kind, e.tier) for e in store.take_events()][-1] == (EventKind.REMOVED, GPU)


async def test_check_finds_and_drops_a_bad_gpu_copy(open_store):
    store = await gpu_store(open_store)
    a = make_rec(0)
    await put(store, [a], GPU)
    store.gpu.tensor(store.index.visible(make_key(NS, a.chain_hash)).gpu_slot)[0] ^= 0xFF
    assert (await store.check()).corrupt == [(make_key(NS, a.chain_hash), GPU)]
    await store.check(fix=True)
    assert (await store.check()).ok and store.lookup(NS, hashes([a])).num_hits == 0


async def test_close_writes_gpu_blocks_to_disk(open_store):
    store = await gpu_store(open_store)
    recs = [make_rec(i) for i in range(2)]
    await put(store, recs, GPU)
    await store.close()
    again = await open_store()  # no GPU tier now: the blocks come back from disk
    assert again.lookup(NS, hashes(recs)).tiers == [Tier.DISK] * 2
    assert await get(again, NS, hashes(recs)) == [(r.header, r.payload) for r in recs]


# --- bad input and configuration -----------------------------------------------------------------


async def test_gpu_requests_are_checked(open_store):
    plain = await open_store(disk_path=None)
    with pytest.raises(InvalidRequest):
        await plain.reserve(NS, [make_rec(0).chain_hash], [BLOCK], tier=GPU)  # no GPU tier
    store = await gpu_store(open_store)
    with pytest.raises(CapacityError):
        await store.reserve(NS, [make_rec(0).chain_hash], [3 * BLOCK], tier=GPU)  # larger than the GPU tier
    with pytest.raises(InvalidRequest):
        await store.acquire(NS, [make_rec(0).chain_hash], tier=Tier.DISK)
    with pytest.raises(InvalidRequest):
        await store.reserve(NS, [make_rec(0).chain_hash], [BLOCK], tier=Tier.REMOTE)
    assert store.index.used[GPU] == 0 and store.gpu.allocated_bytes == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
def test_a_cuda_gpu_tier_without_cuda_is_a_config_error():
    cfg = StoreConfig(host_bytes=1 << 20, gpu_bytes=1 << 20)  # gpu_device defaults to "cuda"
    with pytest.raises(StoreConfigError, match="CUDA is not available") as info:
        TieredStore(cfg)
    assert isinstance(info.value, ValueError)
    with pytest.raises(StoreConfigError):
        TieredStore(StoreConfig(host_bytes=1 << 20, gpu_bytes=1 << 20, gpu_device="nosuchdevice"))
