"""Helpers of the TieredStore tests: real block records, put/get round trips, a manual clock.

Records are built with the real header module (encode_header + payload_checksum). GPU slots are
written and read through the store's GpuTier (a CPU pool in these tests, CUDA where one exists).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

from kvtier.daemon.store.results import AcquiredBlock
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Slot, Tier

NS = bytes(range(16))
BLOCK = 4096  # payload bytes of a test block: canonical [1, 2, 1, 16, 64] float16


def chain(i: int, ns: bytes = NS) -> bytes:
    """A deterministic 32-byte chain hash."""
    return hashlib.sha256(ns + i.to_bytes(8, "little")).digest()


@dataclass(frozen=True, slots=True)
class Rec:
    """One test block: its key parts, encoded header and payload."""

    ns_id: bytes
    chain_hash: bytes
    header: bytes
    payload: bytes


def make_rec(i: int, *, ns: bytes = NS, nbytes: int = BLOCK, seed: int | None = None) -> Rec:
    """Block ``i`` of a chain, with a payload drawn from ``seed`` (default: ``i``)."""
    assert nbytes % 64 == 0, "test payloads are [1, 2, 1, 16, nbytes/64] float16"
    payload = random.Random(i if seed is None else seed).randbytes(nbytes)
    h = BlockHeader(ns_id=ns, chain_hash=chain(i, ns), parent_hash=chain(i - 1, ns) if i else None,
                    num_tokens=16, layout="canonical", shape=(1, 2, 1, 16, nbytes // 64), dtype="float16",
                    codec="raw", sections=(Section("payload", 0, nbytes),), payload_len=nbytes,
                    checksum=payload_checksum(payload))
    return Rec(ns, h.chain_hash, encode_header(h), payload)


def write_slot(store: TieredStore, tier: Tier, slot: Slot, payload: bytes) -> None:
    """Write a payload into a reserved host or GPU slot (and wait for a device copy)."""
    if tier is Tier.HOST:
        store.host.view(slot)[:] = payload
        return
    import torch

    store.gpu.copy_in(slot, torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    if store.gpu.device.type == "cuda":
        torch.cuda.synchronize(store.gpu.device)


def read_slot(store: TieredStore, tier: Tier, slot: Slot) -> bytes:
    """The bytes of a host or GPU slot."""
    if tier is Tier.HOST:
        return bytes(store.host.view(slot))
    return bytes(store.gpu.tensor(slot).cpu().numpy())


def read_block(store: TieredStore, block: AcquiredBlock) -> bytes:
    """The payload of an acquired block, from the pool it is served from."""
    return read_slot(store, block.pool, block.slot)


async def put(store: TieredStore, recs: list[Rec], tier: Tier = Tier.HOST) -> list[bool]:
    """reserve → write into the slots → commit; returns commit's answer."""
    if not recs:
        return []
    res = await store.reserve(recs[0].ns_id, [r.chain_hash for r in recs], [len(r.payload) for r in recs], tier=tier)
    if res.lease_id == 0:
        return [False] * len(recs)
    assert res.tier is tier
    for rec, slot in zip(recs, res.slots):
        if slot is not None:
            write_slot(store, tier, slot, rec.payload)
    return await store.commit(res.lease_id, [r.header for r in recs])


async def get(store: TieredStore, ns: bytes, hashes: list[bytes], tier: Tier = Tier.HOST) -> list[tuple[bytes, bytes]]:
    """acquire → copy out → release; returns (header, payload) of the prefix found."""
    acq = await store.acquire(ns, hashes, tier=tier)
    out = [(b.header, read_block(store, b)) for b in acq.blocks]
    if acq.lease_id:
        assert store.release(acq.lease_id)
    return out


class Clock:
    """A manual clock for leases."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t
