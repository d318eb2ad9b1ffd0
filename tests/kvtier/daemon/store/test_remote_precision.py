"""Precision by tier on the remote tier (issue 25): ``RemoteOptions.codec`` re-encodes raw float KV
records as they are uploaded (write-through at commit, write-back at eviction), with the disk
demotion's re-encode; a second store that never saw the blocks fetches them, verified, and serves
them within the codec's error to requests that accept lossy copies, never to exact-only ones.

Real stores (shared-memory host tier, RocksDB + O_DIRECT disk tier), real records
(:func:`kvtier_protocol.block.encode_block`) and a real Redis Cluster on loopback (3 masters + 3
replicas of ``redis-server``, the fixture of ``test_remote_offer``).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch

from kvtier_protocol.block import decode_block
from kvtier_protocol.header import decode_header
from kvtier_protocol.layouts import to_canonical
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings
from kvtier.daemon.store import moves, remote_link, transfers
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.remote_link import RemoteOptions
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier
from tests.kvtier.daemon.store.storekit import Rec, put, read_block
from tests.kvtier.daemon.store.test_remote_offer import cluster  # noqa: F401  (the module's cluster fixture)
from tests.kvtier.daemon.store.test_store_precision import int8_bound, kv, kv_rec
from tests.kvtier.daemon.store.test_store_precision_policy import per_token_int8_bound

SHAPE = (2, 2, 4, 16, 32)  # canonical [L, 2, H, T, D] bfloat16: 16 KiB raw, about 8.5 KiB int8
MHA = Namespace(model="remote-precision", revision="r1", attention="mha", num_layers=2, num_kv_heads=4,
                head_dim=32, block_tokens=16, hash_tokens=16, kv_dtype="bfloat16")
MLA = Namespace(model="remote-precision-mla", revision="r1", attention="mla", num_layers=2, num_kv_heads=1,
                head_dim=64, head_dim_v=0, mla_rope_dim=8, block_tokens=16, hash_tokens=16, kv_dtype="bfloat16")


def _backend(url: str, prefix: str) -> RedisClusterBlocks:
    return RedisClusterBlocks(RedisClusterSettings(url, timeout_s=10.0, prefix=prefix))


def _config(tmp_path: Path, name: str, blocks: int) -> StoreConfig:
    size = 2 * 2 * 4 * 16 * 32 * 2
    # Segments of 2 blocks at most: records of other sizes get a segment of their own while
    # write-through pins the first ones.
    return StoreConfig(host_bytes=blocks * size, host_segment_bytes=min(blocks, 2) * size,
                       host_name_prefix=f"kvtier-rprec-{name}-{os.getpid()}", host_prefault=False, host_pin=False,
                       disk_path=str(tmp_path / name), disk_bytes=1 << 24)


async def _until(what: str, condition: Callable[[], Awaitable[bool] | bool], timeout_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds, or fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        got = condition()
        if await got if asyncio.iscoroutine(got) else got:
            return
        assert loop.time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)  # poll interval of the condition


async def _put(store: TieredStore, recs: list[Rec]) -> None:
    """Write and commit ``recs`` one at a time (each may evict the least recent host block)."""
    for r in recs:
        assert await put(store, [r]) == [True]


def _settled(store: TieredStore, uploaded: int) -> Callable[[], bool]:
    c = store.remote.counters
    return lambda: c.uploaded >= uploaded and c.queue_blocks == 0


@pytest.mark.parametrize("write_mode", ["through", "back"])
async def test_uploads_go_up_int8_and_a_store_that_never_saw_them_serves_them_lossy_only(
        cluster: str, tmp_path: Path, write_mode: str) -> None:  # noqa: F811
    prefix = "rprec" + secrets.token_hex(4)
    rng = random.Random(write_mode)
    xs = [kv(rng, SHAPE, torch.bfloat16) for _ in range(6)]
    recs = [kv_rec(i, x, ns=MHA.ns_id) for i, x in enumerate(xs)]
    hashes = [r.chain_hash for r in recs]
    keys = [RemoteKey.of("default", MHA.ns_id + h) for h in hashes]
    # Write-back uploads at eviction: a host tier of 2 blocks evicts the first four.
    # Write-through pins queued blocks, at most a quarter of the host tier: 32 blocks queue 8.
    a = TieredStore(_config(tmp_path, "a", 2 if write_mode == "back" else 32), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode=write_mode, codec="int8"))
    probe = _backend(cluster, prefix)
    await a.start()
    try:
        a.register_namespace(MHA)
        await _put(a, recs)
        up = 4 if write_mode == "back" else 6
        await _until("the uploads acknowledged", _settled(a, up))
        assert a.remote.counters.recoded == up and a.remote.counters.recoded_saved_bytes > 0
        values = await probe.get(keys[:up])
        for i, value in enumerate(values):
            assert value is not None
            h, y = decode_block(value)  # a whole record: its checksum verifies
            old, _ = decode_header(recs[i].header)
            assert (h.codec, h.layout, h.dtype, h.shape) == ("int8", "canonical", "bfloat16", SHAPE)
            assert (h.ns_id, h.chain_hash, h.parent_hash, h.num_tokens) == \
                (old.ns_id, old.chain_hash, old.parent_hash, old.num_tokens)  # same block, same key
            assert len(value) < len(recs[i].header) + len(recs[i].payload)  # what crosses the network shrank
            x = to_canonical(xs[i], "canonical")
            assert bool(((y.double() - x.double()).abs() <= int8_bound(x, mla=False, rope=0).double()).all())
        if write_mode == "through":  # the host copies stay exact
            acq = await a.acquire(MHA.ns_id, hashes, accept_lossy=False)
            try:
                assert [read_block(a, b) for b in acq.blocks] == [r.payload for r in recs]
            finally:
                a.release(acq.lease_id)
    finally:
        await a.close()

    # B never saw the namespace nor the blocks: it learns both from the cluster.
    b = TieredStore(_config(tmp_path, "b", 8), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="read-only"))
    await b.start()
    try:
        # Exact-only: the cluster's copies are lossy, so an exact-only request gets none of them.
        acq = await b.acquire(MHA.ns_id, hashes[:up], accept_lossy=False)
        assert acq.blocks == []
        b.release(acq.lease_id)
        assert b.remote.counters.bad_values == {}  # not refused as bad values: only not served
        acq = await b.acquire(MHA.ns_id, hashes[:up])  # the default accepts lossy copies
        try:
            assert [blk.chain_hash for blk in acq.blocks] == hashes[:up]
            for i, blk in enumerate(acq.blocks):
                h, y = decode_block(blk.header + read_block(b, blk))
                assert h.codec == "int8"  # never pretends to be raw
                x = to_canonical(xs[i], "canonical")
                assert bool(((y.double() - x.double()).abs() <= int8_bound(x, mla=False, rope=0).double()).all())
        finally:
            b.release(acq.lease_id)
        assert b.remote.counters.fetched_blocks == up and b.remote.counters.bad_values == {}
        assert b.lookup_names(MHA.ns_id, hashes[:up], accept_lossy=False) == (0, [])  # its host copies are lossy
        assert (await b.check()).ok
    finally:
        await b.close()
        await probe.close()


async def test_an_exact_only_lookup_counts_no_remote_block_where_the_tier_is_lossy(
        cluster: str, tmp_path: Path) -> None:  # noqa: F811
    prefix = "rprec" + secrets.token_hex(4)
    rng = random.Random(1)
    recs = [kv_rec(i, kv(rng, SHAPE, torch.bfloat16), ns=MHA.ns_id) for i in range(3)]
    hashes = [r.chain_hash for r in recs]
    a = TieredStore(_config(tmp_path, "a", 32), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="through", codec="int8"))
    await a.start()
    try:
        a.register_namespace(MHA)
        await _put(a, recs)
        await _until("the uploads acknowledged", _settled(a, 3))
    finally:
        await a.close()
    b = TieredStore(_config(tmp_path, "b", 8), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="read-only", codec="int8", lookup_budget_s=30.0))
    await b.start()  # a budget a loaded test machine meets: only the codec may make a lookup come short
    try:
        assert await b.lookup_remote(MHA.ns_id, hashes, accept_lossy=False) == (0, [])
        assert await b.lookup_remote(MHA.ns_id, hashes) == (3, ["remote"] * 3)
    finally:
        await b.close()


async def test_records_the_codec_cannot_take_go_up_as_they_are(cluster: str, tmp_path: Path) -> None:  # noqa: F811
    prefix = "rprec" + secrets.token_hex(4)
    rng = random.Random(5)
    nan = kv(rng, SHAPE, torch.bfloat16)
    nan[0, 1, 0, 3, 5] = float("nan")  # the quantizing codecs refuse NaN and Inf
    mla_x = kv(rng, (2, 16, 72), torch.bfloat16)
    recs = [kv_rec(0, nan, ns=MHA.ns_id),
            kv_rec(1, kv(rng, SHAPE, torch.bfloat16), ns=MHA.ns_id, codec="int4"),  # lossy already: kept
            kv_rec(2, mla_x, layout="mla-latent", ns=MLA.ns_id)]  # MLA, rope dims known: re-encoded, kept raw
    a = TieredStore(_config(tmp_path, "a", 32), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="through", codec="int8"))
    probe = _backend(cluster, prefix)
    await a.start()
    try:
        a.register_namespace(MLA)
        await _put(a, recs)
        await _until("the uploads acknowledged", _settled(a, 3))
        values = await probe.get([RemoteKey.of("default", r.ns_id + r.chain_hash) for r in recs])
        assert values[:2] == [r.header + r.payload for r in recs[:2]]
        assert a.remote.counters.recoded == 1
        h, y = decode_block(values[2])
        assert (h.codec, h.quant.rope_dims) == ("int8", 8)
        assert torch.equal(y[..., -8:], mla_x[..., -8:])  # rope dims stored raw
    finally:
        await a.close()
        await probe.close()


def test_the_remote_codec_takes_the_records_the_disk_codec_takes() -> None:
    assert remote_link.recode_choice is moves.recode_choice is transfers.recode_choice  # one rule
    with pytest.raises(ValueError, match="codec"):
        RemoteOptions(codec="int3")
    with pytest.raises(ValueError, match="compression"):
        RemoteOptions(codec="int8", compression="zstd")
    with pytest.raises(ValueError, match="k_axis"):
        RemoteOptions(codec="int8", k_axis="row")
    with pytest.raises(ValueError, match=r"models\['x\*'\]"):
        RemoteOptions(models={"x*": "int3"})
    assert RemoteOptions(models={"b*": "int8", "a*": "raw"}).models == (("b*", "int8"), ("a*", "raw"))


async def test_k_per_token_and_a_raw_model_on_the_remote_tier(cluster: str, tmp_path: Path) -> None:  # noqa: F811
    """``k_axis = "token"`` uploads MHA blocks with K per token (SPEC 5.3's size), which a store
    that never saw them fetches, verified, within int8's error; a model the ``models`` table keeps
    raw goes up exact, and an exact-only lookup counts it where it counts no re-encoded block."""
    prefix = "rprec" + secrets.token_hex(4)
    rng = random.Random(11)
    L, _, H, T, D = SHAPE
    xs = [kv(rng, SHAPE, torch.bfloat16) for _ in range(2)]
    mla_xs = [kv(rng, (2, 16, 72), torch.bfloat16) for _ in range(2)]
    recs = [kv_rec(i, x, ns=MHA.ns_id) for i, x in enumerate(xs)]
    mla_recs = [kv_rec(i, x, layout="mla-latent", ns=MLA.ns_id) for i, x in enumerate(mla_xs)]
    options = dict(codec="int8", k_axis="token", models={MLA.model: "raw"})
    a = TieredStore(_config(tmp_path, "a", 32), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="through", **options))
    probe = _backend(cluster, prefix)
    await a.start()
    try:
        a.register_namespace(MHA)
        a.register_namespace(MLA)
        await _put(a, recs + mla_recs)
        await _until("the uploads acknowledged", _settled(a, 4))
        assert a.remote.counters.recoded == 2  # the MHA blocks only
        values = await probe.get([RemoteKey.of("default", r.ns_id + r.chain_hash) for r in recs + mla_recs])
        assert values[2:] == [r.header + r.payload for r in mla_recs]  # the raw model: exact
        for x, value in zip(xs, values[:2]):
            h, y = decode_block(value)
            assert (h.codec, h.quant.k_axis, h.quant.k_group) == ("int8", "token", 0)
            # SPEC 5.3: codes, then float16 scales and mins of one pair per (head, token) per part
            assert h.payload_len == L * 2 * H * T * D + 2 * L * 2 * H * T * 2
            assert bool(((y.double() - x.double()).abs() <= per_token_int8_bound(x).double()).all())
    finally:
        await a.close()

    b = TieredStore(_config(tmp_path, "b", 8), remote=_backend(cluster, prefix),
                    remote_options=RemoteOptions(write_mode="read-only", lookup_budget_s=30.0, **options))
    await b.start()
    try:
        b.register_namespace(MLA)  # its model is known here: the table says raw
        hashes = [r.chain_hash for r in recs]
        assert await b.lookup_remote(MHA.ns_id, hashes, accept_lossy=False) == (0, [])
        assert await b.lookup_remote(MLA.ns_id, [r.chain_hash for r in mla_recs], accept_lossy=False) == \
            (2, ["remote"] * 2)
        acq = await b.acquire(MHA.ns_id, hashes)  # a store that never saw the blocks: verified, served lossy
        try:
            assert [blk.chain_hash for blk in acq.blocks] == hashes
            for x, blk in zip(xs, acq.blocks):
                h, y = decode_block(blk.header + read_block(b, blk))
                assert (h.codec, h.quant.k_axis) == ("int8", "token")
                assert bool(((y.double() - x.double()).abs() <= per_token_int8_bound(x).double()).all())
        finally:
            b.release(acq.lease_id)
        assert b.remote.counters.bad_values == {}
    finally:
        await b.close()
        await probe.close()


async def test_blocks_promoted_from_disk_go_up_re_encoded_where_the_cluster_lacks_them(
        cluster: str, tmp_path: Path) -> None:  # noqa: F811
    prefix = "rprec" + secrets.token_hex(4)
    rng = random.Random(9)
    recs = [kv_rec(i, kv(rng, SHAPE, torch.bfloat16), ns=MHA.ns_id) for i in range(3)]
    first = TieredStore(_config(tmp_path, "a", 32), remote=_backend(cluster, prefix),
                        remote_options=RemoteOptions(write_mode="read-only"))
    await first.start()
    try:
        first.register_namespace(MHA)
        await _put(first, recs)
    finally:
        await first.close()  # a clean close leaves them on disk, never uploaded
    store = TieredStore(_config(tmp_path, "a", 32), remote=_backend(cluster, prefix),
                        remote_options=RemoteOptions(write_mode="through", codec="int8"))
    probe = _backend(cluster, prefix)
    await store.start()
    try:
        assert [store.info(MHA.ns_id, r.chain_hash).tiers for r in recs] == [[Tier.DISK]] * 3
        acq = await store.acquire(MHA.ns_id, [r.chain_hash for r in recs])  # promoted: offer_missing
        store.release(acq.lease_id)
        await _until("the promoted blocks uploaded", lambda: store.remote.counters.uploaded == 3
                     and store.remote.counters.queue_blocks == 0 and not store.remote._tasks)
        values = await probe.get([RemoteKey.of("default", MHA.ns_id + r.chain_hash) for r in recs])
        assert all(v is not None and decode_header(v)[0].codec == "int8" for v in values)
        assert store.remote.counters.recoded == 3
    finally:
        await store.close()
        await probe.close()
