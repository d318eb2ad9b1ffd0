"""`kvtier bench precision --quick --parts demotion,zipf`: the store rows, raw next to int8 below host."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from kvtier.bench.precision import zipf_sequence
from kvtier.cli import main


def test_bench_precision_store_parts_write_json(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    assert main(["bench", "precision", "--quick", "--parts", "demotion,zipf", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "precision"
    keys = {"case", "metric", "unit", "kvtier", "baseline_name", "baseline", "ratio",
            "kvtier_spread", "baseline_spread"}
    assert all(set(r) == keys for r in doc["rows"])
    rows = {r["metric"]: r for r in doc["rows"]}
    assert set(rows) == {"demotion throughput int8", "tokens per GiB of disk int8", "hit rate int8",
                         "mean TTFT int8"}  # the capacity metric is in both parts
    assert not any(r["case"].startswith(("llama", "deepseek")) for r in doc["rows"])  # no quality part
    demotion = rows["demotion throughput int8"]
    assert demotion["kvtier"] > 0 and demotion["baseline"] > 0 and demotion["baseline_name"] == "raw demotion"
    for r in (r for r in doc["rows"] if r["metric"] == "tokens per GiB of disk int8"):
        assert r["kvtier"] > 1.5 * r["baseline"]  # int8 records: about half the bytes of raw ones
    hit = rows["hit rate int8"]
    # the tiers hold about half the raw working set: int8 below host holds more of it, never less
    assert 0.0 < hit["baseline"] < 100.0 and hit["kvtier"] >= hit["baseline"]
    assert rows["mean TTFT int8"]["kvtier"] > 0 and rows["mean TTFT int8"]["baseline"] > 0


def test_zipf_sequence_is_seeded_and_favours_the_first_documents() -> None:
    seq = zipf_sequence(50, 2000, 1.0, seed=3)
    assert seq == zipf_sequence(50, 2000, 1.0, seed=3) and len(seq) == 2000
    counts = Counter(seq)
    assert set(counts) <= set(range(50))
    assert counts[0] > counts[1] > counts[9] > 0  # weights 1, 1/2, 1/10 of 2000 draws: far apart
