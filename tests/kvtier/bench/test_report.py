"""The helpers every bench suite shares (kvtier/bench/report.py)."""

from __future__ import annotations

import math

from kvtier.bench.report import latencies_ms, quantile


def test_quantile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 51.0 and quantile(values, 0.99) == 100.0
    assert quantile([3.0], 0.99) == 3.0
    assert quantile(list(reversed(values)), 0.0) == 1.0
    assert math.isnan(quantile([], 0.5))


def test_latencies_are_one_per_call_in_milliseconds() -> None:
    calls = []
    lat = latencies_ms(lambda: calls.append(1), 7)
    assert len(lat) == 7 == len(calls)
    assert all(0 <= t < 1000 for t in lat)
