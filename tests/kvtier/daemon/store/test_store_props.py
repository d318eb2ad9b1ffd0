"""Random operation sequences against simple reference models.

* Without a disk tier and with one block size, the store must evict exactly like a list-based
  LRU with priority classes.
* With a GPU tier (on a CPU pool) in front of a roomy host tier, GPU evictions must follow an LRU
  model and every evicted block must land in host memory.
* With write-through, mixed sizes, leases that expire, pending reservations and deletes, it must
  never exceed a capacity, keep its byte accounting exact, never serve bytes other than those
  committed, and find every acknowledged block again (also after close and reopen).
* The same with a GPU tier and write-back: capacities (GPU included) and accounting hold, served
  bytes are the committed ones, and every block findable at a clean close is found after reopen.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.index import TIERS
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import BLOCK, NS, Clock, make_rec, put, read_block

CAP = 6  # host blocks in the LRU model
N = 12  # distinct blocks in the sequences
RECS = [make_rec(i) for i in range(N)]
INDEX_OF = {make_key(NS, r.chain_hash): i for i, r in enumerate(RECS)}


def _config(tmp: str | None, **kw: object) -> StoreConfig:
    return StoreConfig(host_prefault=False, host_pin=False, host_name_prefix=f"kvtier-prop-{os.getpid()}",
                       disk_path=os.path.join(tmp, "disk") if tmp else None, **kw)


# --- exact eviction order -------------------------------------------------------------------------

# Puts weigh triple and sequences are long enough that the tier fills and evicts in most examples.
_LRU_OPS = st.lists(st.tuples(st.sampled_from(["put"] * 3 + ["get", "touch", "delete", "pin"]),
                              st.integers(0, N - 1), st.integers(0, 2)), min_size=15, max_size=50)


@settings(max_examples=40, deadline=None)
@given(_LRU_OPS)
def test_eviction_matches_a_priority_lru_model(ops):
    asyncio.run(_lru_scenario(ops))


async def _lru_scenario(ops: list[tuple[str, int, int]]) -> None:
    model: list[list[int]] = [[], [], []]  # per priority class, least recent first
    prio: dict[int, int] = {}

    def to_mru(i: int, p: int) -> None:
        if i in prio:
            model[prio[i]].remove(i)
        model[p].append(i)
        prio[i] = p

    cfg = _config(None, host_bytes=CAP * BLOCK, host_segment_bytes=CAP * BLOCK, priority_classes=3)
    async with TieredStore(cfg) as store:
        for op, i, p in ops:
            rec, was = RECS[i], i in prio
            if op == "put":
                if not was and len(prio) == CAP:
                    victim = next(v for cls in model for v in cls)
                    model[prio.pop(victim)].remove(victim)
                to_mru(i, prio.get(i, 0))
                assert await put(store, [rec]) == [not was]  # a stored block is reported, not rewritten
            elif op == "get":
                acq = await store.acquire(NS, [rec.chain_hash])
                assert len(acq.blocks) == was
                if was:
                    assert bytes(store.host.view(acq.blocks[0].slot)) == rec.payload
                    store.release(acq.lease_id)
                    to_mru(i, prio[i])
            elif op == "touch":
                assert store.touch(NS, [rec.chain_hash]) == was
                if was:
                    to_mru(i, prio[i])
            elif op == "delete":
                assert await store.delete(NS, [rec.chain_hash]) == was
                if was:
                    model[prio.pop(i)].remove(i)
            else:
                assert store.pin(NS, [rec.chain_hash], p) == was
                if was:
                    to_mru(i, p)
            order = [INDEX_OF[m.key] for m in store.index.victims(Tier.HOST)]
            assert order == [v for cls in model for v in cls]


# --- GPU eviction order -----------------------------------------------------------------------

GPU_CAP = 3
_GPU_OPS = st.lists(st.tuples(st.sampled_from(["put"] * 3 + ["get_gpu", "get_host", "touch", "delete"]),
                              st.integers(0, N - 1)), min_size=15, max_size=50)


@settings(max_examples=40, deadline=None)
@given(_GPU_OPS)
def test_gpu_eviction_matches_an_lru_model_and_demotes_into_host(ops):
    asyncio.run(_gpu_lru_scenario(ops))


async def _gpu_lru_scenario(ops: list[tuple[str, int]]) -> None:
    gpu: list[int] = []  # GPU residents, least recent first
    host: set[int] = set()  # blocks with a host copy (the host tier holds all N: it never evicts)
    stored: set[int] = set()

    def to_mru(i: int) -> None:
        if i in gpu:
            gpu.remove(i)
            gpu.append(i)

    cfg = _config(None, host_bytes=N * BLOCK, host_segment_bytes=N * BLOCK, gpu_bytes=GPU_CAP * BLOCK,
                  gpu_device="cpu")
    async with TieredStore(cfg) as store:
        for op, i in ops:
            rec, was = RECS[i], i in stored
            if op == "put":
                assert await put(store, [rec], Tier.GPU) == [not was]
                if not was:
                    if len(gpu) == GPU_CAP:
                        host.add(gpu.pop(0))  # demoted
                    gpu.append(i)
                    stored.add(i)
                to_mru(i)
            elif op in ("get_gpu", "get_host"):
                tier = Tier.GPU if op == "get_gpu" else Tier.HOST
                acq = await store.acquire(NS, [rec.chain_hash], tier=tier)
                assert len(acq.blocks) == was
                if was:
                    in_place = tier is Tier.GPU and i in gpu
                    assert acq.blocks[0].pool is (Tier.GPU if in_place else Tier.HOST)
                    assert read_block(store, acq.blocks[0]) == rec.payload
                    store.release(acq.lease_id)
                    if not in_place:
                        host.add(i)  # copied down (or already there)
                    to_mru(i)
            elif op == "touch":
                assert store.touch(NS, [rec.chain_hash]) == was
                to_mru(i)
            else:
                assert await store.delete(NS, [rec.chain_hash]) == was
                stored.discard(i)
                host.discard(i)
                if i in gpu:
                    gpu.remove(i)
            assert [INDEX_OF[m.key] for m in store.index.victims(Tier.GPU)] == gpu
            assert {INDEX_OF[m.key] for m in store.index.blocks() if m.host_slot is not None} == host
            assert {INDEX_OF[m.key] for m in store.index.blocks()} == stored
            assert store.index.accounting_errors() == []


# --- capacity, accounting, integrity, durability -----------------------------------------------

_OPS = st.lists(st.one_of(
    st.tuples(st.just("put"), st.lists(st.integers(0, N - 1), min_size=1, max_size=4, unique=True)),
    st.tuples(st.just("get"), st.lists(st.integers(0, N - 1), min_size=1, max_size=4, unique=True)),
    st.tuples(st.just("hold"), st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("reserve"), st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, N - 1), min_size=1, max_size=2, unique=True)),
    st.tuples(st.just("tick"), st.just([])),
), min_size=8, max_size=30)

SIZES = [BLOCK, 2 * BLOCK, 3 * BLOCK]
MIXED = [make_rec(i, nbytes=SIZES[i % 3]) for i in range(N)]


@settings(max_examples=20, deadline=None)
@given(_OPS)
def test_random_operations_keep_capacity_accounting_and_data(ops):
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_invariant_scenario(ops, tmp))


async def _invariant_scenario(ops: list[tuple[str, list[int]]], tmp: str) -> None:
    clock = Clock()
    cfg = _config(tmp, host_bytes=8 * BLOCK, host_segment_bytes=8 * BLOCK, disk_bytes=1 << 24,
                  write_through=True, lease_seconds=3.0)
    acked: dict[int, bytes] = {}  # the reference model: acknowledged, not deleted
    async with TieredStore(cfg, now=clock) as store:
        for op, idx in ops:
            recs = [MIXED[i] for i in idx]
            hs = [r.chain_hash for r in recs]
            if op == "put":
                for i, ok in zip(idx, await put(store, recs)):
                    if ok:
                        acked[i] = MIXED[i].payload
            elif op in ("get", "hold"):
                acq = await store.acquire(NS, hs)
                for i, block in zip(idx, acq.blocks):
                    assert bytes(store.host.view(block.slot)) == acked[i], "served bytes differ"
                    assert block.header == MIXED[i].header
                if acq.lease_id and op == "get":
                    store.release(acq.lease_id)
            elif op == "reserve":
                await store.reserve(NS, hs, [len(r.payload) for r in recs])  # never committed: expires
            elif op == "delete":
                await store.delete(NS, hs)
                for i in idx:
                    acked.pop(i, None)
            else:
                clock.t += 2.0
            _check_invariants(store, acked)
        await store.check()  # the audit agrees
    async with TieredStore(cfg, now=clock) as reopened:
        for i, payload in acked.items():
            info = reopened.info(NS, MIXED[i].chain_hash)
            assert info is not None and info.header == MIXED[i].header and Tier.DISK in info.tiers
        assert (await reopened.check()).ok


def _check_invariants(store: TieredStore, acked: dict[int, bytes]) -> None:
    index = store.index
    for tier in TIERS:
        assert index.used[tier] <= index.capacity[tier]
    assert index.accounting_errors(store.mover.zombies) == []
    assert store.host.allocated_bytes <= store.host.capacity
    for i in range(N):  # write-through with a roomy disk: acknowledged == findable
        assert (store.lookup(NS, [MIXED[i].chain_hash]).num_hits == 1) == (i in acked)


_GPU_MIXED_OPS = st.lists(st.one_of(
    st.tuples(st.sampled_from(["put", "put_gpu", "put_gpu", "get", "get_gpu", "hold", "reserve_gpu"]),
              st.lists(st.integers(0, N - 1), min_size=1, max_size=3, unique=True)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, N - 1), min_size=1, max_size=2, unique=True)),
    st.tuples(st.just("tick"), st.just([])),
), min_size=8, max_size=30)


@settings(max_examples=20, deadline=None)
@given(_GPU_MIXED_OPS)
def test_random_operations_with_a_gpu_tier_keep_capacity_data_and_persist_at_close(ops):
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(_gpu_invariant_scenario(ops, tmp))


async def _gpu_invariant_scenario(ops: list[tuple[str, list[int]]], tmp: str) -> None:
    clock = Clock()
    cfg = _config(tmp, host_bytes=8 * BLOCK, host_segment_bytes=8 * BLOCK, gpu_bytes=6 * BLOCK,
                  gpu_device="cpu", disk_bytes=1 << 24, lease_seconds=3.0)
    acked: set[int] = set()  # the reference model: acknowledged, not deleted (write-back may still drop)
    async with TieredStore(cfg, now=clock) as store:
        for op, idx in ops:
            recs = [MIXED[i] for i in idx]
            hs = [r.chain_hash for r in recs]
            tier = Tier.GPU if op.endswith("_gpu") else Tier.HOST
            if op in ("put", "put_gpu"):
                acked.update(i for i, ok in zip(idx, await put(store, recs, tier)) if ok)
            elif op in ("get", "get_gpu", "hold"):
                acq = await store.acquire(NS, hs, tier=tier)
                for i, block in zip(idx, acq.blocks):
                    assert i in acked and read_block(store, block) == MIXED[i].payload, "served bytes differ"
                    assert block.header == MIXED[i].header
                if acq.lease_id and op != "hold":
                    store.release(acq.lease_id)
            elif op == "reserve_gpu":
                await store.reserve(NS, hs, [len(r.payload) for r in recs], tier=Tier.GPU)  # expires
            elif op == "delete":
                await store.delete(NS, hs)
                acked.difference_update(idx)
            else:
                clock.t += 2.0
            _check_gpu_invariants(store, acked)
        assert (await store.check()).ok
        at_close = {i for i in range(N) if store.lookup(NS, [MIXED[i].chain_hash]).num_hits}
    async with TieredStore(dataclasses.replace(cfg, gpu_bytes=0), now=clock) as reopened:
        for i in range(N):
            info = reopened.info(NS, MIXED[i].chain_hash)
            assert (info is not None) == (i in at_close), "a block findable at close was not persisted"
            if info is not None:
                assert info.header == MIXED[i].header and info.tiers == [Tier.DISK]
        assert (await reopened.check()).ok


def _check_gpu_invariants(store: TieredStore, acked: set[int]) -> None:
    index = store.index
    for tier in TIERS:
        assert index.used[tier] <= index.capacity[tier]
    assert index.accounting_errors(store.mover.zombies) == []
    assert store.host.allocated_bytes <= store.host.capacity and store.gpu.allocated_bytes <= store.gpu.capacity
    assert index.capacity[Tier.GPU] == 6 * BLOCK
    for i in range(N):
        if store.lookup(NS, [MIXED[i].chain_hash]).num_hits:
            assert i in acked
