"""transfers: verified snapshots (plain and into the disk tier's aligned buffers) and disk loads
straight into slot-like buffers, with every outcome on a real disk tier."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest

from kvtier_protocol.header import payload_checksum

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_io import ALIGN, BufferPool, is_aligned
from kvtier.daemon.store.transfers import load_records, snapshot_verified
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
