"""Prometheus metrics of the daemon: request counters and latencies, store state read at scrape.

Names are ``kvtier_*`` with unit suffixes. The daemon's own events (requests, lookups, published
KV events, connections) are prometheus-client instruments updated as they happen; the store's
counters and gauges are read from ``ctx.store.counters`` / ``ctx.store.gauges()`` at each scrape
by :class:`StoreCollector` (aesthetics convention 11: counters stay plain dataclasses, exported only
at the edge). :data:`STORE_COUNTERS`, :data:`TIER_COUNTERS` and the gauge tables map each field
of kvtier/daemon/store/stats.py to one metric, so exporting a new store counter is one line.

Every store metric carries a ``tenant`` label: the tenant's name for a tenant's store, ``""``
for the default store (Prometheus treats an empty label as absent, so queries written before
tenants existed still select the default store). Which tenants' series a scrape shows is the
caller's choice (:meth:`Metrics.render`): the REST ``/metrics`` route shows only the default
store's to a scrape without a token unless ``rest.public_tenant_metrics`` is set, so tenant names
and activity are no more public there than in hello or the REST store routes.

GPU memory and utilisation come from NVML (nvidia-ml-py) when a GPU is present; without one (or
without the driver library) those metrics are simply absent. Nothing here carries a secret: no
label holds a token, a tenant salt or a namespace.
"""

from __future__ import annotations

import gc
import itertools
import logging
import re
import time
from bisect import bisect_left
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvtier import __version__
from kvtier.daemon.server.collector import PAUSE_BUCKETS, CollectorPolicy
from kvtier.daemon.server.remote_views import remote_metrics
from kvtier.daemon.store.types import Tier

if TYPE_CHECKING:
    from kvtier.daemon.server.context import DaemonContext

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Request latency buckets, 50 µs to 5 s: shared-memory gets land in the first ones, cold disk
reads of large blocks in the last."""

STORE_TIERS = (Tier.GPU, Tier.HOST, Tier.DISK)
_MAX_LABEL_PAIRS = 4096  # (op, status) pairs whose children are kept; more are resolved each time
_LABEL = re.compile(r"[a-z0-9_]{1,40}")


@dataclass(frozen=True, slots=True)
class Exported:
    """One store field exported as one metric family.

    Attributes:
        field: attribute name in kvtier/daemon/store/stats.py.
        name: metric name without the ``_total`` suffix prometheus-client adds to counters.
        doc: HELP text.
    """

    field: str
    name: str
    doc: str


STORE_COUNTERS: tuple[Exported, ...] = (
    Exported("lookups", "kvtier_store_lookups", "Lookup calls answered by the store."),
    Exported("lookup_keys", "kvtier_store_lookup_keys", "Block keys asked by lookup calls."),
    Exported("lookup_hits", "kvtier_store_lookup_hit_keys", "Block keys found (consecutive prefix) by lookups."),
    Exported("commits", "kvtier_commits", "Blocks made visible by commit."),
    Exported("promotions", "kvtier_promotions", "Blocks copied up into host memory on a hit (disk to host)."),
    Exported("demotions", "kvtier_demotions", "Evicted blocks copied down into the next tier, all tiers."),
    Exported("write_throughs", "kvtier_write_throughs", "Blocks written to disk at commit time."),
    Exported("admission_rejects", "kvtier_admission_rejects", "Evicted host blocks the disk admission filter refused."),
    Exported("checksum_failures", "kvtier_checksum_failures", "Blocks dropped because their bytes failed the checksum."),
    Exported("storage_errors", "kvtier_storage_errors", "Disk reads or writes that failed with an I/O error."),
    Exported("lease_expiries", "kvtier_lease_expiries", "Leases reclaimed because their time ran out."),
    Exported("deletes", "kvtier_deletes", "Blocks removed by delete or clear."),
    Exported("events_dropped", "kvtier_store_events_dropped", "Store events discarded because nobody took them."),
    Exported("disk_meta_rebuilds", "kvtier_disk_meta_rebuilds", "Disk tier metadata found damaged at start, rebuilt."),
)
"""Store-wide counters of ``StoreCounters`` (its ``tiers`` map is :data:`TIER_COUNTERS`)."""

TIER_COUNTERS: tuple[Exported, ...] = (
    Exported("hits", "kvtier_tier_hits", "Blocks served from this tier."),
    Exported("misses", "kvtier_tier_misses", "Blocks looked for in this tier and not found there."),
    Exported("bytes_in", "kvtier_tier_written_bytes", "Bytes written into this tier."),
    Exported("bytes_out", "kvtier_tier_read_bytes", "Bytes read out of this tier."),
    Exported("evictions", "kvtier_tier_evictions", "Blocks evicted from this tier to make room."),
    Exported("demotions", "kvtier_tier_demotions", "Blocks evicted from this tier and copied down."),
    Exported("recoded", "kvtier_tier_recoded_blocks", "Blocks re-encoded into this tier's lossy codec on their way in."),
    Exported("recoded_saved_bytes", "kvtier_tier_recoded_saved_bytes",
             "Payload bytes the re-encodings into this tier saved (raw minus stored)."),
    Exported("recode_seconds", "kvtier_tier_recode_seconds", "CPU seconds spent re-encoding blocks for this tier."),
)
"""Per-tier counters of ``TierCounters``, labelled ``tier``."""

TIER_GAUGES: tuple[Exported, ...] = (
    Exported("capacity_bytes", "kvtier_tier_capacity_bytes", "Configured byte budget of the tier (0: off)."),
    Exported("used_bytes", "kvtier_tier_used_bytes", "Bytes in use in the tier, pending reservations included."),
    Exported("blocks", "kvtier_tier_blocks", "Blocks with a copy in the tier."),
)
"""Per-tier gauges of ``TierGauges``, labelled ``tier``."""

STORE_GAUGES: tuple[Exported, ...] = (
    Exported("blocks", "kvtier_blocks", "Distinct visible blocks."),
    Exported("pending", "kvtier_pending_blocks", "Blocks reserved, or slots granted, and not yet committed."),
    Exported("leases", "kvtier_leases", "Open leases."),
    Exported("fragmentation", "kvtier_host_fragmentation_ratio",
             "Host allocator internal fragmentation: 1 - requested / allocated bytes."),
)
"""Store-wide gauges of ``StoreGauges`` (its ``tiers`` map is :data:`TIER_GAUGES`)."""

GPU_METRIC_NAMES = ("kvtier_gpu_memory_used_bytes", "kvtier_gpu_memory_total_bytes", "kvtier_gpu_utilization_ratio")
"""Exported only where NVML finds a GPU."""


def tier_label(tier: Tier) -> str:
    """The ``tier`` label value: ``gpu``, ``host`` or ``disk``."""
    return tier.name.lower()


def _label(value: str) -> str:
    # Label values come from callers (op names, error codes); an unexpected one must not create
    # unbounded series or odd characters in the exposition.
    return value if isinstance(value, str) and _LABEL.fullmatch(value) else "other"


class StoreCollector(Collector):
    """Reads the bound stores' counters and gauges at each scrape (the default store and every
    tenant's, label ``tenant``); yields nothing until bound."""

    def __init__(self) -> None:
        self.ctx: DaemonContext | None = None
        self.tenants: frozenset[str | None] | None = None  # the stores shown (None: the default); None: all

    def collect(self) -> Iterator[Metric]:
        ctx = self.ctx
        if ctx is None:
            return
        shown = self.tenants
        stores = [(scope.label, scope.store.counters, scope.store.gauges()) for scope in ctx.scopes()
                  if shown is None or scope.tenant in shown]
        for e in STORE_COUNTERS:
            fam = CounterMetricFamily(e.name, e.doc, labels=["tenant"])
            for tenant, counters, _ in stores:
                fam.add_metric([tenant], getattr(counters, e.field))
            yield fam
        for e in TIER_COUNTERS:
            fam = CounterMetricFamily(e.name, e.doc, labels=["tenant", "tier"])
            for tenant, counters, _ in stores:
                for tier in STORE_TIERS:
                    fam.add_metric([tenant, tier_label(tier)], getattr(counters.tiers[tier], e.field))
            yield fam
        for e in STORE_GAUGES:
            fam = GaugeMetricFamily(e.name, e.doc, labels=["tenant"])
            for tenant, _, gauges in stores:
                fam.add_metric([tenant], getattr(gauges, e.field))
            yield fam
        for e in TIER_GAUGES:
            fam = GaugeMetricFamily(e.name, e.doc, labels=["tenant", "tier"])
            for tenant, _, gauges in stores:
                for tier in STORE_TIERS:
                    if tier in gauges.tiers:
                        fam.add_metric([tenant, tier_label(tier)], getattr(gauges.tiers[tier], e.field))
            yield fam
        yield from remote_metrics([(scope.label, scope.store.remote) for scope in ctx.scopes()
                                   if shown is None or scope.tenant in shown])
        yield GaugeMetricFamily("kvtier_ready", "1 once the daemon serves, 0 while starting or stopping.",
                                value=1.0 if ctx.ready else 0.0)


class GcCollector(Collector):
    """The garbage collector's pauses (:mod:`kvtier.daemon.server.collector`), read at each scrape;
    yields nothing until a policy is watched."""

    def __init__(self) -> None:
        self.policy: CollectorPolicy | None = None

    def collect(self) -> Iterator[Metric]:
        policy = self.policy
        if policy is None:
            return
        bounds = [floatToGoString(b) for b in PAUSE_BUCKETS] + ["+Inf"]
        pauses = HistogramMetricFamily("kvtier_gc_pause_seconds", "Collections of CPython's cyclic garbage "
                                       "collector (the whole daemon waits), by generation.", labels=["generation"])
        for generation, p in enumerate(policy.pauses):
            counts = list(itertools.accumulate(list(p.buckets)))  # a copy: a collection may add meanwhile
            pauses.add_metric([str(generation)], list(zip(bounds, counts)), p.total_s)
        yield pauses
        yield GaugeMetricFamily("kvtier_gc_frozen_objects", "Objects frozen out of the collector's walks.",
                                value=float(gc.get_freeze_count()))
        yield CounterMetricFamily("kvtier_gc_freezes", "Freezes of the objects surviving a collection.",
                                  value=float(policy.freezes))


class GpuCollector(Collector):
    """GPU memory and utilisation through NVML, per device index (label ``gpu``).

    Args:
        nvml: the ``pynvml`` module, already initialised.
        count: devices NVML reports.
    """

    def __init__(self, nvml: Any, count: int) -> None:
        self._nvml = nvml
        self._count = count
        self._warned = False

    @classmethod
    def probe(cls) -> GpuCollector | None:
        """A collector when NVML initialises and sees at least one GPU; None otherwise, silently."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError:
            return None  # no driver library or no GPU: the metrics are absent, as documented
        if count <= 0:
            pynvml.nvmlShutdown()
            return None
        return cls(pynvml, count)

    def collect(self) -> Iterator[Metric]:
        nvml = self._nvml
        used = GaugeMetricFamily(GPU_METRIC_NAMES[0], "GPU memory in use (all processes).", labels=["gpu"])
        total = GaugeMetricFamily(GPU_METRIC_NAMES[1], "GPU memory in total.", labels=["gpu"])
        util = GaugeMetricFamily(GPU_METRIC_NAMES[2], "GPU busy fraction over the last sample period.",
                                 labels=["gpu"])
        for i in range(self._count):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
            except nvml.NVMLError as exc:
                if not self._warned:  # a lost GPU would otherwise log at every scrape
                    log.warning("NVML query of GPU %d failed (%s); its metrics are left out", i, exc)
                    self._warned = True
                continue
            used.add_metric([str(i)], float(mem.used))
            total.add_metric([str(i)], float(mem.total))
            util.add_metric([str(i)], rates.gpu / 100.0)
        yield from (used, total, util)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass  # already shut down elsewhere; nothing left to release


def _fast_observe(count: Any, latency: Any) -> tuple[Any, Any, tuple[Any, ...], tuple[float, ...]] | None:
    """What ``count.inc()`` and ``latency.observe(s)`` change, to change it directly: the
    counter's value, the histogram's sum, its buckets and their upper bounds (``+Inf`` last).
    Every data-plane request counts once: the public calls cost ~2.5 us a request between them
    (an observability check each, a Python loop over the buckets), this ~1 us; the values,
    their locks and so what a scrape reads are the same. None where the children are not laid
    out so (another prometheus_client, exemplars in use): then the public calls."""
    try:
        bounds = tuple(latency._upper_bounds)
        buckets = tuple(b.inc for b in latency._buckets)
        out = (count._value.inc, latency._sum.inc, buckets, bounds)
    except AttributeError:
        return None
    if len(buckets) != len(bounds) or not bounds or bounds[-1] != float("inf") or list(bounds) != sorted(bounds):
        return None
    return out


class Metrics:
    """Every metric of one daemon, in its own registry (two daemons in one process stay apart).

    Args:
        gpu: probe NVML for GPU telemetry (tests of the CPU path pass False).
    """

    def __init__(self, *, gpu: bool = True) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self._requests = Counter("kvtier_requests", "Requests handled, by operation and outcome (ok or an "
                                 "error code).", ["op", "status"], registry=reg)
        self._latency = Histogram("kvtier_request_duration_seconds", "Time to handle one request, by operation.",
                                  ["op"], buckets=LATENCY_BUCKETS, registry=reg)
        self._hit_tokens = Counter("kvtier_lookup_hit_tokens", "Tokens found stored by token lookups.",
                                   registry=reg)
        self._miss_tokens = Counter("kvtier_lookup_miss_tokens", "Tokens not found by token lookups.",
                                    registry=reg)
        self._events = Counter("kvtier_events_published", "KV events published to subscribers.", registry=reg)
        self._connections = Gauge("kvtier_connections", "Open data-plane connections.", registry=reg)
        self._children: dict[tuple[str, str], Any] = {}  # (op, status) -> what _fast_observe returns
        build = Gauge("kvtier_build_info", "Always 1; the version is a label.", ["version"], registry=reg)
        build.labels(__version__).set(1)
        Gauge("kvtier_start_time_seconds", "Unix time the daemon started.", registry=reg).set(time.time())
        self._store = StoreCollector()
        reg.register(self._store)
        self._gc = GcCollector()
        reg.register(self._gc)
        self._gpu = GpuCollector.probe() if gpu else None
        if self._gpu is not None:
            reg.register(self._gpu)

    @property
    def has_gpu(self) -> bool:
        """Whether GPU telemetry is exported."""
        return self._gpu is not None

    def bind(self, ctx: DaemonContext) -> None:
        """Export the counters and gauges of ``ctx.store`` and of each tenant's store (read at each
        scrape), and ``ctx.ready``."""
        self._store.ctx = ctx

    def watch_gc(self, policy: CollectorPolicy) -> None:
        """Export the garbage collector's pauses as ``policy`` times them."""
        self._gc.policy = policy

    def observe_request(self, op: str, status: str, seconds: float) -> None:
        """Count one request and its latency.

        Args:
            op: operation name (``lookup``, ``put``, ``rest_blocks``, ...).
            status: ``ok`` or the error's wire code.
            seconds: time from receipt to reply.
        """
        seconds = max(0.0, seconds)
        fast = self._children.get((op, status))
        if fast is None:  # labels() costs a lock and a tuple per call: resolved once per pair
            label = _label(op)
            count, latency = self._requests.labels(label, _label(status)), self._latency.labels(label)
            fast = _fast_observe(count, latency)
            if fast is None:  # a prometheus_client whose children are laid out otherwise
                count.inc()
                latency.observe(seconds)
                return
            if len(self._children) < _MAX_LABEL_PAIRS:
                self._children[(op, status)] = fast
        count_inc, sum_inc, bucket_incs, bounds = fast
        count_inc(1)
        sum_inc(seconds)
        bucket_incs[bisect_left(bounds, seconds)](1)

    def add_lookup_tokens(self, hit_tokens: int, miss_tokens: int) -> None:
        """Count the tokens one lookup found and missed."""
        self._hit_tokens.inc(max(0, hit_tokens))
        self._miss_tokens.inc(max(0, miss_tokens))

    def event_published(self, n: int = 1) -> None:
        """Count KV events sent to subscribers."""
        self._events.inc(max(0, n))

    def connections(self, n: int) -> None:
        """Set the number of open data-plane connections."""
        self._connections.set(n)

    def render(self, tenants: frozenset[str | None] | None = None) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type.

        Args:
            tenants: the stores whose series are shown (``None`` in it: the default store);
                None: every store.
        """
        # generate_latest collects synchronously: no other scrape can see this choice.
        self._store.tenants = tenants
        try:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        finally:
            self._store.tenants = None

    def close(self) -> None:
        """Release NVML (idempotent)."""
        gpu, self._gpu = self._gpu, None
        if gpu is not None:
            self.registry.unregister(gpu)
            gpu.close()
