"""A `--quick` run of every CPU suite through `kvtier bench all`, each checked for the fixed JSON form
(report.py) — that each runs and reports, never how fast. Sizes are cut to the bone with
``--suite-args`` so the whole file stays well under a minute and a half on two shared cores.

Suites written by other sessions (peers, crash, soak, fuzz) are tested by name once their module
exists in this checkout; until then their test is skipped with that reason.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvtier.bench
from kvtier.cli import main


TINY: dict[str, str] = {
    "codecs": "--working-set-mib 1 --tokens 32 --codecs raw,int8",
    "store": "--sizes-mib 1 --working-set-mib 2 --disk-mib 2 --disk-block-mib 1 --batch-mib 2",
    "dataplane": "--sizes-mib 0.25 --working-set-mib 0.5 --batch-mib 0.5 --lookup-keys 8 --lookup-calls 5",
    "ttft": "--lengths 64 --suffix 32 --layers 1 --engines engine",
    "peers": "--sizes-mib 0.25 --clients 1 --working-set-mib 0.5 --min-calls 1",
    "lookup": "--prompt-tokens 1K --calls 5 --stored 1K,2K,3K --walks 2",
    "events": "--geometry 16/16 --events 128 --batch 64",
    "crash": "--kills 1 --phases flush",
    "soak": "--clients 2 --seconds 0.5 --host-mib 16 --disk-mib 32",
    "fuzz": "--inputs 200",
    "precision": "--tokens 4 --prefix-blocks 1 --chains raw,raw>int8 --dtypes bfloat16 --disk-codecs int8",
}
"""Every CPU suite and the flags that make its quick run tiny (gpu runs only where CUDA exists)."""

ROW_FIELDS = {"case": str, "metric": str, "unit": str, "kvtier": float, "baseline_name": str, "baseline": float,
              "ratio": float, "kvtier_spread": float, "baseline_spread": float}


def _present(name: str) -> bool:
    """Every suite this test sizes is registered and importable: a missing one fails, never skips."""
    assert name in kvtier.bench.SUITES, f"suite {name!r} is not registered in kvtier.bench.SUITES"
    module = kvtier.bench.SUITES[name][0]
    assert importlib.util.find_spec(module) is not None, f"suite {name!r}: module {module} not found"
    return True


@dataclass(slots=True)
class QuickRun:
    status: int
    docs: list[dict]
    out: str
    err: str


@pytest.fixture(scope="module")
def quick_all() -> Iterator[QuickRun]:
    """One `kvtier bench all --quick` of every present CPU suite plus gpu. A suite that fails there
    fails its own test below, not the others'."""
    work = Path(tempfile.mkdtemp(prefix="kvb-"))  # short: unix socket paths have at most 107 bytes
    suites = [name for name in TINY if _present(name)] + ["gpu"]
    argv = ["bench", "all", "--quick", "--repetitions", "1", "--suites", ",".join(suites),
            "--work-dir", str(work), "--json", str(work / "all.json")]
    for name in suites:
        flags = TINY.get(name, "") + (f" --data-dir {work}/store" if name == "store" else "")
        if flags.strip():
            argv += ["--suite-args", f"{name}={flags}"]
    with pytest.MonkeyPatch.context() as mp, _Capture() as cap:
        mp.setenv("TMPDIR", str(work))  # suites without --work-dir make their temp dirs here too
        status = main(argv)
    try:
        yield QuickRun(status, json.loads((work / "all.json").read_text()), cap.out, cap.err)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class _Capture:
    """stdout and stderr of an in-process CLI run (module-scoped, so capsys is not available)."""

    def __enter__(self) -> "_Capture":
        import contextlib
        import io

        self._out, self._err = io.StringIO(), io.StringIO()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(contextlib.redirect_stdout(self._out))
        self._stack.enter_context(contextlib.redirect_stderr(self._err))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()
        self.out, self.err = self._out.getvalue(), self._err.getvalue()


@pytest.mark.parametrize("name", list(TINY))
def test_suite_runs_quick_and_reports_the_fixed_form(name: str, quick_all: QuickRun) -> None:
    assert _present(name)
    out = quick_all.out
    assert f"FAILED {name}:" not in out, quick_all.err[-6000:]
    doc = next((d for d in quick_all.docs if d["suite"] == name), None)
    assert doc is not None, f"{name} missing from the JSON list:\n{quick_all.err[-3000:]}"
    assert set(doc) == {"suite", "rows"} and doc["rows"], f"{name} reported no rows"
    for row in doc["rows"]:
        assert set(row) == set(ROW_FIELDS), row
        for key, kind in ROW_FIELDS.items():
            assert isinstance(row[key], int if kind is float and isinstance(row[key], int) else kind), (key, row)
        assert row["kvtier_spread"] >= 0 and row["baseline_spread"] >= 0
        assert f"{name}: {row['case']}" in out  # one combined table, each case under its suite


def test_all_lists_suites_in_order_and_says_why_gpu_was_skipped(quick_all: QuickRun) -> None:
    import torch

    out, err = quick_all.out, quick_all.err
    ran = [d["suite"] for d in quick_all.docs]
    assert quick_all.status == (1 if "\nFAILED " in out else 0)  # 1 exactly when a suite failed
    assert ran == [s for s in kvtier.bench.SUITES if s in ran]  # registry order
    assert out.startswith("suite: all\n")
    assert re.search(r"^\[bench +\d+\.\d s\] all: \[1/", err, re.M) and " done in " in err  # progress, stamped
    if torch.cuda.is_available():
        assert "gpu" in ran
    else:
        assert "gpu" not in ran and "skipped gpu: CUDA is not available" in out


def test_unknown_or_absent_suites(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                  tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="unknown suite"):
        main(["bench", "all", "--suites", "nope"])
    with pytest.raises(SystemExit, match="SUITE=FLAGS"):
        main(["bench", "all", "--suite-args", "lookup --calls 3"])
    monkeypatch.setitem(kvtier.bench.SUITES, "ghost", ("kvtier.bench.ghost_suite_not_written", "a suite not built"))
    out = tmp_path / "all.json"
    assert main(["bench", "all", "--suites", "ghost", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == []
    assert "skipped ghost: kvtier.bench.ghost_suite_not_written is not in this installation" in capsys.readouterr().out
