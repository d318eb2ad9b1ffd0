"""`--plot DIR`: one PNG per suite with rows (kvtier vs baseline bars), drawn with matplotlib when it is
installed; a clear error, before anything runs, when it is not."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from kvtier.bench.plot import PlotUnavailable, plot_results, require_matplotlib
from kvtier.bench.report import Row, SuiteResult
from kvtier.cli import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _results() -> list[SuiteResult]:
    return [
        SuiteResult("alpha", [
            Row("put 2MiB", "throughput", "GB/s", 4.0, "memcpy", 6.0, 4 / 6),
            Row("get 2MiB", "throughput", "GB/s", 5.0, "memcpy", 5.5, 5 / 5.5),
            Row("lookup", "p50", "ms", 0.9, "ping", 0.35, 0.35 / 0.9),
        ]),
        SuiteResult("beta", [  # values over many decades (log axis) and a baseline this machine lacks
            Row("tiny", "throughput", "ops/s", 1e6, "raw", 10.0, 1e5),
            Row("no dd here", "throughput", "ops/s", 3.0, "dd", math.nan, math.nan),
        ]),
        SuiteResult("empty", []),
    ]


def test_one_png_per_suite_with_rows(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "charts" / "nested"
    paths = plot_results(_results(), out)
    assert paths == [out / "alpha.png", out / "beta.png"]  # the suite without rows gets no file
    for p in paths:
        data = p.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5_000


def test_cli_plot_writes_the_suites_chart(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main(["bench", "codecs", "--quick", "--repetitions", "1", "--working-set-mib", "1", "--tokens", "32",
                 "--codecs", "raw,int8", "--plot", str(tmp_path)]) == 0
    assert (tmp_path / "codecs.png").read_bytes().startswith(PNG_MAGIC)


def test_missing_matplotlib_is_a_clear_error_before_the_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as if not installed.
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match=r"pip install 'kvtier\[plot\]'"):
        require_matplotlib()
    with pytest.raises(PlotUnavailable):
        plot_results(_results(), tmp_path)
    out = tmp_path / "never.json"
    assert main(["bench", "codecs", "--quick", "--plot", str(tmp_path), "--json", str(out)]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not out.exists()  # refused up front: the suite never ran
    assert main(["bench", "all", "--suites", "codecs", "--plot", str(tmp_path), "--json", str(out)]) == 2
    assert not out.exists()
