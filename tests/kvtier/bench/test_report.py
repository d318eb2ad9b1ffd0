"""The helpers every bench suite shares (kvtier/bench/report.py)."""

from __future__ import annotations

import math

from kvtier.bench import report
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


def test_alternate_many_runs_each_once_a_repetition_in_rotating_order() -> None:
    calls: list[str] = []

    def fn(name: str, value: float):
        def once() -> float:
            calls.append(name)
            return value + len(calls)
        return once

    a, b, c = report.alternate_many([fn("a", 0), fn("b", 100), fn("c", 200)], repetitions=3, warmup=1)
    assert calls == ["a", "b", "c",  # the warm-up, not sampled
                     "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert a.values == [4, 9, 11] and b.values == [105, 107, 112] and c.values == [206, 208, 210]
    kv, base = report.alternate(fn("k", 0), fn("p", 0), repetitions=2, warmup=0)
    assert calls[-4:] == ["k", "p", "p", "k"]  # two callables: kvtier first, then the baseline first
