"""Metrics: exposition parses, store counters and gauges are read at scrape, the tables cover every
store field, GPU telemetry is absent without a GPU, and the Grafana dashboard uses only exported names."""

from __future__ import annotations

import gc
import json
import logging
import re
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvtier.daemon.server.collector import PAUSE_BUCKETS, CollectorPolicy
from kvtier.daemon.server.metrics import (GPU_METRIC_NAMES, LATENCY_BUCKETS, STORE_COUNTERS, STORE_GAUGES,
                                   TIER_COUNTERS, TIER_GAUGES, Metrics)
from kvtier.daemon.server.remote_views import REMOTE_METRIC_NAMES
from kvtier.daemon.store.stats import StoreCounters, StoreGauges, TierCounters, TierGauges
from tests.kvtier.daemon.server.restkit import SALT, TOKEN, open_ctx, put_tokens, tokens_for

REPO = Path(__file__).resolve().parents[4]


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a render, by (name, sorted labels)."""
    body, _ = metrics.render()
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: Metrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted(labels.items())))]


def test_unbound_metrics_render_and_parse():
    m = Metrics(gpu=False)
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert {"kvtier_build_info", "kvtier_start_time_seconds", "kvtier_connections"} <= names
    assert not any(n.startswith("kvtier_tier_") for n in names)  # no store bound yet


def test_own_registry_per_instance():
    a, b = Metrics(gpu=False), Metrics(gpu=False)
    a.observe_request("lookup", "ok", 0.001)
    assert value(a, "kvtier_requests_total", op="lookup", status="ok") == 1
    assert ("kvtier_requests_total", (("op", "lookup"), ("status", "ok"))) not in samples(b)


def test_request_counters_and_latency_histogram():
    m = Metrics(gpu=False)
    m.observe_request("put", "ok", 30e-6)
    m.observe_request("put", "ok", 0.002)
    m.observe_request("put", "busy", 7.0)
    assert value(m, "kvtier_requests_total", op="put", status="ok") == 2
    assert value(m, "kvtier_requests_total", op="put", status="busy") == 1
    assert value(m, "kvtier_request_duration_seconds_bucket", op="put", le="5e-05") == 1
    assert value(m, "kvtier_request_duration_seconds_bucket", op="put", le="0.0025") == 2
    assert value(m, "kvtier_request_duration_seconds_bucket", op="put", le="5.0") == 2
    assert value(m, "kvtier_request_duration_seconds_bucket", op="put", le="+Inf") == 3
    assert value(m, "kvtier_request_duration_seconds_count", op="put") == 3
    assert LATENCY_BUCKETS[0] == 50e-6 and LATENCY_BUCKETS[-1] == 5.0


def test_request_observations_land_where_the_public_histogram_puts_them():
    # observe_request changes the children's values directly (metrics._fast_observe): every
    # bucket, the sum and the count equal what Counter.inc and Histogram.observe make of them,
    # bounds themselves, values between them, zero, negatives and the overflow included.
    from prometheus_client import CollectorRegistry, Histogram
    reg = CollectorRegistry()
    ref = Histogram("ref_seconds", "reference", buckets=LATENCY_BUCKETS, registry=reg)
    m = Metrics(gpu=False)
    values = [0.0, -1.0, 7.0, 1e9, *LATENCY_BUCKETS]
    values += [b * 0.999 for b in LATENCY_BUCKETS] + [b * 1.001 for b in LATENCY_BUCKETS]
    for v in values:
        m.observe_request("ping", "ok", v)
        ref.observe(max(0.0, v))
    got = samples(m)
    for bound in [*LATENCY_BUCKETS, float("inf")]:
        le = "+Inf" if bound == float("inf") else str(float(bound))
        want = reg.get_sample_value("ref_seconds_bucket", {"le": le})
        assert got[("kvtier_request_duration_seconds_bucket", (("le", le), ("op", "ping")))] == want, le
    assert got[("kvtier_request_duration_seconds_sum", (("op", "ping"),))] == pytest.approx(
        reg.get_sample_value("ref_seconds_sum"))
    assert value(m, "kvtier_requests_total", op="ping", status="ok") == len(values)


def test_label_values_are_bounded():
    m = Metrics(gpu=False)
    m.observe_request('bad"op\nname', "x" * 200, 0.0)
    assert value(m, "kvtier_requests_total", op="other", status="other") == 1


def test_token_event_and_connection_counters():
    m = Metrics(gpu=False)
    m.add_lookup_tokens(96, 4)
    m.add_lookup_tokens(0, 16)
    m.event_published(5)
    m.event_published()
    m.connections(3)
    assert value(m, "kvtier_lookup_hit_tokens_total") == 96
    assert value(m, "kvtier_lookup_miss_tokens_total") == 20
    assert value(m, "kvtier_events_published_total") == 6
    assert value(m, "kvtier_connections") == 3


def test_tables_cover_every_store_field():
    # A counter added to kvtier/daemon/store/stats.py must be exported too: one line in a table.
    assert {e.field for e in STORE_COUNTERS} == {f.name for f in fields(StoreCounters)} - {"tiers"}
    assert {e.field for e in TIER_COUNTERS} == {f.name for f in fields(TierCounters)}
    assert {e.field for e in STORE_GAUGES} == {f.name for f in fields(StoreGauges)} - {"tiers"}
    assert {e.field for e in TIER_GAUGES} == {f.name for f in fields(TierGauges)}
    names = [e.name for e in STORE_COUNTERS + TIER_COUNTERS + STORE_GAUGES + TIER_GAUGES]
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"kvtier_[a-z0-9_]+", n) and not n.endswith("_total") for n in names)
    assert all(e.name.endswith("_bytes") for e in TIER_COUNTERS + TIER_GAUGES if "bytes" in e.field)


async def test_store_values_are_read_at_scrape(tmp_path):
    async with open_ctx(tmp_path) as ctx:
        m = ctx.metrics
        assert value(m, "kvtier_commits_total", tenant="") == 0
        assert value(m, "kvtier_ready") == 1
        await put_tokens(ctx.store, tokens_for(12))  # 8 host blocks: 4 are demoted to disk
        s = samples(m)
        default = (("tenant", ""),)  # the default store's label value (no tenants here)

        def tier(name: str) -> tuple[tuple[str, str], ...]:
            return default + (("tier", name),)

        assert s[("kvtier_commits_total", default)] == 12
        assert s[("kvtier_demotions_total", default)] == 4
        assert s[("kvtier_tier_evictions_total", tier("host"))] == 4
        assert s[("kvtier_tier_demotions_total", tier("host"))] == 4
        assert s[("kvtier_tier_written_bytes_total", tier("disk"))] > 0
        assert s[("kvtier_tier_blocks", tier("host"))] == 8
        assert s[("kvtier_tier_blocks", tier("disk"))] == 4
        assert s[("kvtier_tier_capacity_bytes", tier("gpu"))] == 0
        assert s[("kvtier_tier_used_bytes", tier("host"))] == s[("kvtier_tier_capacity_bytes", tier("host"))]
        assert s[("kvtier_blocks", default)] == 12
        assert 0 <= s[("kvtier_host_fragmentation_ratio", default)] < 1
        ctx.ready = False
        assert value(m, "kvtier_ready") == 0


async def test_no_secret_in_exposition(tmp_path):
    async with open_ctx(tmp_path) as ctx:
        await put_tokens(ctx.store, tokens_for(2))
        body, _ = ctx.metrics.render()
        assert TOKEN.encode() not in body and SALT.encode() not in body


def test_gpu_metrics_absent_without_gpu_and_silent(caplog):
    caplog.set_level(logging.DEBUG)
    m = Metrics(gpu=True)  # probes NVML: no driver library here, or a real GPU on a CUDA machine
    names = {f.name for f in text_string_to_metric_families(m.render()[0].decode())}
    if torch.cuda.is_available():
        assert m.has_gpu and set(GPU_METRIC_NAMES) <= names
    else:
        assert not m.has_gpu and not set(GPU_METRIC_NAMES) & names
        assert not caplog.records  # no log spam where there is no GPU
    m.close()
    m.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_metrics_values():
    m = Metrics(gpu=True)
    s = samples(m)
    total = s[("kvtier_gpu_memory_total_bytes", (("gpu", "0"),))]
    assert total > 0 and 0 <= s[("kvtier_gpu_memory_used_bytes", (("gpu", "0"),))] <= total
    assert 0 <= s[("kvtier_gpu_utilization_ratio", (("gpu", "0"),))] <= 1
    m.close()


def _dashboard_exprs() -> list[str]:
    doc = json.loads((REPO / "configs" / "grafana-dashboard.json").read_text())
    exprs: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                exprs.append(node["expr"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(doc)
    return exprs


async def test_dashboard_uses_only_exported_metrics(tmp_path):
    async with open_ctx(tmp_path) as ctx:
        ctx.metrics.watch_gc(CollectorPolicy())  # the daemon watches its policy once ready
        await put_tokens(ctx.store, tokens_for(2))
        ctx.metrics.observe_request("lookup", "ok", 0.001)
        ctx.metrics.add_lookup_tokens(1, 1)
        body, _ = ctx.metrics.render()
    exported = {s.name for fam in text_string_to_metric_families(body.decode()) for s in fam.samples}
    exported |= set(GPU_METRIC_NAMES) | set(REMOTE_METRIC_NAMES)  # only where a GPU / a remote tier is
    exprs = _dashboard_exprs()
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\bkvtier_[a-z0-9_]+", expr))
        assert names, f"expr uses no kvtier metric: {expr}"
        used |= names
    assert used <= exported, f"dashboard uses metrics the daemon does not export: {sorted(used - exported)}"
    for needed in ("kvtier_tier_used_bytes", "kvtier_request_duration_seconds_bucket", "kvtier_requests_total",
                   "kvtier_lookup_hit_tokens_total", "kvtier_tier_evictions_total", "kvtier_promotions_total",
                   "kvtier_demotions_total", "kvtier_checksum_failures_total", "kvtier_events_published_total",
                   "kvtier_gc_pause_seconds_bucket"):
        assert needed in used


async def test_gc_pauses_are_exported_by_generation():
    m = Metrics(gpu=False)
    assert not any(k[0].startswith("kvtier_gc_") for k in samples(m))  # no policy watched yet
    policy = CollectorPolicy(freeze=False)
    m.watch_gc(policy)
    policy.start()
    try:
        gc.collect(0)
        gc.collect()
    finally:
        await policy.stop()
    got = samples(m)
    assert got[("kvtier_gc_pause_seconds_count", (("generation", "0"),))] >= 1
    assert got[("kvtier_gc_pause_seconds_count", (("generation", "2"),))] >= 1
    assert got[("kvtier_gc_pause_seconds_sum", (("generation", "2"),))] > 0
    buckets = [got[("kvtier_gc_pause_seconds_bucket", (("generation", "2"), ("le", le)))]
               for le in [*(str(b) for b in PAUSE_BUCKETS), "+Inf"]]
    assert buckets == sorted(buckets) and buckets[-1] == got[("kvtier_gc_pause_seconds_count", (("generation", "2"),))]
    assert ("kvtier_gc_frozen_objects", ()) in got and ("kvtier_gc_freezes_total", ()) in got


def test_prometheus_scrape_config():
    text = (REPO / "configs" / "prometheus.yml").read_text()
    assert "scrape_configs:" in text
    assert re.search(r"metrics_path:\s*/metrics", text)
    assert re.search(r"targets:\s*\[\s*['\"]127\.0\.0\.1:7471['\"]\s*\]", text)
