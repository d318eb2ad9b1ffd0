"""The blocks of `kvtier bench store`: keys, headers, random payloads, and the store's own put and
get loops over them (reserve → copy into the slot → commit; acquire → copy out → release)."""

from __future__ import annotations

import hashlib

import torch

from kvtier.client import memcopy
from kvtier.daemon.store.store import TieredStore
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench store").digest()[:16]


def chain_hash(i: int) -> bytes:
    """The chain hash of block ``i`` (fixed, so every run stores the same keys)."""
    return hashlib.sha256(NS + i.to_bytes(8, "little")).digest()


def block_header(i: int, payload: memoryview | bytes) -> bytes:
    """The encoded header of block ``i`` over ``payload`` (a raw float16 block)."""
    n = len(payload)
    h = BlockHeader(ns_id=NS, chain_hash=chain_hash(i), parent_hash=chain_hash(i - 1) if i else None, num_tokens=16,
                    layout="canonical", shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return encode_header(h)


def random_blocks(count: int, nbytes: int, seed: int) -> list[torch.Tensor]:
    """``count`` payloads of ``nbytes`` random bytes (seeded)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen) for _ in range(count)]


def batches(n: int, per: int) -> list[range]:
    """``range(n)`` cut into ranges of ``per``."""
    return [range(i, min(n, i + per)) for i in range(0, n, per)]


async def put_blocks(store: TieredStore, hashes: list[bytes], headers: list[bytes], srcs: list[memoryview],
                     per: int, threads: int) -> None:
    """Store every block through the host tier, ``per`` blocks a reservation, each batch copied
    as kvtier's client copies it (views first, then one ``copy_many_threads`` on ``threads``:
    Python run between multi-MiB copies runs on emptied caches at ~3x its warm cost)."""
    assert store.host is not None
    for r in batches(len(hashes), per):
        res = await store.reserve(NS, hashes[r.start:r.stop], [srcs[i].nbytes for i in r])
        if any(slot is None for slot in res.slots):
            raise RuntimeError("the bench's host tier is too small for its working set")
        memcopy.copy_many_threads([store.host.view(slot) for slot in res.slots], srcs[r.start:r.stop], threads)
        await store.commit(res.lease_id, headers[r.start:r.stop])


async def get_blocks(store: TieredStore, hashes: list[bytes], dsts: list[memoryview], per: int, threads: int) -> int:
    """Copy every stored block out of its host slot into ``dsts`` (as in :func:`put_blocks`);
    how many were found."""
    assert store.host is not None
    got = 0
    for r in batches(len(hashes), per):
        acq = await store.acquire(NS, hashes[r.start:r.stop])
        memcopy.copy_many_threads(dsts[r.start:r.start + len(acq.blocks)],
                                  [store.host.view(block.slot) for block in acq.blocks], threads)
        got += len(acq.blocks)
        if acq.lease_id:
            store.release(acq.lease_id)
    return got
