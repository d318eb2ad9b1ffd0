"""`kvtier bench codecs` runs and writes the JSON form (speed is printed, never asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier_protocol.codecs import CODECS


def test_bench_codecs_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--quick", "--repetitions", "1", "--working-set-mib", "1",
                 "--tokens", "32", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "codecs"
    keys = {"case", "metric", "unit", "kvtier", "baseline_name", "baseline", "ratio",
            "kvtier_spread", "baseline_spread"}
    assert all(set(r) == keys for r in doc["rows"])
    rows = {(r["case"], r["metric"]): r for r in doc["rows"]}
    assert {c for c, _ in rows} == set(CODECS)
    assert rows[("int4", "size ratio")]["kvtier"] == pytest.approx(3.2)
    assert rows[("raw", "rel RMSE")]["kvtier"] == 0.0
    assert rows[("int8", "encode")]["baseline_name"] == "memcpy" and rows[("int8", "encode")]["kvtier"] > 0
