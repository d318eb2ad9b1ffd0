"""Damaged disk-tier metadata: detected at open, moved aside, rebuilt from the block files; the
offline check; the free list that tells free files from lost entries.

Each damage is made on real RocksDB files on disk after a clean close: one byte flipped in the
largest table, a table truncated or deleted, the MANIFEST truncated, CURRENT deleted. Before the
repair, the flip served part of the records silently and the others refused to open.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_check import check_tier, tier_paths
from kvtier.daemon.store.disk_io import align_up
from kvtier.daemon.store.types import make_key
from tests.kvtier.daemon.store.storekit import Rec, make_rec

N = 300
DAMAGES = ("flip-largest-sst", "truncate-sst", "delete-sst", "truncate-manifest", "delete-current")


def _key(r: Rec) -> bytes:
    return make_key(r.ns_id, r.chain_hash)


def _fill(path: Path, n: int = N, deleted: int = 10) -> list[Rec]:
    """A tier of ``n`` records written in batches, the first ``deleted`` then deleted (their files
    stay free), closed cleanly. Returns the records still stored."""
    recs = [make_rec(i) for i in range(n)]
    with DiskTier(path, 1 << 30) as d:
        for lo in range(0, n, 50):
            d.put_many([(_key(r), r.header, r.payload) for r in recs[lo:lo + 50]])
        d.delete_many([_key(r) for r in recs[:deleted]])
        d.flush()
    return recs[deleted:]


def damage(tier: Path, kind: str) -> None:
    """Damage the RocksDB metadata of a closed disk tier in place."""
    meta = tier / "meta"
    tables = sorted(meta.glob("*.sst"), key=lambda p: p.stat().st_size)
    assert tables or kind in ("truncate-manifest", "delete-current"), "the metadata has a table to damage"
    if kind == "flip-largest-sst":
        data = bytearray(tables[-1].read_bytes())
        data[len(data) // 3] ^= 0xFF
        tables[-1].write_bytes(data)
    elif kind == "truncate-sst":
        os.truncate(tables[-1], tables[-1].stat().st_size // 2)
    elif kind == "delete-sst":
        tables[-1].unlink()
    elif kind == "truncate-manifest":
        manifest = meta / (meta / "CURRENT").read_text().strip()
        os.truncate(manifest, manifest.stat().st_size // 2)
    elif kind == "delete-current":
        (meta / "CURRENT").unlink()
    else:
        raise AssertionError(kind)


def _served(d: DiskTier, recs: list[Rec]) -> int:
    return sum(d.get(_key(r)) == r.header + r.payload for r in recs)


@pytest.mark.parametrize("kind", DAMAGES)
def test_damaged_metadata_is_moved_aside_and_rebuilt_from_the_block_files(tmp_path: Path, kind: str) -> None:
    tier = tmp_path / "disk"
    recs = _fill(tier)
    damage(tier, kind)
    with DiskTier(tier, 1 << 30) as d:
        assert d.repair is not None, "the damage was detected"
        assert _served(d, recs) == len(recs) and d.num_records == len(recs)
        assert d.repair.adopted == len(recs) and d.repair.skipped == 10, "the free files stay free"
        moved = Path(d.repair.moved_to)
        assert moved.parent == tier and moved.name.startswith("meta.damaged-") and moved.is_dir()
        assert d.unlisted() == []
    with DiskTier(tier, 1 << 30) as d:  # the rebuilt metadata is sound, and stays so
        assert d.repair is None and _served(d, recs) == len(recs)


def test_a_clean_tier_is_not_rebuilt_and_keeps_its_free_files_free(tmp_path: Path) -> None:
    tier = tmp_path / "disk"
    recs = _fill(tier)
    assert (tier / "free-ids").exists()
    with DiskTier(tier, 1 << 30) as d:
        assert d.repair is None and d.num_records == len(recs)
        assert not (tier / "free-ids").exists(), "the free list describes one close only"
        assert d.free_files()[0] == 10
    assert not list(tier.glob("meta.damaged-*"))


def test_entries_lost_silently_are_found_by_counting_files_against_the_free_list(tmp_path: Path) -> None:
    """RocksDB recovers without an error but without some entries (here: deleted behind the tier's
    back): the files no entry lists and the free list does not name show it."""
    tier = tmp_path / "disk"
    recs = _fill(tier)
    from rocksdict import Options, Rdict

    db = Rdict(str(tier / "meta"), Options(raw_mode=True), column_families={"blocks": Options(raw_mode=True)})
    blocks = db.get_column_family("blocks")
    for r in recs[:40]:
        del blocks[_key(r)]
    blocks.close()
    db.close()
    with DiskTier(tier, 1 << 30) as d:
        assert d.repair is not None and "40 block files" in d.repair.reason
        assert _served(d, recs) == len(recs)


def test_unlisted_files_are_found_and_adopted_while_open(tmp_path: Path) -> None:
    """A valid block file that appears behind the open tier (neither listed nor free) is found by
    ``unlisted`` and listed again by ``adopt``; one of a key listed already becomes free."""
    recs = [make_rec(i) for i in range(3)]
    with DiskTier(tmp_path / "src", 1 << 30) as src:
        src.put_many([(_key(r), r.header, r.payload) for r in recs])
        files = [Path(src.file_path(_key(r))).read_bytes() for r in recs]
    with DiskTier(tmp_path / "disk", 1 << 30) as d:
        d.put_many([(_key(recs[0]), recs[0].header, recs[0].payload)])
        root = Path(d.file_path(_key(recs[0]))).parent.parent
        for fid, data in ((0x300, files[0]), (0x301, files[1]), (0x402, files[2])):
            (root / f"{fid & 0xFF:02x}" / f"{fid:016x}").write_bytes(data)
        found = d.unlisted()
        assert sorted(f.key for f in found) == sorted([_key(recs[0]), _key(recs[1]), _key(recs[2])])
        assert sorted(d.adopt(found)) == sorted([_key(recs[1]), _key(recs[2])])
        assert _served(d, recs) == 3 and d.num_records == 3 and d.unlisted() == []
        assert d.free_files()[0] == 1, "the second file of a listed key is free"


def test_a_file_waiting_for_its_unlink_is_not_unlisted(tmp_path: Path) -> None:
    """A deleted record's file trimmed beyond the free-file cap waits for the reaper thread to
    unlink it, still holding its record: ``unlisted`` waits for pending unlinks rather than
    report it (an audit under load reported blocks deleted a moment before as orphans)."""
    import threading

    recs = [make_rec(i) for i in range(2)]
    with DiskTier(tmp_path / "disk", 1 << 30, keep_free_bytes=0) as d:
        d.put_many([(_key(r), r.header, r.payload) for r in recs])
        path = Path(d.file_path(_key(recs[0])))
        gate = threading.Event()
        d._files._reaper.submit(gate.wait)  # the reaper is busy: the next unlink waits behind it
        d.delete_many([_key(recs[0])])  # its file is trimmed at once (no free file kept)
        assert path.exists(), "the unlink is queued behind the gate"
        found: list[list] = []
        audit = threading.Thread(target=lambda: found.append(d.unlisted()))
        audit.start()
        gate.set()
        audit.join()
        assert found == [[]] and not path.exists()
        assert _served(d, recs) == 1


@pytest.mark.parametrize("kind", ("flip-largest-sst", "delete-current"))
def test_the_offline_check_reports_the_repair_and_verifies_every_record(tmp_path: Path, kind: str) -> None:
    data_dir = tmp_path / "data"
    recs = _fill(data_dir / "disk")
    bad = Path(_file_of(data_dir / "disk", recs[5]))  # a payload byte flipped: found by the check
    with open(bad, "r+b") as f:
        f.seek(align_up(len(recs[5].header)) + 10)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 1]))
    damage(data_dir / "disk", kind)
    assert tier_paths(str(data_dir)) == [str(data_dir / "disk")]
    report = check_tier(str(data_dir / "disk"), fix=False)
    assert report.repair is not None and "moved aside" in report.repair and not report.ok
    assert report.records == len(recs) and report.corrupt == [_key(recs[5]).hex()] and report.missing == []
    again = check_tier(str(data_dir / "disk"), fix=True)
    assert again.repair is None and again.corrupt == [_key(recs[5]).hex()] and again.records == len(recs) - 1
    final = check_tier(str(data_dir / "disk"), fix=False)
    assert final.ok and final.records == len(recs) - 1


def _file_of(tier: Path, rec: Rec) -> str:
    with DiskTier(tier, 1 << 30) as d:
        path = d.file_path(_key(rec))
    assert path is not None
    return path
