"""The soak's figures and the rows made of them (the suite's JSON form), and which invariants failed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.report import Row, Samples, SuiteResult, latency_row, quantile
from kvtier.bench.soak.proc import Sampler
from kvtier.bench.soak.worker import OPS

MIB = 1 << 20
MUST_BE_ZERO = "must be 0"
BOUND = "bound: "  # prefix of the baseline name of a bound row (ratio = bound / value)
RSS_SLACK = 0.10  # the daemon may grow its private memory by this fraction of its RAM tiers
"""Beyond what :meth:`Figures.rss_bound` counts by name: Python's and malloc's own working set."""
COMPARED_FDS = ("socket", "shm", "pipe", "anon_inode", "deleted", "other")
"""Descriptor kinds that must be back to their count before the clients came. The disk tier's
files are not among them: RocksDB opens and closes them as it flushes and compacts."""


@dataclass(slots=True)
class Figures:
    """Everything measured around one soak (filled by :class:`kvtier.bench.soak.suite.Run`)."""

    idle_private: int = 0  # RssAnon + RssFile of the daemon when it was ready, before any client
    disk_tier_ram: int = 0  # what the disk tier is sized to keep in RAM (see rss_bound)
    in_flight: int = 0  # payload bytes of one request per client at once (see rss_bound)
    idle_memory: dict[str, int] = field(default_factory=dict)  # /proc status fields then, bytes
    idle_ping_ms: list[float] = field(default_factory=list)
    stats_before: dict[str, Any] = field(default_factory=dict)  # REST /v1/stats before the clients
    stats_after: dict[str, Any] = field(default_factory=dict)  # ... once they had all gone
    fds_before: dict[str, int] = field(default_factory=dict)
    fds_after: dict[str, int] = field(default_factory=dict)
    sampler: Sampler | None = None
    workers: list[dict[str, Any]] = field(default_factory=list)  # soak_worker results
    elapsed: float = 0.0
    memory_end: dict[str, int] = field(default_factory=dict)  # /proc status fields, bytes
    exit_status: int | None = None
    shm_left: list[str] = field(default_factory=list)
    log_errors: list[str] = field(default_factory=list)
    log_checksums: list[str] = field(default_factory=list)  # the daemon's word on each checksum failure

    def kind(self, op: str) -> dict[str, Any]:
        """One operation's statistics, summed over the worker processes."""
        out: dict[str, Any] = {"ops": 0, "errors": 0, "samples": [], "latencies_ms": []}
        for w in self.workers:
            k = w["kinds"][op]
            for name, value in k.items():
                if isinstance(value, list):
                    out.setdefault(name, []).extend(value)
                else:
                    out[name] = out.get(name, 0) + value
        return out

    def leaked_daemon_fds(self) -> int:
        return sum(max(0, self.fds_after.get(k, 0) - self.fds_before.get(k, 0)) for k in COMPARED_FDS)

    def leaked_client_fds(self) -> int:
        return sum(max(0, w["fds_after"] - w["fds_before"]) for w in self.workers)

    def leaked_client_maps(self) -> int:
        return sum(max(0, w["shm_maps_after"] - w["shm_maps_before"]) for w in self.workers)

    def rss_bound(self, ram_tiers: int) -> int:
        """The most the daemon's RSS may reach: its private RSS when idle, plus what it is sized
        or asked to hold beyond that, plus :data:`RSS_SLACK` of its RAM tiers:

        * ``ram_tiers``: the host tier's shared memory (pre-faulted, so in its RSS from the start);
        * :attr:`disk_tier_ram`: the disk tier's buffers, sized from the host tier by
          :func:`kvtier.daemon.store.disk_ram.ram_budget`: two RocksDB memtables (the active one
          and one being flushed), RocksDB's block cache (a memtable's size) and the aligned
          buffer pool kept for reuse. They fill only once the disk tier has worked, after idle;
        * :attr:`in_flight`: every client's request under way at once, each holding the payload
          of one prefix in the daemon (records read for a TCP get or from disk, received for a TCP
          put); malloc keeps what they freed for the next ones.

        What is left to the slack is the interpreter's and malloc's working set. At the full
        run's 1 GiB host tier the named parts are small beside the slack; at ``--quick``'s
        64 MiB they are larger than it (measured: ~13 MiB above idle with 8 clients, flat from
        the first minute on)."""
        return int(self.idle_private + (1 + RSS_SLACK) * ram_tiers + self.disk_tier_ram + self.in_flight)

    def counter(self, name: str, *, window: bool = False) -> int:
        after = self.stats_after["counters"][name]
        return after - self.stats_before["counters"][name] if window else after

    def tier_counter(self, tier: str, name: str) -> int:
        return self.stats_after["counters"]["tiers"][tier][name] - self.stats_before["counters"]["tiers"][tier][name]

    def summary(self) -> list[str]:
        """Human-readable lines for stderr: what the rows do not show."""
        lines = []
        for op in (*OPS, "client warnings"):
            k = self.kind(op)
            lines.append(f"{op}: {k['ops']} ops, {k['errors']} errors" +
                         (f" (first: {k['samples'][:3]})" if k["samples"] else ""))
        mem, peak = self.memory_end, (self.sampler.peak if self.sampler else {})
        lines.append("daemon memory at the end (MiB): " + ", ".join(f"{n} {v / MIB:.1f}" for n, v in mem.items()))
        lines.append("daemon memory peaks sampled (MiB): " + ", ".join(f"{n} {v / MIB:.1f}" for n, v in peak.items()))
        lines.append(f"daemon private RSS when idle: {self.idle_private / MIB:.1f} MiB; disk tier RAM "
                     f"{self.disk_tier_ram / MIB:.1f} MiB; in-flight payloads {self.in_flight / MIB:.1f} MiB")
        lines.append("daemon memory when idle (MiB): " + ", ".join(f"{n} {v / MIB:.1f}" for n, v in self.idle_memory.items()))
        lines.append(f"daemon descriptors before: {self.fds_before}; after: {self.fds_after}")
        lines.append(f"client descriptors before/after per process: "
                     f"{[(w['fds_before'], w['fds_after']) for w in self.workers]}")
        if self.sampler is not None:
            secs = self.sampler.seconds
            lines.append(f"per-second (host evictions, disk evictions, commits): {secs}")
            lines += [f"sampler error: {e}" for e in self.sampler.errors]
        lines += [f"daemon log: {ln[:300]}" for ln in self.log_errors[:5] + self.log_checksums[:5]]
        return lines


def _must_be_zero(case: str, metric: str, unit: str, value: float) -> Row:
    return Row(case, metric, unit, value, MUST_BE_ZERO, 0.0, 1.0 if value == 0 else 0.0)


def _count(case: str, metric: str, value: float, base_name: str, base: float) -> Row:
    return Row(case, metric, "count", value, base_name, base, value / base if base else math.nan)


def _op_rows(fig: Figures, op: str, seconds: float, total_ops: int, ping_ms: list[float]) -> list[Row]:
    k = fig.kind(op)
    rate = k["ops"] / seconds
    out = [Row(op, "operations", "count", k["ops"], "errors (must be 0)", k["errors"],
               1.0 if k["errors"] == 0 else 0.0),
           Row(op, "throughput", "ops/s", rate, "all operations", total_ops / seconds,
               rate * seconds / total_ops if total_ops else math.nan)]
    base_name, base = ("ping, idle daemon, 1 client", fig.idle_ping_ms) if op == "ping" else \
        ("ping under the same load", ping_ms)
    for metric, q in (("p50", 0.50), ("p99", 0.99)):
        out.append(latency_row(op, metric, "ms", Samples([quantile(k["latencies_ms"], q)]), base_name,
                               Samples([quantile(base, q)])))
    if op == "save":
        sent = k["stored"] + k["exists"] + k["full"]
        out += [_count(op, "blocks stored", k["stored"], "blocks sent", sent),
                _count(op, "blocks already there (exists)", k["exists"], "blocks sent", sent),
                _count(op, "blocks refused (full)", k["full"], "blocks sent", sent)]
    elif op in ("lookup", "load", "load_into"):
        out.append(_count(op, "blocks hit", k["blocks_hit"], "blocks asked", k["blocks_asked"]))
    return out


def rows(clients: int, seconds: float, ram_tiers: int, fig: Figures) -> list[Row]:
    """The suite's rows (see :mod:`kvtier.bench.soak.suite` for what each means)."""
    total_ops = sum(fig.kind(op)["ops"] for op in OPS)
    errors = sum(fig.kind(op)["errors"] for op in (*OPS, "client warnings"))
    ping_ms = fig.kind("ping")["latencies_ms"]
    out: list[Row] = []
    for op in OPS:
        out += _op_rows(fig, op, seconds, total_ops, ping_ms)
    gauges = fig.stats_after["gauges"]
    out += [
        _must_be_zero(f"all operations, {clients} clients x {seconds:g} s", "errors", "count", errors),
        _must_be_zero("daemon", "checksum failures", "count", fig.counter("checksum_failures")),
        _must_be_zero("daemon", "storage errors", "count", fig.counter("storage_errors")),
        _must_be_zero("daemon", "ERROR lines in its log", "count", len(fig.log_errors)),
        _must_be_zero("daemon", "lease expiries", "count", fig.counter("lease_expiries")),
        _must_be_zero("afterwards", "open leases", "count", gauges["leases"]),
        _must_be_zero("afterwards", "pending reservations", "count", gauges["pending"]),
        _must_be_zero("afterwards", "daemon descriptors leaked", "count", fig.leaked_daemon_fds()),
        _must_be_zero("afterwards", "client descriptors leaked", "count", fig.leaked_client_fds()),
        _must_be_zero("afterwards", "client segment mappings leaked", "count", fig.leaked_client_maps()),
        _must_be_zero("after stop", "shm segments left in /dev/shm", "count", len(fig.shm_left)),
        _must_be_zero("after stop", "daemon exit status", "code", fig.exit_status if fig.exit_status is not None else -1),
    ]
    peak = fig.memory_end.get("VmHWM", 0)
    bound = fig.rss_bound(ram_tiers)
    shmem = (fig.sampler.peak if fig.sampler else {}).get("RssShmem", 0)
    out += [
        Row("daemon RSS peak (VmHWM)", "rss", "MiB", peak / MIB,
            f"{BOUND}idle private RSS + {1 + RSS_SLACK:g} x host tier + disk tier RAM + in-flight payloads",
            bound / MIB, bound / peak if peak else 0.0),
        Row("daemon RSS, shared memory part (RssShmem peak)", "rss", "MiB", shmem / MIB, f"{BOUND}host tier",
            ram_tiers / MIB, ram_tiers / shmem if shmem else math.inf),
    ]
    secs = fig.sampler.seconds if fig.sampler else []
    for i, tier in enumerate(("host", "disk")):
        out.append(_count(f"{tier} tier evictions", "seconds with evictions", sum(1 for s in secs if s[i] > 0),
                          "seconds sampled", len(secs)))
        out.append(_count(f"{tier} tier evictions", "blocks evicted", fig.tier_counter(tier, "evictions"),
                          "blocks committed", fig.counter("commits", window=True)))
    return out


def violations(result: SuiteResult) -> list[str]:
    """The invariant and bound rows that do not hold, as ``case: metric = value`` strings."""
    bad = []
    for r in result.rows:
        holds = r.ratio >= 1.0
        if r.baseline_name.startswith(BOUND) and not holds:
            bad.append(f"{r.case}: {r.metric} = {r.kvtier:.1f} {r.unit} > {r.baseline:.1f}")
        elif (r.baseline_name == MUST_BE_ZERO or r.metric == "operations") and not holds:
            bad.append(f"{r.case}: {r.metric} = {r.kvtier:g}" if r.metric != "operations"
                       else f"{r.case}: {r.baseline:g} errors")
    return bad
