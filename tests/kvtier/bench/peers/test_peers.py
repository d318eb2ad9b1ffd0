"""`kvtier bench peers --quick` end to end: the real daemon and real redis-server (both subprocesses),
real client processes, in-process CLI, tiny sizes. Checks the report.py JSON form, that every
engine's rows exist (LMCache's where its venv is built), the notes for a missing Redis or LMCache,
and that nothing is left behind (no speed asserts)."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

import kvtier.bench
from kvtier.bench.peers import lmcache as peers_lmcache
from kvtier.bench.peers import suite as peers
from kvtier.bench.redis_server import RedisServer, RedisUnavailable
from kvtier.bench.report import Row
from kvtier.cli import main

HELP = "save/load workload through kvtier (shm, TCP) vs Redis and LMCache, several clients"
HAVE_REDIS = shutil.which("redis-server") is not None and importlib.util.find_spec("redis") is not None
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason="redis-server (Debian package) or redis-py not installed")
LMCACHE_ENV, NO_LMCACHE = peers_lmcache.find_env()  # the venv tools/lmcache-env.sh builds, or why not
HAVE_LMCACHE = LMCACHE_ENV is not None


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The suite in the registry and a work dir with a short path (a unix socket path has at most
    107 bytes; tmp_path can be longer)."""
    monkeypatch.setitem(kvtier.bench.SUITES, "peers", ("kvtier.bench.peers.suite", HELP))
    base = Path(tempfile.mkdtemp(prefix="kvb-"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _quick(out: Path, work: Path, *extra: str) -> list[str]:
    return ["bench", "peers", "--quick", "--repetitions", "1", "--json", str(out), "--clients", "2",
            "--working-set-mib", "1", "--work-dir", str(work), *extra]


def _check_form(doc: dict, sizes: tuple[str, ...]) -> list[dict]:
    assert doc["suite"] == "peers"
    names = {f.name for f in fields(Row)}
    rows = doc["rows"]
    for row in rows:
        assert set(row) == names
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0
        assert row["kvtier_spread"] >= 0 and row["baseline_spread"] >= 0
        assert (row["metric"], row["unit"]) in {("throughput", "GB/s"), ("p50", "ms"), ("p99", "ms")}
    for size in sizes:
        for path in ("shm", "tcp"):
            for op in ("save", "load"):
                got = [r["metric"] for r in rows if r["case"] == f"{path} {op} {size}"]
                assert got == ["throughput", "p50", "p99"], (path, op, size)
    return rows


@needs_redis
def test_quick_peers_bench_against_real_redis(registered: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peers.json"
    assert main(_quick(out, registered, "--sizes-mib", "0.25,1")) == 0
    rows = _check_form(json.loads(out.read_text()), ("0.25MiB", "1MiB"))
    redis_rows = [r for r in rows if not r["case"].endswith("vs lmcache")]
    assert len(redis_rows) == 2 * 2 * 2 * 3  # sizes x {shm, tcp} x {save, load} x {GB/s, p50, p99}
    for row in redis_rows:
        assert row["baseline_name"].startswith("redis ") and "redis-py" in row["baseline_name"]
        assert math.isfinite(row["baseline"]) and row["baseline"] > 0
        if row["unit"] == "ms":
            assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])
        else:
            assert row["ratio"] == pytest.approx(row["kvtier"] / row["baseline"])
    captured = capsys.readouterr()
    assert "suite: peers" in captured.out
    if HAVE_LMCACHE:  # its venv built as docs/benchmarks.md says: its rows come (the note in the message if not)
        lmc_rows = [r for r in rows if r["case"].endswith("vs lmcache")]
        assert len(lmc_rows) == 2 * 2 * 3, captured.err  # sizes x {save, load} x {GB/s, p50, p99}, shm only
        for row in lmc_rows:
            assert row["case"].startswith("shm ")
            assert row["baseline_name"].startswith("LMCache ") and "LocalCPUBackend" in row["baseline_name"]
            assert math.isfinite(row["baseline"]) and row["baseline"] > 0
    else:
        assert f"NOTE: no LMCache rows: {NO_LMCACHE}" in captured.err
        assert not any("lmcache" in r["case"] for r in rows)
    assert list(registered.iterdir()) == []  # daemon dir, Redis dir, sockets and logs all removed


def test_missing_redis_is_said_and_kvtier_rows_still_come(registered: Path, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "peers.json"
    missing = str(tmp_path / "no-such-redis-server")
    assert main(_quick(out, registered, "--sizes-mib", "0.25", "--redis-server", missing)) == 0
    rows = [r for r in _check_form(json.loads(out.read_text()), ("0.25MiB",))
            if not r["case"].endswith("vs lmcache")]  # LMCache's rows (where installed) need no Redis
    assert len(rows) == 2 * 2 * 3 and {r["baseline_name"] for r in rows} == {"redis (unavailable)"}
    assert all(math.isnan(r["baseline"]) and math.isnan(r["ratio"]) for r in rows)
    err = capsys.readouterr().err
    assert "NOTE: no Redis baseline" in err and "no-such-redis-server not found on PATH" in err
    assert list(registered.iterdir()) == []


@needs_redis
def test_redis_server_is_private_answers_and_goes_away(tmp_path: Path) -> None:
    import redis

    server = RedisServer(work_parent=str(tmp_path))
    server.start()
    try:
        proc, work = server.proc, server.work
        assert proc is not None and work is not None and work.parent == tmp_path
        with redis.Redis(host="127.0.0.1", port=server.port) as r:
            assert r.config_get("save") == {"save": ""}
            assert r.config_get("appendonly") == {"appendonly": "no"}
            r.set(b"k", b"v" * 1000)
            assert r.get(b"k") == b"v" * 1000
    finally:
        server.stop()
    assert proc.poll() is not None and not work.exists() and server.proc is None
    server.stop()  # idempotent


def test_redis_server_that_cannot_start_is_reported(tmp_path: Path) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\necho 'fake redis refuses' >&2\nexit 3\n")
    fake.chmod(0o755)
    server = RedisServer(str(fake), work_parent=str(tmp_path))
    if importlib.util.find_spec("redis") is None:
        with pytest.raises(RedisUnavailable, match="redis-py is not importable"):
            server.start(timeout_s=5)
        return
    with pytest.raises(RedisUnavailable, match="exited with 3"):
        server.start(timeout_s=5)
    assert server.proc is None and list(tmp_path.iterdir()) == [fake]


def test_rotation_runs_every_engine_each_repetition_in_turn() -> None:
    order: list[str] = []

    def engine(name: str):
        def once():
            order.append(name)
            return {op: peers.RunFigures(float(len(order)), 1.0, 2.0, 1) for op in peers.OPS}
        return once

    figures = peers._rotate({n: engine(n) for n in ("a", "b", "c")}, reps=3)
    assert order == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]  # warm-up, then rotated
    assert [f.gbps for f in figures["a"]["save"]] == [4.0, 9.0, 11.0]  # the warm-up is not kept
    assert peers._plan(8 << 20, 1 << 20, 2, 3) == 6 and peers._plan(1 << 18, 1 << 20, 2, 1) == 4
