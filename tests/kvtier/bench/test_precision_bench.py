"""`kvtier bench precision --quick --parts quality` runs, writes the JSON form, and its raw chain is exact."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from kvtier.bench.precision import nudge_ulp
from kvtier.cli import main


def test_bench_precision_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    assert main(["bench", "precision", "--quick", "--tokens", "6", "--prefix-blocks", "2",
                 "--chains", "raw,ulp,raw>int8,int4", "--parts", "quality", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "precision"
    keys = {"case", "metric", "unit", "kvtier", "baseline_name", "baseline", "ratio",
            "kvtier_spread", "baseline_spread"}
    assert all(set(r) == keys for r in doc["rows"])
    rows = {(r["case"], r["metric"]): r for r in doc["rows"]}
    value = {k: r["kvtier"] for k, r in rows.items()}
    for model in ("llama-gqa bf16", "deepseek-v2-mla bf16", "llama-gqa f32", "deepseek-v2-mla f32"):
        # the LM head was scaled until the distribution is peaked enough to show errors
        assert value[(model, "entropy")] < 2.0 and value[(model, "lm head scale")] >= 1.0
        # the raw chain is a lossless round trip through block records: identical logits
        assert value[(f"{model} raw", "top-1 agreement")] == 100.0
        assert value[(f"{model} raw", "KL to raw")] == 0.0
        assert value[(f"{model} raw", "max logit error")] == 0.0
        # one ulp of the dtype moves the logits (a floor above zero) and is the baseline of the
        # lossy chains' floor rows
        floor = value[(f"{model} ulp", "KL to raw")]
        assert floor > 0.0
        for chain in ("raw>int8", "int4"):
            assert 0.0 <= value[(f"{model} {chain}", "top-1 agreement")] <= 100.0
            kl = value[(f"{model} {chain}", "KL to raw")]
            assert kl >= 0.0
            over = rows[(f"{model} {chain}", "KL over the ulp floor")]
            assert over["kvtier"] == kl and over["baseline"] == floor
        assert (f"{model} ulp", "KL over the ulp floor") not in rows
        # int4 holds more tokens per GiB than int8, which holds more than raw (and ulp, a raw block)
        assert (value[(f"{model} int4", "tokens per GiB")] > value[(f"{model} raw>int8", "tokens per GiB")]
                > value[(f"{model} raw", "tokens per GiB")])


def test_nudge_ulp_moves_elements_by_one_ulp_and_keeps_the_rest() -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.tensor([0.0, -0.0, 1.0, -1.0, 3.5, -1e-3, float("inf"), float("nan"),
                          torch.finfo(dtype).max, torch.finfo(dtype).tiny] * 50, dtype=dtype)
        y = nudge_ulp(x, seed=1)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(y.view(bits), nudge_ulp(x, seed=1).view(bits))  # seeded (bits: NaN != NaN)
        fixed = (x == 0) | ~torch.isfinite(x) | (x.abs() == torch.finfo(dtype).max)
        assert torch.equal(y[fixed & ~x.isnan()], x[fixed & ~x.isnan()]) and bool(y[x.isnan()].isnan().all())
        assert torch.equal(torch.signbit(y[~fixed]), torch.signbit(x[~fixed]))  # same sign
        xs, ys = x[~fixed].double(), y[~fixed].double()
        moved = xs != ys
        # about half moved (500 elements: far from 0 or all), each to an adjacent value of the dtype
        assert 0.3 < float(moved.double().mean()) < 0.7
        up = torch.nextafter(x[~fixed], torch.full_like(x[~fixed], math.inf)).double()
        down = torch.nextafter(x[~fixed], torch.full_like(x[~fixed], -math.inf)).double()
        assert bool(((ys == xs) | (ys == up) | (ys == down)).all())
