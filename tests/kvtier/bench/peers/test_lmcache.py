"""The LMCache peer of `kvtier bench peers` (kvtier/bench/peers/lmcache.py).

The project's own venv never imports LMCache: the peer runs in the venv tools/lmcache-env.sh builds
(docs/benchmarks.md, "LMCache rows"), as a subprocess. Where that venv exists (tools/conformance.sh
builds it and runs this file with KVTIER_REQUIRE_LMCACHE=1, where a skip is a failure) its real
LocalCPUBackend is driven through that subprocess: a run of several threads, the figures, nothing
left held afterwards, and an undersized arena said, not evicted. Without it only the notes run.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.daemon import child_env
from kvtier.bench.peers import lmcache as peers_lmcache

ENV, WHY = peers_lmcache.find_env()
REQUIRED = os.environ.get("KVTIER_REQUIRE_LMCACHE") == "1"
needs_lmcache = pytest.mark.skipif(ENV is None and not REQUIRED,
                                   reason=f"{WHY} (docs/benchmarks.md: 'LMCache rows')")
MIB = 1 << 20
NS = b"kvtier-lmc-test!"


def test_required_lmcache_venv_is_there() -> None:
    """Under KVTIER_REQUIRE_LMCACHE=1 (tools/conformance.sh) a missing venv fails here, once, with
    the reason; elsewhere this only checks that the reason for a missing one says how to build it."""
    if REQUIRED:
        assert ENV is not None, WHY
    elif ENV is None:
        assert peers_lmcache.BUILD in WHY


def test_missing_lmcache_is_a_note_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache", None)  # makes `import lmcache` fail even where it is installed
    probe = peers_lmcache.open_backend(8 * MIB)
    assert probe.backend is None
    assert probe.reason.startswith("LMCache is not importable here (")
    probe.close()  # a no-op without a backend


def test_a_venv_that_is_not_there_is_a_one_line_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    missing = tmp_path / "no-such-env"
    for flag, env in ((str(missing), None), (None, str(missing))):
        if env is None:
            monkeypatch.delenv(peers_lmcache.ENV_VAR, raising=False)
        else:
            monkeypatch.setenv(peers_lmcache.ENV_VAR, env)
        peer = peers_lmcache.open_peer(8 * MIB, flag)
        assert not peer.usable and peer.proc is None
        assert peer.reason == (f"{'--lmcache-env' if flag else '$' + peers_lmcache.ENV_VAR} {missing} has no "
                               f"bin/python (build it: {peers_lmcache.BUILD} {missing})")
        peer.close()  # a no-op without a subprocess


def test_a_venv_without_lmcache_is_a_note_from_the_subprocess(tmp_path: Path) -> None:
    """A venv whose python runs but has no lmcache (this one's): the subprocess starts, says so, and
    is gone; the note names where the venv was found."""
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this venv's python, found as a venv's
    python.chmod(0o755)
    peer = peers_lmcache.open_peer(8 * MIB, str(env))
    if peer.usable:  # this interpreter imports lmcache itself (a hand-made install)
        peer.close()
        pytest.skip("this interpreter imports lmcache")
    assert peer.reason.startswith("LMCache is not importable here (") and peer.reason.endswith(f"(--lmcache-env {env})")


@needs_lmcache
def test_lmcache_backend_runs_the_workload_and_holds_nothing_after() -> None:
    peer = peers_lmcache.open_peer(2 * 6 * (MIB + 4096))
    try:
        assert peer.usable, peer.reason
        assert peer.reason == "" and peer.name.startswith("LMCache 0.5.6 ") and "LocalCPUBackend" in peer.name
        once = peer.runner(NS, clients=2, size=MIB, blocks=6, per_call=2)
        for _ in range(2):  # the second run reuses the arena the first one gave back
            figures = once()
            assert set(figures) == {"save", "load"}
            for fig in figures.values():
                assert fig.calls == 2 * 3  # clients x calls each
                assert math.isfinite(fig.gbps) and fig.gbps > 0
                assert 0 < fig.p50_ms <= fig.p99_ms
            assert peer.held() == (0, 0)  # no block in the hot cache, nothing allocated from the arena
        proc = peer.proc
    finally:
        peer.close()
    assert not peer.usable and proc is not None and proc.returncode == 0


@needs_lmcache
def test_an_arena_too_small_is_an_error_not_an_eviction() -> None:
    peer = peers_lmcache.open_peer(0)  # the arena is the slack alone
    try:
        assert peer.usable, peer.reason
        fits = peers_lmcache.SLACK // MIB
        with pytest.raises(RuntimeError, match="failed during save") as info:
            peer.runner(NS, clients=1, size=MIB, blocks=fits + 2, per_call=1)()
        assert "arena full" in str(info.value)  # the subprocess's traceback, cause included
        assert peer.held()[0] == fits  # what fitted is still there: none evicted
    finally:
        peer.close()


@needs_lmcache
def test_check_round_trips_one_block_in_the_venv() -> None:
    """What tools/lmcache-env.sh ends with: one line, and LMCache's telemetry off."""
    assert ENV is not None
    env = {**child_env(), **peers_lmcache.QUIET, "LMCACHE_LOG_LEVEL": "WARNING"}
    done = subprocess.run([ENV.python, "-m", "kvtier.bench.peers.lmcache", "--check"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("LMCache 0.5.6 LocalCPUBackend (in-process): a block went in and came back")
