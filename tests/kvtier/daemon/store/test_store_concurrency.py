"""Many concurrent callers on tiny tiers: every move races every other operation, and still no
copy fails its checksum and no reader sees another block's bytes.

Eight tasks put (reserve/commit, with a yield inside the copy), put through grants, read (with a
yield while the lease is held) and delete prefixes of mixed block sizes on a host tier of a few
dozen blocks above a disk tier of twice that, so that blocks are evicted, written down, promoted
and scrubbed while other operations run. A soak once counted two checksum failures: the commit
scrubber hashed a host copy that a promotion was still filling.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

from kvtier.daemon.store.types import Tier

from tests.kvtier.daemon.store.storekit import NS, chain

KIB = 1024
SIZES = tuple(n * KIB for n in (64, 96, 128, 192, 256))
PREFIXES, BLOCKS, TASKS, OPS = 60, 4, 8, 120


def _block(p: int, j: int) -> tuple[bytes, bytes, bytes]:
    size = SIZES[(p * 7 + j) % len(SIZES)]
    payload = random.Random(p * 100 + j).randbytes(size)
    h = BlockHeader(ns_id=NS, chain_hash=chain(p * 100 + j), parent_hash=chain(p * 100 + j - 1) if j else None,
                    num_tokens=16, layout="canonical", shape=(1, 2, 1, 16, size // 64), dtype="float16",
                    codec="raw", sections=(Section("payload", 0, size),), payload_len=size,
                    checksum=payload_checksum(payload))
    return h.chain_hash, encode_header(h), payload


BLOCKS_OF = {p: [_block(p, j) for j in range(BLOCKS)] for p in range(PREFIXES)}


async def _caller(store, rng: random.Random, wrong: list[str]) -> None:
    for _ in range(OPS):
        p = rng.randrange(PREFIXES)
        blocks = BLOCKS_OF[p]
        keys, headers = [b[0] for b in blocks], [b[1] for b in blocks]
        op = rng.choices(["reserve", "grant", "read", "delete"], [4, 3, 5, 1])[0]
        if op == "reserve":
            res = await store.reserve(NS, keys, [len(b[2]) for b in blocks])
            if res.lease_id:
                for (_, _, payload), slot in zip(blocks, res.slots):
                    if slot is not None:
                        view, half = store.host.view(slot), len(payload) // 2
                        view[:half] = payload[:half]
                        await asyncio.sleep(0)  # others run while this copy is half done
                        view[half:] = payload[half:]
                await store.commit(res.lease_id, headers)
        elif op == "grant":
            res = await store.grant([len(b[2]) for b in blocks])
            if res.lease_id:
                n = next((i for i, s in enumerate(res.slots) if s is None), len(blocks))
                for (_, _, payload), slot in zip(blocks[:n], res.slots):
                    store.host.view(slot)[:] = payload
                await asyncio.sleep(0)
                if n:
                    await store.place(res.lease_id, NS, keys[:n], list(range(n)), headers[:n])
                store.release(res.lease_id)
        elif op == "read":
            acq = await store.acquire(NS, keys)
            await asyncio.sleep(0)  # the lease is held across other operations
            for block, (_, header, payload) in zip(acq.blocks, blocks):
                if block.header != header or bytes(store.host.view(block.slot)) != payload:
                    wrong.append(f"prefix {p}: block {block.chain_hash.hex()[:16]} read other bytes")
            if acq.lease_id:
                store.release(acq.lease_id)
        else:
            await store.delete(NS, keys)


@pytest.mark.parametrize("seed", [0, 1])
async def test_concurrent_callers_on_tiny_tiers_never_see_a_bad_copy(open_store, seed: int) -> None:
    store = await open_store(host_bytes=4 << 20, host_segment_bytes=4 << 20, disk_bytes=8 << 20)
    wrong: list[str] = []
    await asyncio.gather(*(_caller(store, random.Random(seed * 31 + i), wrong) for i in range(TASKS)))
    await store.drain_scrub()
    c = store.counters
    assert wrong == []
    assert c.checksum_failures == 0
    assert c.promotions > 0 and c.tiers[Tier.HOST].evictions > 0  # the moves did race
    assert store.index.accounting_errors() == []
