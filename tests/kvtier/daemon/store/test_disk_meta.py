"""MetaDB: locations round-trip through RocksDB, atomic commits, the layout marker, closing releases the lock."""

from __future__ import annotations

from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.disk_io import ALIGN
from kvtier.daemon.store.disk_meta import Location, MetaDB


def _open(path: Path) -> MetaDB:
    return MetaDB(str(path), sync=False, max_background_jobs=1, write_buffer_bytes=1 << 20)


def test_locations_round_trip_and_commit_atomically(tmp_path: Path) -> None:
    loc = Location(length=100 + 5000, fid=7, header=b"h" * 100)
    assert Location.decode(loc.encode()) == loc
    assert loc.payload_len == 5000 and loc.file_bytes == ALIGN + 2 * ALIGN
    meta = _open(tmp_path)
    try:
        meta.commit([(b"a", loc), (b"b", Location(1, 8, b"x"))])
        meta.commit([(b"c", Location(2, 9, b"yy"))], [b"b", b"zz"])
        assert [k for k, _ in meta.entries()] == [b"a", b"c"]
        assert meta.locate([b"c", b"b", b"a"]) == [Location(2, 9, b"yy"), None, loc]
        meta.flush()
        meta.compact()
        assert meta.disk_bytes() > 0
        with pytest.raises(StorageError):
            _open(tmp_path)  # locked
    finally:
        meta.close()
    again = _open(tmp_path)  # the lock was released
    try:
        assert again.get(b"a") == loc
    finally:
        again.close()


def test_a_foreign_layout_marker_drops_the_entries(tmp_path: Path) -> None:
    meta = _open(tmp_path)
    meta.commit([(b"a", Location(1, 1, b"h"))])
    meta.close()
    db = Rdict(str(tmp_path / "meta"), Options(raw_mode=True), column_families={"blocks": Options(raw_mode=True)})
    db[b"format"] = b"kvtier-disk/99"
    db.get_column_family("blocks").close()
    db.close()
    meta = _open(tmp_path)
    try:
        assert list(meta.entries()) == []
    finally:
        meta.close()
