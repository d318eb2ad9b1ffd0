"""DiskTier: records round-trip, meta-only scans, reopen, crash leftovers, the old layout, SIGKILL, errors."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rocksdict import Options, Rdict

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_io import ALIGN, align_up

KIB = 1 << 10


def _key(i: int) -> bytes:
    return b"N" * 16 + i.to_bytes(32, "big")


def _header(i: int) -> bytes:
    return b"KVT1" + i.to_bytes(4, "little") + b"h" * 40


def _payload(i: int, n: int = 100 * KIB) -> bytes:
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


@pytest.fixture
def disk(tmp_path: Path):
    d = DiskTier(tmp_path / "db", 1 << 30)
    yield d
    d.close()


def test_put_get_round_trip(disk: DiskTier) -> None:
    items = [(_key(i), _header(i), _payload(i)) for i in range(5)]
    items.append((_key(5), _header(5), memoryview(_payload(5, 1000))))  # under a page: all in the bounce page
    disk.put_many(items)
    for key, header, payload in items:
        assert disk.get(key) == header + bytes(payload)
        assert disk.contains(key)
    assert disk.get(_key(99)) is None and not disk.contains(_key(99))
    got = disk.get_many([_key(1), _key(99), _key(5)])
    assert got == [_header(1) + _payload(1), None, _header(5) + _payload(5, 1000)]
    assert disk.get_many([]) == []
    assert disk.used_bytes == sum(len(h) + len(p) for _, h, p in items) and disk.num_records == 6
    assert disk.capacity_bytes == 1 << 30


def test_overwrite_and_delete_keep_the_accounting(disk: DiskTier) -> None:
    disk.put_many([(_key(1), _header(1), _payload(1)), (_key(2), _header(2), _payload(2))])
    disk.put_many([(_key(1), _header(1), _payload(1, 10))])  # overwrite with a shorter record
    assert disk.get(_key(1)) == _header(1) + _payload(1, 10)
    assert disk.used_bytes == len(_header(1)) + 10 + len(_header(2)) + len(_payload(2))
    disk.put_many([(_key(3), _header(3), _payload(3)), (_key(3), _header(3), _payload(3, 8))])  # last one wins
    assert disk.get(_key(3)) == _header(3) + _payload(3, 8)
    disk.delete_many([_key(1), _key(1), _key(42)])
    assert disk.get(_key(1)) is None and not disk.contains(_key(1))
    assert disk.num_records == 2
    assert disk.used_bytes == len(_header(2)) + len(_payload(2)) + len(_header(3)) + 8
    disk.delete_many([_key(2), _key(3)])
    assert disk.used_bytes == 0 and disk.num_records == 0 and list(disk.iter_meta()) == []


def test_reopen_finds_everything_from_meta_alone(tmp_path: Path) -> None:
    path = tmp_path / "db"
    items = [(_key(i), _header(i), _payload(i, 200 * KIB)) for i in range(20)]
    with DiskTier(path, 1 << 30) as d:
        d.put_many(items[:10])
        d.put_many(items[10:])
        d.delete_many([_key(3)])
        used = d.used_bytes
        d.flush()
        d.compact()
    d.close()  # idempotent
    with DiskTier(path, 1 << 30) as d:
        assert d.used_bytes == used and d.num_records == 19
        assert [h for _, h in d.iter_meta()] == [_header(i) for i in range(20) if i != 3]
        for i in (0, 10, 19):
            assert d.get(_key(i)) == _header(i) + _payload(i, 200 * KIB)
        files = d.live_files()
        assert len(files) == 19, "one file per record; the deleted one's is gone"
    for f in files:  # scrub every payload: a scan that read them would see garbage
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.seek(size // 4)
            fh.write(b"\xff" * (size // 2))
    with DiskTier(path, 1 << 30) as d:
        assert [k for k, _ in d.iter_meta()] == [_key(i) for i in range(20) if i != 3]


def test_a_block_file_is_the_record_with_its_payload_on_a_page(disk: DiskTier) -> None:
    payload = _payload(4, 10_000)
    disk.put_many([(_key(4), _header(4), payload)])
    data = Path(disk.file_path(_key(4))).read_bytes()
    h = len(_header(4))
    assert data[:h] == _header(4) and data[h:ALIGN] == bytes(ALIGN - h)
    assert data[ALIGN:ALIGN + len(payload)] == payload
    assert len(data) == ALIGN + align_up(len(payload)) and data[ALIGN + len(payload):] == bytes(len(data) - ALIGN - len(payload))
    assert disk.file_path(_key(99)) is None


def test_corrupted_record_is_returned_as_stored(disk: DiskTier) -> None:
    payload = _payload(7, 256 * KIB)
    disk.put_many([(_key(7), _header(7), payload)])
    path = disk.file_path(_key(7))
    with open(path, "r+b") as fh:
        fh.seek(ALIGN + 1000)
        fh.write(bytes([payload[1000] ^ 0x01]))
    got = disk.get(_key(7))
    assert got is not None and len(got) == len(_header(7)) + len(payload)
    assert got != _header(7) + payload and got[len(_header(7)) + 1000] == payload[1000] ^ 0x01


@pytest.mark.parametrize("n", [0, 1, 4095, ALIGN, 3 * ALIGN + 17, 300 * KIB])
@pytest.mark.parametrize("offset", [0, 1])  # a page-aligned destination (a host slot), and one that is not
def test_read_into_fills_exactly_the_payload(disk: DiskTier, n: int, offset: int) -> None:
    payload = _payload(n, n)
    disk.put_many([(_key(1), _header(1), payload)])
    dest = disk.buffers.get(n + offset + ALIGN)
    dest[:] = b"\xee" * len(dest)
    view = dest[offset:offset + n]
    assert disk.read_into([_key(1), _key(2)], [view, view]) == [_header(1), None]
    assert bytes(view) == payload and bytes(dest[offset + n:]) == b"\xee" * (len(dest) - offset - n)
    assert disk.read_into([_key(1)], [memoryview(bytearray(n + 1))]) == [None], "another length is a miss"


def test_meta_without_its_file_reads_as_a_miss(disk: DiskTier) -> None:
    disk.put_many([(_key(1), _header(1), _payload(1)), (_key(2), _header(2), _payload(2))])
    os.unlink(disk.file_path(_key(1)))
    assert disk.get(_key(1)) is None and disk.get(_key(2)) == _header(2) + _payload(2)
    assert disk.read_into([_key(1)], [memoryview(bytearray(len(_payload(1))))]) == [None]


def test_a_short_file_is_a_read_error(disk: DiskTier) -> None:
    disk.put_many([(_key(1), _header(1), _payload(1))])
    os.truncate(disk.file_path(_key(1)), ALIGN)
    with pytest.raises(StorageError):
        disk.get(_key(1))


def test_files_without_meta_are_free_at_open_and_strays_removed(tmp_path: Path) -> None:
    path = tmp_path / "db"
    with DiskTier(path, 1 << 30) as d:
        d.put_many([(_key(i), _header(i), _payload(i)) for i in range(3)])
        freed = d.file_path(_key(0))
        d.delete_many([_key(0)])
    shard = Path(freed).parent
    partial, other = shard.parent / "ff" / "00000000000000ff", shard / "0000000000000002"  # a crash mid-write; misplaced
    for f in (partial, other):
        f.write_bytes(b"partial")
    crashed = shard.parent / "00" / "0000000000000100"  # written whole, then a crash before its meta commit
    crashed.write_bytes(Path(freed).read_bytes())
    (path / "free-ids").unlink()  # a crash leaves no free list (a clean close does)
    with DiskTier(path, 1 << 30) as d:
        assert d.repair is None, "after a crash, files no entry lists are free, not lost entries"
        assert not partial.exists() and not other.exists()
        assert sorted(d.live_files()) == sorted([freed, d.file_path(_key(1)), d.file_path(_key(2)), str(crashed)])
        assert d.get(_key(1)) == _header(1) + _payload(1) and d.num_records == 2
        assert d.file_bytes >= 4 * (align_up(len(_header(0))) + align_up(len(_payload(0))))
        d.put_many([(_key(i), _header(i), _payload(i)) for i in (5, 6, 7)])  # two free files, one new
        paths = {d.file_path(_key(i)) for i in (5, 6, 7)}
        assert {freed, str(crashed)} < paths
        assert int(Path((paths - {freed, str(crashed)}).pop()).name, 16) > 0x100, "new ids above all seen"
        for i in (5, 6, 7):
            assert d.get(_key(i)) == _header(i) + _payload(i)


def test_deleted_and_overwritten_records_free_their_files_for_reuse(tmp_path: Path) -> None:
    size = align_up(len(_header(0))) + 256 * KIB  # one block file
    with DiskTier(tmp_path / "db", 1 << 30, keep_free_bytes=4 * size) as disk:
        disk.put_many([(_key(i), _header(i), _payload(i, 256 * KIB)) for i in range(8)])
        old = disk.file_path(_key(0))
        disk.put_many([(_key(0), _header(0), _payload(0, 8 * KIB))])  # another size: a new file
        assert disk.file_path(_key(0)) != old
        disk.delete_many([_key(i) for i in range(1, 7)])  # 7 free files, 4 kept
        disk.drain()
        assert disk.num_records == 2 and len(disk.live_files()) == 2 + 4
        assert disk.file_bytes >= disk.used_bytes + 4 * size
        disk.put_many([(_key(20 + i), _header(i), _payload(i, 256 * KIB)) for i in range(5)])
        assert len(disk.live_files()) == 2 + 5, "four free files written over, one created"
        for i in range(5):
            assert disk.get(_key(20 + i)) == _header(i) + _payload(i, 256 * KIB)
        disk.compact()  # unlinks the free files
        disk.delete_many([_key(20)])
        disk.compact()
        assert len(disk.live_files()) == disk.num_records == 6
        assert disk.file_bytes < disk.used_bytes + 6 * ALIGN + (1 << 20)  # padding, RocksDB's meta
        assert disk.get(_key(7)) == _header(7) + _payload(7, 256 * KIB)


def test_a_directory_of_the_old_rocksdb_records_layout_is_dropped(tmp_path: Path, caplog) -> None:
    path = tmp_path / "db"
    opts = Options(raw_mode=True)
    opts.create_if_missing(True)
    opts.create_missing_column_families(True)
    old = Rdict(str(path), opts, column_families={"records": Options(raw_mode=True), "meta": Options(raw_mode=True)})
    old.get_column_family("records")[_key(1)] = _header(1) + _payload(1)
    old.get_column_family("meta")[_key(1)] = (len(_header(1)) + len(_payload(1))).to_bytes(8, "little") + _header(1)
    for cf in ("records", "meta"):
        old.get_column_family(cf).close()
    old.close()
    with DiskTier(path, 1 << 30) as d:
        assert d.num_records == 0 and list(d.iter_meta()) == [] and d.get(_key(1)) is None
        assert "former RocksDB-records layout" in caplog.text
        d.put_many([(_key(2), _header(2), _payload(2))])
    assert not (path / "CURRENT").exists()
    with DiskTier(path, 1 << 30) as d:
        assert d.get(_key(2)) == _header(2) + _payload(2)


def test_sync_writes_and_buffered_io_round_trip(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "sync", 1 << 30, sync_writes=True) as d:
        d.put_many([(_key(1), _header(1), _payload(1, 5000))])
        d.flush()
        assert d.get(_key(1)) == _header(1) + _payload(1, 5000)
    with DiskTier(tmp_path / "buffered", 1 << 30, direct_io=False) as d:
        d.put_many([(_key(2), _header(2), _payload(2, 5000))])
        assert d.get(_key(2)) == _header(2) + _payload(2, 5000)
    # /dev/shm is tmpfs: O_DIRECT where the kernel supports it there (6.6+), buffered otherwise.
    path = Path("/dev/shm") / f"kvtier-test-disk-{os.getpid()}"
    try:
        with DiskTier(path, 1 << 30) as d:
            d.put_many([(_key(3), _header(3), _payload(3, 5000))])
            assert d.read_into([_key(3)], [memoryview(bytearray(5000))]) == [_header(3)]
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_write_into_the_reserved_free_space_is_refused_and_nothing_changes(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "db", 1 << 30) as d:
        d.put_many([(_key(1), _header(1), _payload(1))])
        d.min_free_bytes = 1 << 62
        with pytest.raises(StorageError, match="refused"):
            d.put_many([(_key(2), _header(2), _payload(2))])
        assert d.num_records == 1 and len(d.live_files()) == 1
        assert d.get(_key(1)) == _header(1) + _payload(1)


_WRITER = """
import sys
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_io import ALIGN, align_up
d = DiskTier(sys.argv[1], 1 << 30)
i = 0
while True:
    key = b"N" * 16 + i.to_bytes(32, "big")
    payload = (i.to_bytes(4, "little") * 40000)
    d.put_many([(key, b"hdr" + i.to_bytes(4, "little"), payload)])
    print("acked", i, flush=True)
    i += 1
"""


def test_acked_records_survive_sigkill(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[4]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(root / "protocol")]))
    path = tmp_path / "db"
    acked = []
    with subprocess.Popen([sys.executable, "-c", _WRITER, str(path)], stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            acked.append(int(line.split()[1]))
            if len(acked) == 40:
                proc.send_signal(signal.SIGKILL)
                break
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    with DiskTier(path, 1 << 30) as d:
        for i in acked:
            got = d.get(b"N" * 16 + i.to_bytes(32, "big"))
            assert got == b"hdr" + i.to_bytes(4, "little") + i.to_bytes(4, "little") * 40000, f"record {i} lost"
        assert d.num_records >= len(acked)


def test_storage_errors(tmp_path: Path) -> None:
    afile = tmp_path / "file"
    afile.write_bytes(b"x")
    with pytest.raises(StorageError):
        DiskTier(afile, 1 << 20)  # a file, not a directory
    with pytest.raises(StorageError):
        DiskTier(afile / "db", 1 << 20)  # below a file
    d = DiskTier(tmp_path / "db", 1 << 20)
    with pytest.raises(StorageError):
        DiskTier(tmp_path / "db", 1 << 20)  # locked by the first
    d.close()
    with pytest.raises(StorageError):
        d.get(_key(1))
    with pytest.raises(StorageError):
        d.put_many([(_key(1), b"h", b"p")])


def test_put_verified_writes_only_copies_that_match_their_checksum(disk: DiskTier) -> None:
    from kvtier_protocol.header import payload_checksum

    sources = [disk.buffers.get(n) for n in (300 * KIB, 5000, 64 * KIB, 1)]
    for i, s in enumerate(sources):
        s[:] = _payload(i, len(s))
    sums = [payload_checksum(s) for s in sources]
    sums[2] ^= 1  # a damaged host copy
    items = [(_key(i), _header(i), s, c) for i, (s, c) in enumerate(zip(sources, sums))]
    assert disk.put_verified(items) == [True, True, False, True]
    assert disk.get(_key(2)) is None and disk.num_records == 3
    for i in (0, 1, 3):
        assert disk.get(_key(i)) == _header(i) + _payload(i, len(sources[i]))
    assert disk.put_verified([]) == []


def test_a_failed_put_verified_stores_nothing_and_leaves_no_file(disk: DiskTier) -> None:
    from kvtier_protocol.header import payload_checksum

    disk.put_many([(_key(0), _header(0), _payload(0))])
    sources = [memoryview(_payload(i)) for i in range(1, 6)]
    items = [(_key(i + 1), _header(i + 1), s, payload_checksum(s)) for i, s in enumerate(sources)]
    shutil.rmtree(os.path.join(disk.path, "data", "04"))  # the 4th new file (id 4) cannot be created
    with pytest.raises(StorageError):
        disk.put_verified(items)
    disk.drain()
    assert disk.num_records == 1 and [k for k, _ in disk.iter_meta()] == [_key(0)]
    os.mkdir(os.path.join(disk.path, "data", "04"))
    assert disk.put_verified(items) == [True] * 5, "the files of the failed batch are free, reused"
    assert len(disk.live_files()) == 6 and disk.get(_key(5)) == _header(5) + _payload(5)


def test_live_and_free_files_together_stay_within_the_budget(tmp_path: Path) -> None:
    small, big = 60 * KIB, 200 * KIB
    file_small, file_big = align_up(len(_header(0))) + small, align_up(len(_header(0))) + big
    with DiskTier(tmp_path / "db", 10 * file_small) as disk:
        disk.put_many([(_key(i), _header(i), _payload(i, small)) for i in range(10)])
        disk.delete_many([_key(i) for i in range(10)])
        disk.drain()
        assert len(disk.live_files()) == 10, "all free, all kept: the budget holds them"
        disk.put_many([(_key(20 + i), _header(i), _payload(i, big)) for i in range(2)])  # another size
        disk.drain()
        free = len(disk.live_files()) - 2
        assert 2 * file_big + free * file_small <= 10 * file_small and free == 10 - 7
