"""Benchmark results: rows, the stdout table and the JSON form shared by every `kvtier bench` suite.

JSON form (fixed across suites; tools parse it)::

    {"suite": str, "rows": [{"case": str, "metric": str, "unit": str, "kvtier": float,
                             "baseline_name": str, "baseline": float, "ratio": float,
                             "kvtier_spread": float, "baseline_spread": float}]}

``ratio`` is kvtier / baseline for throughputs ("higher is better" metrics) and
baseline / kvtier for latencies, so a ratio above 1 always means kvtier is ahead.
``*_spread`` is (max - min) / median of the repetitions, a fraction: how noisy the figure is.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TextIO


@dataclass(slots=True)
class Row:
    """One measured figure next to its baseline."""

    case: str
    metric: str
    unit: str
    kvtier: float
    baseline_name: str
    baseline: float
    ratio: float
    kvtier_spread: float = 0.0
    baseline_spread: float = 0.0


@dataclass(slots=True)
class SuiteResult:
    """All rows of one suite run."""

    suite: str
    rows: list[Row] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"suite": self.suite, "rows": [asdict(r) for r in self.rows]}


@dataclass(slots=True)
class Samples:
    """Repeated measurements of one quantity."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values) if self.values else math.nan

    @property
    def spread(self) -> float:
        med = self.median
        if not self.values or med == 0 or math.isnan(med):
            return 0.0
        return (max(self.values) - min(self.values)) / abs(med)


def throughput_row(case: str, metric: str, unit: str, kv: Samples, base_name: str, base: Samples) -> Row:
    """A row where higher is better (GB/s, ops/s): ratio = kvtier / baseline."""
    ratio = kv.median / base.median if base.median else math.nan
    return Row(case, metric, unit, kv.median, base_name, base.median, ratio, kv.spread, base.spread)


def latency_row(case: str, metric: str, unit: str, kv: Samples, base_name: str, base: Samples) -> Row:
    """A row where lower is better (ms, µs): ratio = baseline / kvtier."""
    ratio = base.median / kv.median if kv.median else math.nan
    return Row(case, metric, unit, kv.median, base_name, base.median, ratio, kv.spread, base.spread)


def alternate(
    kvtier_fn: Callable[[], float],
    baseline_fn: Callable[[], float],
    *,
    repetitions: int,
    warmup: int = 1,
) -> tuple[Samples, Samples]:
    """Run kvtier and the baseline alternately (ABAB…) after a warm-up, so drift and noise on a
    shared machine hit both alike. Each callable returns one measurement (e.g. GB/s)."""
    kv, base = alternate_many([kvtier_fn, baseline_fn], repetitions=repetitions, warmup=warmup)
    return kv, base


def alternate_many(fns: Sequence[Callable[[], float]], *, repetitions: int, warmup: int = 1) -> list[Samples]:
    """:func:`alternate` of several callables (kvtier and more than one baseline): each repetition
    runs every one once, the order rotating by one each time, so that none always runs first."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    out: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for i in range(repetitions):
        # With two callables: kvtier first on even repetitions, the baseline first on odd ones.
        for j in range(n):
            k = (j + i) % n
            out[k].append(fns[k]())
    return [Samples(v) for v in out]


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values`` by nearest rank (no interpolation: the p99 of a few calls
    is their slowest); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latencies_ms(fn: Callable[[], object], calls: int) -> list[float]:
    """Milliseconds of each of ``calls`` back-to-back calls of ``fn``."""
    out = []
    clock = time.perf_counter
    for _ in range(calls):
        start = clock()
        fn()
        out.append((clock() - start) * 1e3)
    return out


def ping_latency_rows(case: str, fn: Callable[[], object], ping: Callable[[], object], calls: int,
                      reps: int) -> list[Row]:
    """p50 and p99 rows of ``fn`` next to ``ping`` (the round trip every call pays), ``calls``
    back-to-back calls per repetition, the two alternating; quantiles per repetition, the first
    repetition (alternate()'s warm-up) left out."""
    p50s: dict[str, list[float]] = {"kv": [], "ping": []}
    p99s: dict[str, list[float]] = {"kv": [], "ping": []}

    def sample(kind: str, f: Callable[[], object]) -> Callable[[], float]:
        def once() -> float:
            lat = latencies_ms(f, calls)
            p50s[kind].append(quantile(lat, 0.50))
            p99s[kind].append(quantile(lat, 0.99))
            return p50s[kind][-1]
        return once

    alternate(sample("kv", fn), sample("ping", ping), repetitions=reps)
    return [latency_row(case, metric, "ms", Samples(by["kv"][1:]), "ping round trip, same socket",
                        Samples(by["ping"][1:]))  # [0]: alternate()'s warm-up
            for metric, by in (("p50", p50s), ("p99", p99s))]


def threads_label(threads: int) -> str:
    """``"1 thread"``, ``"2 threads"``: for baseline names and progress lines."""
    return f"{threads} thread{'s' if threads != 1 else ''}"


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal gigabytes per second."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.inf


class Timer:
    """`with Timer() as t: ...; t.seconds` using the monotonic performance counter."""

    __slots__ = ("start", "seconds")

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.start


def format_table(result: SuiteResult) -> str:
    """A fixed-width table of the rows, for stdout."""
    head = ("case", "metric", "unit", "kvtier", "baseline", "base value", "ratio", "spread k/b")
    lines = [head]
    for r in result.rows:
        lines.append(
            (
                r.case,
                r.metric,
                r.unit,
                f"{r.kvtier:.4g}",
                r.baseline_name,
                f"{r.baseline:.4g}",
                f"{r.ratio:.3f}",
                f"{r.kvtier_spread:.0%}/{r.baseline_spread:.0%}",
            )
        )
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    out = [f"suite: {result.suite}"]
    for n, row in enumerate(lines):
        out.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def emit(results: Sequence[SuiteResult], *, json_path: str | None, stream: TextIO | None = None) -> None:
    """Print every suite's table; write the JSON file when asked (one suite: the object itself,
    several: a list of them)."""
    stream = stream or sys.stdout  # looked up at call time, so pytest's capture sees the table
    for res in results:
        print(format_table(res), file=stream)
        print(file=stream)
    if json_path:
        payload = results[0].to_json() if len(results) == 1 else [r.to_json() for r in results]
        Path(json_path).write_text(json.dumps(payload, indent=2) + "\n")


_progress_start: float | None = None


def progress(msg: str) -> None:
    """One line of progress on stderr (stdout stays a clean table), stamped with the seconds since
    the first line of this process, so a reader sees which step is slow while it runs."""
    global _progress_start
    now = time.monotonic()
    if _progress_start is None:
        _progress_start = now
    print(f"[bench {now - _progress_start:6.1f} s] {msg}", file=sys.stderr, flush=True)
