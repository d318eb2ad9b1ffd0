"""`kvtier bench dataplane --quick` against the real daemon (a subprocess), in-process CLI, tiny
sizes: the report.py JSON form, the rows it promises, and that the daemon and its files are gone
afterwards (no speed asserts)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

import kvtier.bench
from kvtier.client import memcopy
from kvtier.bench import dataplane
from kvtier.bench.report import Row
from kvtier.cli import main

MEMCPY = f"memcpy ({'kvtier.client.memcopy, non-temporal' if memcopy.NONTEMPORAL else 'plain'}, 2 threads)"
GLIBC = "memcpy (glibc, 2 threads)"
HELP = "daemon data plane: put/get over shared memory and TCP vs memcpy; lookup p50/p99 vs ping"


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The suite in the registry (whatever the lead's copy holds) and a work dir with a short path
    (a unix socket path has at most 107 bytes; tmp_path can be longer)."""
    monkeypatch.setitem(kvtier.bench.SUITES, "dataplane", ("kvtier.bench.dataplane", HELP))
    base = Path(tempfile.mkdtemp(prefix="kvb-"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def test_quick_dataplane_bench_writes_json(registered: Path, tmp_path: Path) -> None:
    out = tmp_path / "dataplane.json"
    argv = ["bench", "dataplane", "--quick", "--repetitions", "1", "--json", str(out),
            "--sizes-mib", "0.25,1", "--working-set-mib", "2", "--batch-mib", "1",
            "--lookup-keys", "64", "--lookup-calls", "20", "--work-dir", str(registered),
            "--pipeline-mib", "0.5",  # sub-batches of two 0.25 MiB blocks: the shm rows pipeline
            "--grant-mib", "0",  # and reserve/commit (granted slots: the default, in test_all_quick)
            "--copy-threads", "2",  # the clients, the baseline and torch's copy_ alike
            "--small-batch", "off"]  # the per-request floor rows: test_small_batch_rows
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "dataplane"
    names = {f.name for f in fields(Row)}
    cases = [r["case"] for r in doc["rows"]]
    assert not any("KiB" in c for c in cases)
    for size in ("0.25MiB", "1MiB"):
        for path in ("shm", "tcp"):
            assert f"{path} put {size}" in cases and f"{path} get {size}" in cases
            # the daemon's CPU per block (Linux: /proc/PID/task/*/schedstat, which CI has)
            assert f"{path} put {size}, daemon CPU" in cases and f"{path} get {size}, daemon CPU" in cases
        assert f"shm put {size}, write-behind" in cases  # pipelined and write-behind at once here
        assert f"memcpy {size} (kvtier.client.memcopy)" in cases
    assert sum(c.startswith("start to ready, ") for c in cases) == 1
    for sock in ("unix socket", "tcp"):
        assert [(r["metric"], r["baseline_name"]) for r in doc["rows"]
                if r["case"] == f"lookup 64 keys, {sock}, vs ping"] == [
            ("p50", "ping round trip, same socket"), ("p99", "ping round trip, same socket")]
    for row in doc["rows"]:
        assert set(row) == names
        if row["case"].startswith("lookup"):
            assert row["unit"] == "ms"
            assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])
        elif row["case"].startswith("start to ready, "):
            assert (row["metric"], row["unit"]) == ("latency", "s")
            assert row["baseline_name"] == "python importing the daemon's modules"
            assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])
        elif row["case"].endswith(", daemon CPU"):
            assert (row["metric"], row["unit"]) == ("cpu per block", "us")
            assert row["baseline_name"] == "the client's copy of a block (2 threads)"
            assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])
        else:
            assert (row["metric"], row["unit"]) == ("throughput", "GB/s")
            # that copy against torch's; every data-plane row against it and against glibc's memcpy
            if row["case"].startswith("memcpy"):
                assert row["baseline_name"] == "torch copy_ (2 threads)"
            else:
                assert [r["baseline_name"] for r in doc["rows"] if r["case"] == row["case"]] == [MEMCPY, GLIBC]
            assert row["ratio"] == pytest.approx(row["kvtier"] / row["baseline"])
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0 and row["baseline"] > 0
        assert row["kvtier_spread"] >= 0 and row["baseline_spread"] >= 0
    assert list(registered.iterdir()) == []  # socket, token, disk tier and log removed with the daemon


def test_small_batch_rows(registered: Path, tmp_path: Path) -> None:
    """The per-request floor: calls of 64 blocks of 64 KiB, every row the block sizes have (shm,
    write-behind, TCP; put and get; the daemon's CPU per block; both memcpy baselines), granted
    slots and the client's own pipelining (the defaults), in the same JSON form."""
    out = tmp_path / "dataplane.json"
    argv = ["bench", "dataplane", "--quick", "--repetitions", "1", "--json", str(out),
            "--sizes-mib", "0.25", "--working-set-mib", "0.25", "--batch-mib", "0.25",
            "--lookup-keys", "8", "--lookup-calls", "5", "--work-dir", str(registered),
            "--copy-threads", "2"]  # --small-batch: its default, 64x64
    assert main(argv) == 0
    rows = json.loads(out.read_text())["rows"]
    small = [r for r in rows if "64 x 64KiB" in r["case"]]
    want = {}
    for case in ("shm put", "shm put 64 x 64KiB, write-behind", "tcp put", "shm get", "tcp get"):
        case = case if "64KiB" in case else f"{case} 64 x 64KiB"
        want[case] = [("throughput", MEMCPY), ("throughput", GLIBC)]
        want[f"{case}, daemon CPU"] = [("cpu per block", "the client's copy of a block (2 threads)")]
    want["memcpy 64 x 64KiB (kvtier.client.memcopy)"] = [("throughput", "torch copy_ (2 threads)")]
    got: dict[str, list[tuple[str, str]]] = {}
    for r in small:
        got.setdefault(r["case"], []).append((r["metric"], r["baseline_name"]))
    assert got == want
    for r in small:
        assert set(r) == {f.name for f in fields(Row)}
        assert math.isfinite(r["kvtier"]) and r["kvtier"] > 0 and r["baseline"] > 0
        if r["unit"] == "us":
            assert r["ratio"] == pytest.approx(r["baseline"] / r["kvtier"])
        else:
            assert r["unit"] == "GB/s" and r["ratio"] == pytest.approx(r["kvtier"] / r["baseline"])
    assert list(registered.iterdir()) == []


def test_small_batch_flag() -> None:
    assert dataplane._small_batch("64x64") == (64, 64 << 10)
    assert dataplane._small_batch("16X0.5") == (16, 512)
    assert dataplane._small_batch("off") is None and dataplane._small_batch("0") is None
    for bad in ("0x64", "8x0.01", "64"):
        with pytest.raises(ValueError, match="BLOCKSxKIB"):
            dataplane._small_batch(bad)


def test_daemon_that_cannot_start_is_reported_with_its_log(tmp_path: Path) -> None:
    daemon = dataplane._daemon(tmp_path, host_bytes=0, profile=None)  # no host tier: serve refuses
    try:
        with pytest.raises(RuntimeError, match="exited with") as info:
            daemon.start(timeout_s=60)
        assert "host" in str(info.value)  # the daemon's own error line comes with it
    finally:
        daemon.stop()
    assert daemon.proc is None
