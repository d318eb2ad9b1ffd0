"""The LMCache peer of `kvtier bench peers` (kvtier/bench/peers/lmcache.py).

Without LMCache (the project's own venv and CI) only the note path runs; where LMCache is
installed (docs/benchmarks.md, "LMCache rows") its real LocalCPUBackend is driven: a run of several
threads, the figures, nothing left held afterwards, and an undersized arena said, not evicted.
"""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from kvtier.bench.peers import lmcache as peers_lmcache

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None
needs_lmcache = pytest.mark.skipif(not HAVE_LMCACHE, reason="LMCache is not installed here (docs/benchmarks.md: "
                                                            "'LMCache rows')")
MIB = 1 << 20
NS = b"kvtier-lmc-test!"


def test_missing_lmcache_is_a_note_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lmcache", None)  # makes `import lmcache` fail even where it is installed
    probe = peers_lmcache.open_backend(8 * MIB)
    assert probe.backend is None
    assert probe.reason.startswith("LMCache is not importable here (")
    probe.close()  # a no-op without a backend


@needs_lmcache
def test_lmcache_backend_runs_the_workload_and_holds_nothing_after() -> None:
    probe = peers_lmcache.open_backend(2 * 6 * (MIB + 4096))
    try:
        assert probe.backend is not None, probe.reason
        assert probe.reason == "" and probe.name.startswith("LMCache ") and "LocalCPUBackend" in probe.name
        once = probe.runner(NS, clients=2, size=MIB, blocks=6, per_call=2)
        for _ in range(2):  # the second run reuses the arena the first one gave back
            figures = once()
            assert set(figures) == {"save", "load"}
            for fig in figures.values():
                assert fig.calls == 2 * 3  # clients x calls each
                assert math.isfinite(fig.gbps) and fig.gbps > 0
                assert 0 < fig.p50_ms <= fig.p99_ms
            assert probe.backend.held() == 0
            assert probe.backend.allocator.pin_allocator.total_allocated_size == 0
    finally:
        probe.close()
    assert probe.backend is None


@needs_lmcache
def test_an_arena_too_small_is_an_error_not_an_eviction() -> None:
    probe = peers_lmcache.open_backend(0)  # the arena is the slack alone
    try:
        assert probe.backend is not None, probe.reason
        blocks = peers_lmcache.SLACK // MIB + 2
        with pytest.raises(RuntimeError, match="failed during save") as info:
            probe.runner(NS, clients=1, size=MIB, blocks=blocks, per_call=1)()
        assert "arena full" in str(info.value.__cause__)
        assert probe.backend.held() == peers_lmcache.SLACK // MIB  # what fitted is still there: none evicted
    finally:
        probe.close()
