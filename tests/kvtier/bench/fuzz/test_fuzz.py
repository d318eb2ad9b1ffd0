"""`kvtier bench fuzz` at CI size: every decoder target, a few hundred inputs, no crash or hang.

(The full run, 100,000 inputs per decoder, is ``kvtier bench fuzz``; figures in the closing note.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvtier.bench.fuzz import suite as fuzz
from kvtier.bench.fuzz.engine import fuzz_target
from kvtier.bench.fuzz.targets import build_targets

TARGETS = {t.name: t for t in build_targets()}


@pytest.mark.parametrize("name", list(TARGETS))
def test_target_has_no_crash_or_hang(name: str) -> None:
    target = TARGETS[name]
    stats = fuzz_target(target, 150, seed=11, bound_s=5.0)
    assert stats.inputs == 150, f"only {stats.inputs} inputs reached {name} ({stats.skipped} skipped)"
    assert stats.typed > 0, "the fuzzer produces inputs the decoder must refuse"
    assert (stats.crashes, stats.hangs) == (0, 0), "\n\n".join(f.trace or f.error for f in stats.findings)


def test_seeds_are_accepted() -> None:
    """The golden vectors decode: the fuzzers start from valid inputs (the frame vectors hold one
    error response, which parse_response raises as its typed error)."""
    for name in ("frames.decode_frame", "header.decode_header", "events.decode_batch", "namespace.from_wire"):
        target = TARGETS[name]
        assert target.seeds, name
        stats = fuzz_target(target, 0, seed=0)
        assert stats.accepted + stats.errors.get("not_found", 0) == len(target.seeds), (name, stats.errors)


def test_suite_rows(tmp_path: Path) -> None:
    args = argparse.Namespace(quick=True, inputs=40, seed=3, bound_ms=5000.0, targets="frames.FrameDecoder,cli.size",
                              findings=str(tmp_path / "findings"), repetitions=None, json=None)
    result = fuzz.run(args)
    assert [(r.case, r.metric) for r in result.rows][:4] == [("frames.FrameDecoder", m)
                                                               for m in ("inputs", "crashes", "hangs", "slowest")]
    by = {(r.case, r.metric): r for r in result.rows}
    assert by["cli.size", "inputs"].kvtier == 40 and by["cli.size", "crashes"].kvtier == 0
    assert result.to_json()["suite"] == "fuzz"


def test_a_crash_is_found_and_written(tmp_path: Path) -> None:
    """The harness itself: a decoder that raises a plain exception is reported with a reproducer."""
    from kvtier.bench.fuzz.targets import Target

    def bad(data: bytes) -> None:
        if len(data) > 3:
            raise TypeError("boom")
    stats = fuzz_target(Target("bad", bad, [b"abcdef"]), 50, seed=1)
    assert stats.crashes > 0 and stats.findings[0].kind == "crash"
    fuzz.write_findings(tmp_path, stats)
    assert any(p.suffix == ".bin" for p in tmp_path.iterdir())
    assert "TypeError: boom" in next(p for p in tmp_path.iterdir() if p.suffix == ".txt").read_text()


def test_a_hang_is_cut_at_the_bound() -> None:
    from kvtier.bench.fuzz.targets import Target

    def slow(data: bytes) -> None:
        while len(data) > 4:
            pass
    stats = fuzz_target(Target("slow", slow, [b"abcdef"]), 3, seed=1, bound_s=0.05)
    assert stats.hangs >= 1


MIN_ACCEPTED_SHARE = 0.02
"""Of a target's inputs in the quick run (seed 0, as ``kvtier bench fuzz --quick``), at least this
share must decode: a target whose generator never reaches its decoder's accepting path fuzzes
only the first check (``events.zmq_frames`` and ``keys`` once accepted none)."""


@pytest.mark.parametrize("name", list(TARGETS))
def test_target_accepts_a_share_of_its_inputs(name: str) -> None:
    stats = fuzz_target(TARGETS[name], 300, seed=0, bound_s=5.0)
    assert stats.inputs == 300
    share = stats.accepted / stats.inputs
    assert share >= MIN_ACCEPTED_SHARE, f"{name}: {stats.accepted} of {stats.inputs} accepted, errors {stats.errors}"
