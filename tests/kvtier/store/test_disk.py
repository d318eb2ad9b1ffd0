"""DiskTier: records round-trip, meta-only scans, reopen, crash safety (SIGKILL), errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier_protocol.errors import StorageError

from kvtier.store.disk import DiskTier

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
    items.append((_key(5), _header(5), memoryview(_payload(5, 1000))))  # small: stays in the LSM tree
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
        blobs = [f for f in d.live_files() if f.endswith(".blob")]
        assert blobs, "large values are stored in blob files"
    for f in blobs:  # scrub every payload: a scan that read them would see garbage
        size = os.path.getsize(f)
        with open(f, "r+b") as fh:
            fh.seek(size // 4)
            fh.write(b"\xff" * (size // 2))
    with DiskTier(path, 1 << 30) as d:
        assert [k for k, _ in d.iter_meta()] == [_key(i) for i in range(20) if i != 3]


def test_corrupted_record_is_returned_as_stored(disk: DiskTier) -> None:
    payload = _payload(7, 256 * KIB)
    disk.put_many([(_key(7), _header(7), payload)])
    disk.flush()
    blob = next(f for f in disk.live_files() if f.endswith(".blob"))
    data = Path(blob).read_bytes()
    at = data.index(_header(7) + payload[:64]) + len(_header(7)) + 1000
    with open(blob, "r+b") as fh:
        fh.seek(at)
        fh.write(bytes([data[at] ^ 0x01]))
    fd = os.open(blob, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read comes from the file
    os.close(fd)
    got = disk.get(_key(7))
    assert got is not None and len(got) == len(_header(7)) + len(payload)
    assert got != _header(7) + payload and got[len(_header(7)) + 1000] == payload[1000] ^ 0x01


_WRITER = """
import sys
from kvtier.store.disk import DiskTier
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
    root = Path(__file__).resolve().parents[3]
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


def test_compact_reclaims_the_space_of_deleted_records(disk: DiskTier) -> None:
    for r in range(6):  # each round lands in its own blob file; 3 of its 4 records are deleted
        disk.put_many([(_key(r * 10 + i), _header(i), _payload(i, 256 * KIB)) for i in range(4)])
        disk.flush()
        disk.delete_many([_key(r * 10 + i) for i in range(3)])
    assert disk.file_bytes > 2 * disk.used_bytes  # garbage kept in partly deleted blob files
    disk.compact()
    assert disk.file_bytes < 1.2 * disk.used_bytes + 64 * KIB
    for r in range(6):
        assert disk.get(_key(r * 10 + 3)) == _header(3) + _payload(3, 256 * KIB)
