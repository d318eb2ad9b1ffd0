"""`kvtier bench gpu`: without CUDA a clean exit with no rows and a line saying why; ``--device cpu``
runs the suite's code on host memory (GPU tier and connector through a real daemon); on CUDA the
real figures (no speed asserts anywhere)."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from kvtier.bench.gpu import cuda_missing
from kvtier.bench.report import Row
from kvtier.cli import main

CASES = ["GPU tier copy_in from pinned host", "GPU tier copy_out to pinned host", "GPU tier device-to-device",
         "connector save (device→daemon)", "connector load (daemon→device)",
         "connector layer-wise save (device→daemon)", "connector layer-wise load (daemon→device)"]


@pytest.fixture
def short_dir() -> Iterator[Path]:
    base = Path(tempfile.mkdtemp(prefix="kvb-"))
    yield base
    shutil.rmtree(base, ignore_errors=True)


def _check_rows(doc: dict) -> None:
    assert doc["suite"] == "gpu"
    names = {f.name for f in fields(Row)}
    assert [r["case"].rsplit(",", 1)[0] for r in doc["rows"]] == CASES
    for row in doc["rows"]:
        assert set(row) == names and (row["metric"], row["unit"]) == ("throughput", "GB/s")
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["kvtier"] / row["baseline"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the suite measures instead")
def test_without_cuda_the_suite_says_why_and_returns_no_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--quick", "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"suite": "gpu", "rows": []}
    assert "gpu: skipped: CUDA is not available" in capsys.readouterr().err
    assert cuda_missing("cuda") is not None and cuda_missing("cpu") is None


def test_cpu_device_runs_every_row_through_the_code_path(short_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--device", "cpu", "--repetitions", "1", "--blocks", "2", "--layers", "1",
                 "--json", str(out), "--work-dir", str(short_dir)]) == 0
    _check_rows(json.loads(out.read_text()))  # the suite itself checks the bytes that came back
    assert list(short_dir.iterdir()) == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_quick_run_measures_every_row(short_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--quick", "--repetitions", "1", "--json", str(out),
                 "--work-dir", str(short_dir)]) == 0
    _check_rows(json.loads(out.read_text()))
