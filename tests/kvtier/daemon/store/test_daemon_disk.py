"""A real daemon (``kvtier serve``) on its default disk tier: damaged metadata does not stop it nor
lose blocks silently; ``kvtier check`` online and offline reports the repair; a second daemon on
the same data dir is refused with one line; files are private whatever the umask.

One daemon writes a few hundred blocks (most evicted to disk, the rest written down at its clean
stop); each test starts another on a copy of that data dir, damaged on disk first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.bench.crash.data import Link, block_parts
from tests.kvtier.conftest import ROOT, KvtierDaemon
from tests.kvtier.daemon.store.test_disk_repair import DAMAGES, damage

N = 300
BLOCK = 16 << 10
HOST = "1MiB"  # 64 blocks: most of the N are evicted to disk while they are written


def _nothing() -> None:
    return None


def put_blocks(link: Link, n: int) -> None:
    for lo in range(0, n, 16):
        parts = [block_parts(1, i, BLOCK) for i in range(lo, min(n, lo + 16))]
        r = link.reserve([k for k, _, _ in parts], [len(p) for _, _, p in parts], _nothing)
        for (_, _, payload), slot in zip(parts, r.slots):
            link.shm.write(slot, payload)
        assert link.commit(r.lease, [h for _, h, _ in parts], _nothing) == len(parts)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data dir of a daemon that stored N blocks and stopped cleanly."""
    d = KvtierDaemon(tmp_path_factory.mktemp("kvtierd-written"), host_bytes=HOST)
    try:
        d.start()
        link = Link(d.address)
        try:
            put_blocks(link, N)
        finally:
            link.close()
        assert d.stop() == 0
    finally:
        d.cleanup()
    assert list((d.data_dir / "disk" / "meta").glob("*.sst")), "the metadata has tables"
    return d.data_dir


@pytest.fixture
def copy(written: Path, tmp_path: Path) -> Iterator[KvtierDaemon]:
    """A daemon (not started) whose data dir is a copy of ``written``; REST on a free port."""
    d = KvtierDaemon(tmp_path, host_bytes=HOST, extra_args=("--rest", "127.0.0.1:0"))
    shutil.copytree(written, d.data_dir)
    try:
        yield d
    finally:
        d.cleanup()


def _env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")}
    return {**base, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol"), str(ROOT / "connectors")])}


def kvtier_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=120)


def _rest(d: KvtierDaemon) -> str:
    found = re.findall(r"kvtierd rest (http://\S+)", d.log())
    assert found, d.log()
    return found[-1]


def _served(d: KvtierDaemon) -> int:
    link = Link(d.address)
    try:
        served = link.check_served([(1, i) for i in range(N)], BLOCK)
        assert served.bad == [], "never other bytes"
        return served.intact
    finally:
        link.close()


@pytest.mark.parametrize("kind", DAMAGES)
def test_the_daemon_starts_over_damaged_metadata_rebuilds_it_and_serves_the_blocks(copy: KvtierDaemon,
                                                                                    kind: str) -> None:
    damage(copy.data_dir / "disk", kind)
    copy.start()
    assert _served(copy) >= 0.99 * N
    log = copy.log()
    assert re.search(r"metadata damaged \(.*\); moved aside to \S+meta\.damaged-\d{8}T\d{6}Z", log), log
    assert list((copy.data_dir / "disk").glob("meta.damaged-*")), "kept for the operator"
    status = kvtier_cli("status", "--rest", _rest(copy), "--token-file", str(copy.data_dir / "token"), "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["stats"]["counters"]["disk_meta_rebuilds"] == 1
    if kind == "flip-largest-sst":  # the online check says what was found at start
        check = kvtier_cli("check", "--rest", _rest(copy), "--token-file", str(copy.data_dir / "token"))
        assert check.returncode == 0, check.stdout + check.stderr
        assert "no problems found" in check.stdout and "note: at start, disk tier" in check.stdout
        assert "moved aside" in check.stdout


def test_the_offline_check_reports_damage_and_is_refused_while_a_daemon_runs(copy: KvtierDaemon) -> None:
    damage(copy.data_dir / "disk", "flip-largest-sst")
    found = kvtier_cli("check", "--data-dir", str(copy.data_dir), "--json")
    assert found.returncode == 0, found.stdout + found.stderr
    (tier,) = json.loads(found.stdout)["tiers"]
    assert tier["repair"] is not None and "block checksum mismatch" in tier["repair"]
    assert tier["records"] == N and tier["missing"] == [] and tier["corrupt"] == [] and not tier["ok"]
    clean = kvtier_cli("check", "--data-dir", str(copy.data_dir))
    assert clean.returncode == 0 and "no problems found (300 records" in clean.stdout, clean.stdout
    copy.start()
    refused = kvtier_cli("check", "--data-dir", str(copy.data_dir))
    assert refused.returncode == 1
    assert f"in use by another process, pid {copy.process.pid} (socket {copy.socket})" in refused.stderr
    assert _served(copy) == N


def test_a_second_daemon_on_the_same_data_dir_is_refused_with_one_line(copy: KvtierDaemon, tmp_path: Path) -> None:
    copy.start()
    second = KvtierDaemon(tmp_path, host_bytes=HOST)  # the same data dir, its own socket
    second.log_path = tmp_path / "second.log"
    try:
        with pytest.raises(RuntimeError):
            second.start()
        errors = [line for line in second.log().splitlines() if "cannot start" in line]
        assert len(errors) == 1, second.log()
        assert f"is in use by another process, pid {copy.process.pid} (socket {copy.socket})" in errors[0]
        assert "Resource temporarily unavailable" not in second.log()
    finally:
        second.cleanup()
    assert _served(copy) == N, "the first daemon is untouched"


@pytest.mark.parametrize("mask", [0o022, 0o000], ids=["umask-022", "umask-000"])
def test_every_file_of_the_daemon_is_private_whatever_the_umask(tmp_path: Path, mask: int) -> None:
    d = KvtierDaemon(tmp_path, host_bytes=HOST)
    d.data_dir.mkdir(mode=0o755)
    os.chmod(d.data_dir, 0o755)  # a pre-existing data dir, readable by all
    old = os.umask(mask)  # the daemon inherits it
    try:
        d.start()
    finally:
        os.umask(old)
    try:
        link = Link(d.address)
        try:
            put_blocks(link, 100)
        finally:
            link.close()
        assert d.stop() == 0
        modes = {str(p.relative_to(d.data_dir)): stat.S_IMODE(p.stat().st_mode) for p in d.data_dir.rglob("*")}
        dirs = {p: m for p, m in modes.items() if (d.data_dir / p).is_dir()}
        files = {p: m for p, m in modes.items() if p not in dirs}
        assert stat.S_IMODE(d.data_dir.stat().st_mode) == 0o700
        assert set(dirs.values()) == {0o700}, dirs
        assert sum(p.startswith("disk/data/") for p in files) >= 100
        assert set(files.values()) == {0o600}, {p: oct(m) for p, m in files.items() if m != 0o600}
    finally:
        d.cleanup()
