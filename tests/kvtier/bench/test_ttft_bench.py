"""`kvtier bench ttft --quick` runs in-process and writes the report.py JSON form (no speed asserts).

The suite itself checks that every hit loads exactly the stored prefix (it asserts on the loaded
token counts), so a passing run also means kvtier served each hit, through a real daemon.
"""

from __future__ import annotations

import json
import math
from dataclasses import fields
from pathlib import Path

import pytest

import kvtier.bench
from kvtier.bench.report import Row
from kvtier.cli import main

pytest.importorskip("transformers")


def test_quick_ttft_bench_writes_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if "ttft" not in kvtier.bench.SUITES:  # until the lead registers the suite
        monkeypatch.setitem(kvtier.bench.SUITES, "ttft", ("kvtier.bench.ttft", "time to first token"))
    out = tmp_path / "ttft.json"
    assert main(["bench", "ttft", "--quick", "--repetitions", "1", "--lengths", "128,256", "--suffix", "16,32",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "ttft"
    names = {f.name for f in fields(Row)}
    got = {(r["case"], r["metric"]) for r in doc["rows"]}
    want = {(f"{engine} {n} ({n - suffix} stored)", metric) for engine in ("engine", "hf") for n in (128, 256)
            for suffix in (16, 32) for metric in ("TTFT", "TTFT vs resident", "ceiling: resident vs prefill")}
    want |= {(f"engine {n} ({n // 2} stored, partial hit)", "TTFT layer-wise vs load-then-compute") for n in (128, 256)}
    assert got == want
    for row in doc["rows"]:
        assert set(row) == names and row["unit"] == "ms"
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0 and row["baseline"] > 0
        assert row["ratio"] == pytest.approx(row["baseline"] / row["kvtier"])
