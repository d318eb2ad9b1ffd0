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
    # the lz4 stage: a ratio per codec (lossless, so never below 1: sections it cannot shrink stay verbatim)
    for codec in CODECS:
        assert rows[(codec, "lz4 ratio")]["kvtier"] >= 1.0
        assert rows[(codec, "lz4 compress")]["kvtier"] > 0 and rows[(codec, "lz4 decompress")]["kvtier"] > 0


def test_bench_codecs_on_engine_kv_and_the_torch_path(tmp_path: Path) -> None:
    out = tmp_path / "codecs.json"
    assert main(["bench", "codecs", "--quick", "--repetitions", "1", "--working-set-mib", "1", "--tokens", "16",
                 "--kv", "engine", "--impl", "torch", "--codecs", "raw,int8", "--json", str(out)]) == 0
    rows = {(r["case"], r["metric"]): r for r in json.loads(out.read_text())["rows"]}
    assert rows[("raw", "rel RMSE")]["kvtier"] == 0.0
    assert 0.0 < rows[("int8", "rel RMSE")]["kvtier"] < 2.0  # percent, on the engine's K and V
