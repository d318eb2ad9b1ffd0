"""`kvtier bench store --quick` runs in-process and writes the report.py JSON form (no speed asserts)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import fields
from pathlib import Path

from kvtier.bench.report import Row
from kvtier.cli import main


def test_quick_store_bench_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "store.json"
    data = tmp_path / "data"
    assert main(["bench", "store", "--quick", "--json", str(out), "--data-dir", str(data)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "store"
    names = {f.name for f in fields(Row)}
    cases = [r["case"] for r in doc["rows"]]
    for size in (2, 8, 32):
        assert f"host put {size}MiB" in cases and f"host get {size}MiB" in cases
    assert any(c.startswith("disk write") for c in cases)
    assert any(c.startswith("disk read") and "cold" in c for c in cases)
    assert any(c.startswith("disk→host promote") for c in cases)
    for row in doc["rows"]:
        assert set(row) == names
        assert row["unit"] == "GB/s" and row["metric"] == "throughput"
        assert math.isfinite(row["kvtier"]) and row["kvtier"] > 0
        # dd's figure is NaN only where O_DIRECT is unsupported (e.g. tmpfs); the row stays.
        assert row["baseline"] > 0 or (row["baseline_name"].startswith("dd") and math.isnan(row["baseline"]))
        assert row["kvtier_spread"] >= 0 and row["baseline_spread"] >= 0
    assert os.listdir(data) == []  # the bench's databases and dd file are removed
