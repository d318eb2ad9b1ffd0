"""transfers: verified snapshots (plain and into the disk tier's aligned buffers) and disk loads
straight into slot-like buffers, with every outcome on a real disk tier."""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import pytest

from kvtier_protocol.block import encode_block
from kvtier_protocol.header import decode_header, payload_checksum, split_record

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_io import ALIGN, BufferPool, is_aligned
from kvtier.daemon.store.config import tier_quant
from kvtier.daemon.store.transfers import load_records, recode_verified, snapshot_verified
from kvtier.daemon.store.types import make_key
from tests.kvtier.daemon.store.storekit import NS, make_rec


def _slot(n: int) -> memoryview:
    """A page-aligned view as a host slot is."""
    return memoryview(mmap.mmap(-1, max(n, 1)))[:n]


@pytest.mark.parametrize("pool", [None, BufferPool()])
def test_snapshot_verified_copies_and_checks_the_copy(pool: BufferPool | None) -> None:
    recs = [make_rec(i, nbytes=3 * ALIGN + 64) for i in range(3)]
    views = [_slot(len(r.payload)) for r in recs]
    for v, r in zip(views, recs):
        v[:] = r.payload
    sums = [payload_checksum(r.payload) for r in recs]
    sums[1] ^= 1  # the client lied about block 1 (or its slot was damaged)
    got = snapshot_verified(views, sums, pool)
    assert got[1] is None and bytes(got[0]) == recs[0].payload and bytes(got[2]) == recs[2].payload
    views[0][:10] = b"\0" * 10  # the copy is independent of the slot
    assert bytes(got[0]) == recs[0].payload
    if pool is None:
        assert all(isinstance(g, bytes) for g in (got[0], got[2]))
    else:
        assert is_aligned(got[0]) and is_aligned(got[2])


@pytest.fixture
def disk(tmp_path: Path):
    d = DiskTier(tmp_path / "db", 1 << 30)
    yield d
    d.close()


def test_load_records_reads_into_slots_and_tells_every_outcome(disk: DiskTier) -> None:
    recs = [make_rec(i, nbytes=2 * ALIGN + 128) for i in range(4)]
    keys = [make_key(NS, r.chain_hash) for r in recs]
    disk.put_many([(k, r.header, r.payload) for k, r in zip(keys, recs)])
    payload = Path(disk.file_path(keys[1]))
    with open(payload, "r+b") as f:  # block 1: a payload byte flipped in its file
        f.seek(ALIGN + 5)
        byte = f.read(1)
        f.seek(ALIGN + 5)
        f.write(bytes([byte[0] ^ 1]))
    disk.delete_many([keys[2]])  # block 2: gone
    headers = [r.header for r in recs]
    headers[3] = recs[0].header  # block 3: the index committed another block under its key
    slots = [_slot(len(r.payload)) for r in recs]
    assert load_records(disk, keys, headers, slots) == ["ok", "corrupt", "missing", "corrupt"]
    assert bytes(slots[0]) == recs[0].payload


def _raw_block(x) -> tuple[bytes, memoryview, int]:
    """A raw canonical record of tensor ``x``: (header, a slot-like view of its payload, checksum)."""
    rec = encode_block(x, ns_id=NS, chain_hash=bytes(range(32)), parent_hash=None, layout="canonical", codec="raw")
    h, payload = split_record(rec)
    view = _slot(h.payload_len)
    view[:] = payload
    return bytes(rec[:len(rec) - h.payload_len]), view, h.checksum


@pytest.mark.parametrize("compression", [None, "lz4"])
def test_recode_verified_writes_encode_blocks_record_into_pool_buffers(compression: str | None) -> None:
    """Each re-encoded record is the protocol encoder's, byte for byte, its payload a buffer of the
    pool whose checksum is the header's; a lying checksum gives None; a NaN block goes down raw
    (its verified copy); a block whose scales fall back to float32 leaves no buffer taken but its own."""
    import torch

    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(2, 2, 2, 16, 64, generator=gen).to(torch.bfloat16) for _ in range(4)]
    xs[2][0, 1, 0, 3, 3] = math.nan
    xs[3][1, 0, 1, 2, 5] = -70000.0  # a K minimum float16 cannot hold
    blocks = [_raw_block(x) for x in xs]
    items = [(hd, view, cs ^ (i == 1), 0, "int8") for i, (hd, view, cs) in enumerate(blocks)]

    class CountingPool(BufferPool):  # the real pool, counting what is out
        out = 0

        def get(self, nbytes: int) -> memoryview:
            self.out += 1
            return super().get(nbytes)

        def give_back(self, view: memoryview) -> None:
            self.out -= 1
            super().give_back(view)

    pool = CountingPool()
    got = recode_verified(items, "channel", compression, pool)
    assert got[1] is None and pool.out == 3
    for i in (0, 3):
        want = encode_block(xs[i], ns_id=NS, chain_hash=bytes(range(32)), parent_hash=None, layout="canonical",
                            codec="int8", quant=tier_quant("int8", "channel", mla=False), num_tokens=16,
                            compression=compression)
        assert got[i].lossy and got[i].header + bytes(got[i].payload) == want
        assert isinstance(got[i].payload.obj, mmap.mmap) and payload_checksum(got[i].payload) == got[i].checksum
    assert decode_header(got[3].header)[0].quant.scale_dtype == "float32"
    assert not got[2].lossy and got[2].header == blocks[2][0] and bytes(got[2].payload) == bytes(blocks[2][1])
    blocks[0][1][:8] = b"\xff" * 8  # the host slot written after the re-encode: the record is a copy
    again = recode_verified(items[:1], "channel", compression, pool)[0]
    assert again is None  # the slot no longer matches its checksum: nothing is made of it
