"""Precision by tier (issue 25): a demotion batch re-encoded for a lossy disk tier goes down in
chunks, each encoded while the one before is written (Mover._write_recoded). Real stores
(shared-memory host tier, RocksDB + O_DIRECT disk tier) and real records.
"""

from __future__ import annotations

import random

import torch

from kvtier_protocol.block import decode_block
from kvtier_protocol.header import decode_header

from kvtier.daemon.store import moves
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.store.storekit import NS, get, put
from tests.kvtier.daemon.store.test_store_precision import int8_bound, kv, kv_rec


async def test_chunked_reencoding_keeps_the_disk_within_its_capacity_and_every_block_exact_or_int8(open_store):
    """Batches of four blocks evict four host blocks at once (four chunks: several re-encoded
    records written before any is placed) into a disk that holds about five int8 records, so
    every chunk evicts older disk blocks first: the disk never goes over its capacity (the index
    asserts it), every block left on disk is an int8 record of its key within the codec's error,
    and the store's audit finds nothing wrong."""
    assert moves.RECODE_CHUNKS > 1, "the chunked path is what this test covers"
    rng = random.Random("chunks")
    xs = [kv(rng, (2, 2, 4, 16, 32), torch.bfloat16) for _ in range(24)]
    recs = [kv_rec(i, x) for i, x in enumerate(xs)]
    size = len(recs[0].payload)
    int8_record = len(kv_rec(0, xs[0], codec="int8").payload) + 4096  # a header, an aligned file
    store = await open_store(host_bytes=4 * size, host_segment_bytes=4 * size, disk_codec="int8",
                             disk_bytes=5 * int8_record + int8_record // 2)
    for i in range(0, len(recs), 4):
        assert await put(store, recs[i:i + 4]) == [True] * 4
    disk = store.gauges().tiers[Tier.DISK]
    assert 0 < disk.used_bytes <= disk.capacity_bytes and disk.blocks >= 3
    on_disk = [i for i, r in enumerate(recs) if store.info(NS, r.chain_hash) is not None
               and Tier.DISK in store.info(NS, r.chain_hash).tiers]
    assert len(on_disk) == disk.blocks
    for i in on_disk:
        h, y = decode_block(store.disk.get(make_key(NS, recs[i].chain_hash)))
        assert (h.codec, h.chain_hash) == ("int8", recs[i].chain_hash)
        err = (y.double() - xs[i].double()).abs()
        assert bool((err <= int8_bound(xs[i], mla=False, rope=0).double()).all())
    assert (await store.check()).ok
    # Served as stored: the int8 record (a read promotes it into host, which demotes others).
    (header, _), = await get(store, NS, [recs[on_disk[-1]].chain_hash])
    assert decode_header(header)[0].codec == "int8"
