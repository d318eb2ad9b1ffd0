"""Who owns a tier's directory: private modes whatever the umask, the owner lock (a second process
refused with one line naming the holder), and a dead owner's shared memory removed at once even
while its process is an unreaped zombie."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.owner import DirectoryBusy, OwnerLock, listening_unix_sockets, private_dir
from kvtier.daemon.store.shm import SHM_DIR, reclaim_stale
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import make_key
from tests.kvtier.conftest import ROOT
from tests.kvtier.daemon.store.storekit import make_rec
from tests.kvtier.waitkit import PATIENCE_S


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """``(directories, files)``: path relative to ``root`` -> permission bits, ``root`` included."""
    dirs, files = {".": stat.S_IMODE(root.stat().st_mode)}, {}
    for base, dnames, fnames in os.walk(root):
        for n in dnames:
            dirs[os.path.relpath(os.path.join(base, n), root)] = stat.S_IMODE(os.stat(os.path.join(base, n)).st_mode)
        for n in fnames:
            files[os.path.relpath(os.path.join(base, n), root)] = stat.S_IMODE(os.stat(os.path.join(base, n)).st_mode)
    return dirs, files


@pytest.mark.parametrize("mask", [0o022, 0o000], ids=["umask-022", "umask-000"])
def test_the_disk_tier_makes_private_directories_and_files_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    tier = tmp_path / "shared" / "disk"
    tier.mkdir(parents=True, mode=0o755)
    os.chmod(tier, 0o755)  # a pre-existing directory of ours, readable by all: tightened
    recs = [make_rec(i) for i in range(20)]
    with umask(mask):
        with DiskTier(tier, 1 << 30) as d:
            d.put_many([(make_key(r.ns_id, r.chain_hash), r.header, r.payload) for r in recs])
            d.delete_many([make_key(r.ns_id, r.chain_hash) for r in recs[:5]])
            d.flush()
        with DiskTier(tier, 1 << 30):  # RocksDB's files of the first open are tightened at the next
            dirs, files = _modes(tier)
    assert set(dirs.values()) == {0o700}, dirs
    blocks = {p: m for p, m in files.items() if p.startswith("data/")}
    assert len(blocks) >= 20 and set(blocks.values()) == {0o600}, blocks
    assert files["owner.lock"] == 0o600
    old_meta = {p: m for p, m in files.items() if p.startswith("meta/") and p.endswith((".sst", "CURRENT"))}
    assert old_meta and set(old_meta.values()) == {0o600}, old_meta


def test_private_dir_makes_missing_parents_0700_and_leaves_shared_directories_alone(tmp_path: Path) -> None:
    with umask(0o000):
        private_dir(tmp_path / "a" / "b" / "c")
    assert [stat.S_IMODE((tmp_path / p).stat().st_mode) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # sticky, like /tmp (which a daemon run as root owns): shared by design
    private_dir(shared)
    private_dir(shared / "mine")
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777
    assert stat.S_IMODE((shared / "mine").stat().st_mode) == 0o700


def test_a_second_owner_in_this_process_is_refused_naming_the_holder(tmp_path: Path) -> None:
    with DiskTier(tmp_path / "disk", 1 << 30):
        with pytest.raises(DirectoryBusy, match=f"is in use by another process, pid {os.getpid()}"):
            DiskTier(tmp_path / "disk", 1 << 30)
    with DiskTier(tmp_path / "disk", 1 << 30) as d:  # released at close
        assert d.previous_owner is None, "a clean close forgets its pid"


_HOLDER = textwrap.dedent("""
    import os, socket, sys
    from kvtier.daemon.store.disk import DiskTier
    from kvtier.daemon.store.host import HostTier
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(sys.argv[3])
    listener.listen()
    disk = DiskTier(sys.argv[1], 1 << 30)
    host = HostTier(1 << 20, name_prefix=sys.argv[2], prefault=False, pin=False)
    print("ready", flush=True)
    sys.stdin.read()  # until killed
""")


@contextmanager
def holder(tier: Path, prefix: str, sock: Path) -> Iterator[subprocess.Popen[str]]:
    """A process that holds ``tier`` open, a host tier of ``prefix``, and listens on ``sock``;
    killed and reaped at exit."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol")])}
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tier), prefix, str(sock)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield proc
    finally:
        proc.kill()
        proc.communicate()  # reaps it, and closes the pipes
        for name in os.listdir(SHM_DIR):
            if name.startswith(prefix + "-"):
                os.unlink(os.path.join(SHM_DIR, name))


def _state(pid: int) -> str:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rfind(")") + 2]


def _wait_until(pred, timeout_s: float = PATIENCE_S) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_another_process_is_refused_with_its_pid_and_socket(tmp_path: Path) -> None:
    sock = Path(f"/tmp/kvo-{os.getpid()}.sock")
    try:
        with holder(tmp_path / "disk", f"kvown{os.getpid()}", sock) as proc:
            assert listening_unix_sockets(proc.pid) == [str(sock)]
            with pytest.raises(DirectoryBusy) as err:
                DiskTier(tmp_path / "disk", 1 << 30)
            msg = str(err.value)
            assert "\n" not in msg and f"pid {proc.pid} (socket {sock})" in msg and "LOCK" not in msg
    finally:
        sock.unlink(missing_ok=True)


async def test_a_killed_owner_still_a_zombie_leaves_no_segment_behind(tmp_path: Path) -> None:
    """kill -9 and a restart before the dead process is reaped: ``kill(pid, 0)`` still succeeds on
    the zombie, but its owner lock is free, so its segments are removed at the new start."""
    prefix = f"kvzomb{os.getpid()}"
    sock = Path(f"/tmp/kvz-{os.getpid()}.sock")
    try:
        with holder(tmp_path / "disk", prefix, sock) as proc:
            theirs = [n for n in os.listdir(SHM_DIR) if n.startswith(f"{prefix}-{proc.pid}-")]
            assert len(theirs) == 1
            os.kill(proc.pid, signal.SIGKILL)
            assert _wait_until(lambda: _state(proc.pid) == "Z"), "dead and not reaped"
            os.kill(proc.pid, 0)  # what the former liveness check asked: it succeeds on a zombie
            store = TieredStore(StoreConfig(host_bytes=1 << 20, host_name_prefix=prefix, host_prefault=False,
                                            host_pin=False, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 30))
            await store.start()
            try:
                assert store.disk.previous_owner == proc.pid
                assert not (Path(SHM_DIR) / theirs[0]).exists(), "the dead owner's segment is gone"
                assert [n for n in os.listdir(SHM_DIR) if n.startswith(prefix + "-")] == \
                    [n for n in os.listdir(SHM_DIR) if n.startswith(f"{prefix}-{os.getpid()}-")]
            finally:
                await store.close()
    finally:
        sock.unlink(missing_ok=True)


def test_a_zombie_is_gone_for_reclaim_stale_and_a_pid_the_lock_says_is_gone_too(tmp_path: Path) -> None:
    prefix = f"kvrecl{os.getpid()}"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    assert _wait_until(lambda: _state(zombie.pid) == "Z")
    try:
        names = [f"{prefix}-{zombie.pid}-{'a' * 12}", f"{prefix}-{os.getpid()}-{'b' * 12}"]
        for n in names:
            Path(SHM_DIR, n).write_bytes(b"x")
        assert [n for n, _ in reclaim_stale(prefix)] == [names[0]], "the zombie's, not the live one's"
        assert [n for n, _ in reclaim_stale(prefix, frozenset([os.getpid()]))] == [names[1]]
    finally:
        zombie.wait()
        for n in os.listdir(SHM_DIR):
            if n.startswith(prefix):
                os.unlink(os.path.join(SHM_DIR, n))


def test_the_lock_records_a_killed_holders_pid_for_the_next_owner(tmp_path: Path) -> None:
    sock = Path(f"/tmp/kvl-{os.getpid()}.sock")
    try:
        with holder(tmp_path / "disk", f"kvlock{os.getpid()}", sock) as proc:
            os.kill(proc.pid, signal.SIGKILL)
            assert _wait_until(lambda: _state(proc.pid) == "Z")
            lock = OwnerLock.acquire(tmp_path / "disk")
            try:
                assert lock.previous_pid == proc.pid
                assert (tmp_path / "disk" / "owner.lock").read_text().strip() == str(os.getpid())
            finally:
                lock.release()
        assert (tmp_path / "disk" / "owner.lock").read_text() == "", "a release forgets the pid"
    finally:
        sock.unlink(missing_ok=True)
