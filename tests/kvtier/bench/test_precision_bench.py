"""`kvtier bench precision --quick --parts quality` runs, writes the JSON form, and its raw chain is exact."""

from __future__ import annotations

import json
from pathlib import Path

from kvtier.cli import main


def test_bench_precision_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    assert main(["bench", "precision", "--quick", "--tokens", "6", "--prefix-blocks", "2",
                 "--chains", "raw,raw>int8,int4", "--parts", "quality", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "precision"
    keys = {"case", "metric", "unit", "kvtier", "baseline_name", "baseline", "ratio",
            "kvtier_spread", "baseline_spread"}
    assert all(set(r) == keys for r in doc["rows"])
    rows = {(r["case"], r["metric"]): r["kvtier"] for r in doc["rows"]}
    for model in ("llama-gqa", "deepseek-v2-mla"):
        # the LM head was scaled until the distribution is peaked enough to show errors
        assert rows[(model, "entropy")] < 2.0 and rows[(model, "lm head scale")] >= 1.0
        # the raw chain is a lossless round trip through block records: identical logits
        assert rows[(f"{model} raw", "top-1 agreement")] == 100.0
        assert rows[(f"{model} raw", "KL to raw")] == 0.0
        assert rows[(f"{model} raw", "max logit error")] == 0.0
        for chain in ("raw>int8", "int4"):
            assert 0.0 <= rows[(f"{model} {chain}", "top-1 agreement")] <= 100.0
            assert rows[(f"{model} {chain}", "KL to raw")] >= 0.0
        # int4 holds more tokens per GiB than int8, which holds more than raw
        assert (rows[(f"{model} int4", "tokens per GiB")] > rows[(f"{model} raw>int8", "tokens per GiB")]
                > rows[(f"{model} raw", "tokens per GiB")])
