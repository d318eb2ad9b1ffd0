"""What the daemon shows of a store's remote tier (issue 23): the ``remote`` map of ``stats`` and
``/v1/stats``, the ``remote`` row of ``/v1/tiers`` (which ``kvtier status`` prints). Nothing secret:
the cluster's address and user, never its password; and its Prometheus families
(:func:`remote_metrics`, read at each scrape like the store's)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from kvtier.daemon.remote.breaker import BreakerState
from kvtier.daemon.store.remote_link import RemoteLink
from kvtier.daemon.store.types import Tier


def remote_view(link: RemoteLink) -> dict[str, Any]:
    """The remote tier's settings that matter, the engine's counters and the store's."""
    rc = link.blocks.counters
    lc = link.counters
    out: dict[str, Any] = {
        "enabled": link.enabled, "address": str(getattr(link.blocks, "address", "")), "tenant": link.options.tenant,
        "write_mode": link.options.write_mode, "breaker_state": rc.breaker_state, "breaker_opens": rc.breaker_opens,
        "bytes_up": rc.bytes_up, "blocks_up": rc.blocks_up, "bytes_down": rc.bytes_down,
        "blocks_down": rc.blocks_down, "misses": rc.misses, "put_failures": rc.put_failures,
        "deleted": rc.deleted, "skipped": rc.skipped, "errors": dict(rc.errors),
        "fetch_latency": {"count": rc.fetch_latency.count, "sum_s": round(rc.fetch_latency.sum_s, 6)},
    }
    out.update({"lookup_keys": lc.lookup_keys, "lookup_hits": lc.lookup_hits, "fetched_blocks": lc.fetched_blocks,
                "fetched_bytes": lc.fetched_bytes, "bad_values": dict(lc.bad_values),
                "uploads_queued": lc.uploads_queued, "uploaded": lc.uploaded, "upload_drops": lc.upload_drops,
                "upload_drop_bytes": lc.upload_drop_bytes, "upload_failures": lc.upload_failures,
                "queue_bytes": lc.queue_bytes, "queue_blocks": lc.queue_blocks,
                "namespaces_fetched": lc.namespaces_fetched, "namespaces_uploaded": lc.namespaces_uploaded,
                "codec": link.options.codec, "recoded": lc.recoded, "recoded_saved_bytes": lc.recoded_saved_bytes})
    return out


def remote_tier_row(link: RemoteLink) -> dict[str, Any]:
    """The ``/v1/tiers`` row of the remote tier. The cluster's capacity and contents are its own
    (``maxmemory``, ``allkeys-lru``): those figures are None; traffic is this store's."""
    rc, lc = link.blocks.counters, link.counters
    return {"tier": Tier.REMOTE.wire_name, "medium": Tier.REMOTE.medium, "enabled": link.enabled,
            "capacity_bytes": None, "used_bytes": None, "free_bytes": None, "blocks": None, "fragmentation": None,
            "hits": lc.fetched_blocks, "misses": rc.misses, "bytes_in": rc.bytes_up, "bytes_out": rc.bytes_down,
            "evictions": 0, "demotions": 0, "remote": remote_view(link)}


REMOTE_METRIC_NAMES: tuple[str, ...] = (
    "kvtier_remote_bytes_total", "kvtier_remote_blocks_total", "kvtier_remote_misses_total",
    "kvtier_remote_put_failures_total", "kvtier_remote_deleted_total", "kvtier_remote_breaker_opens_total",
    "kvtier_remote_skipped_calls_total", "kvtier_remote_lookup_keys_total", "kvtier_remote_lookup_hit_keys_total",
    "kvtier_remote_fetched_blocks_total", "kvtier_remote_uploads_queued_total", "kvtier_remote_uploaded_blocks_total",
    "kvtier_remote_upload_drops_total", "kvtier_remote_upload_drop_bytes_total", "kvtier_remote_upload_failures_total",
    "kvtier_remote_recoded_blocks_total", "kvtier_remote_recoded_saved_bytes_total",
    "kvtier_remote_errors_total", "kvtier_remote_bad_values_total", "kvtier_remote_breaker_state",
    "kvtier_remote_upload_queue_bytes", "kvtier_remote_upload_queue_blocks", "kvtier_remote_fetch_seconds_bucket",
    "kvtier_remote_fetch_seconds_count", "kvtier_remote_fetch_seconds_sum")
"""Sample names of the remote tier's metrics (each labelled ``tenant``), exported only by stores that
have a remote tier."""

_ENGINE_COUNTERS = (
    ("misses", "kvtier_remote_misses", "Keys fetched from the remote tier that came back without a value."),
    ("put_failures", "kvtier_remote_put_failures", "Records the remote tier did not store (refused, timed "
     "out, breaker open)."),
    ("deleted", "kvtier_remote_deleted", "Remote keys deleted (values that failed verification)."),
    ("breaker_opens", "kvtier_remote_breaker_opens", "Times the circuit breaker opened."),
    ("skipped", "kvtier_remote_skipped_calls", "Remote calls answered at once because the breaker was open."),
)
_LINK_COUNTERS = (
    ("lookup_keys", "kvtier_remote_lookup_keys", "Keys lookups asked the remote tier for."),
    ("lookup_hits", "kvtier_remote_lookup_hit_keys", "Keys lookups found in the remote tier (consecutive)."),
    ("fetched_blocks", "kvtier_remote_fetched_blocks", "Remote blocks verified and placed into host memory."),
    ("uploads_queued", "kvtier_remote_uploads_queued", "Blocks queued for upload."),
    ("uploaded", "kvtier_remote_uploaded_blocks", "Blocks the remote tier acknowledged."),
    ("upload_drops", "kvtier_remote_upload_drops", "Uploads dropped because the upload queue was full."),
    ("upload_drop_bytes", "kvtier_remote_upload_drop_bytes", "Payload bytes of the dropped uploads."),
    ("upload_failures", "kvtier_remote_upload_failures", "Uploads not acknowledged or whose host copy failed "
     "its checksum."),
    ("recoded", "kvtier_remote_recoded_blocks", "Records re-encoded with the remote tier's lossy codec for upload."),
    ("recoded_saved_bytes", "kvtier_remote_recoded_saved_bytes", "Payload bytes those re-encodings saved."),
)


def remote_metrics(links: Sequence[tuple[str, RemoteLink]]) -> Iterator[Metric]:
    """The remote tier's metric families, one series per store (label ``tenant``) that has one."""
    links = [(t, link) for t, link in links if link.enabled]
    if not links:
        return
    moved = {"bytes": CounterMetricFamily("kvtier_remote_bytes", "Record bytes moved to (up) and from (down) "
                                          "the remote tier.", labels=["tenant", "direction"]),
             "blocks": CounterMetricFamily("kvtier_remote_blocks", "Records moved to (up) and from (down) the "
                                           "remote tier.", labels=["tenant", "direction"])}
    for tenant, link in links:
        rc = link.blocks.counters
        moved["bytes"].add_metric([tenant, "up"], rc.bytes_up)
        moved["bytes"].add_metric([tenant, "down"], rc.bytes_down)
        moved["blocks"].add_metric([tenant, "up"], rc.blocks_up)
        moved["blocks"].add_metric([tenant, "down"], rc.blocks_down)
    yield from moved.values()
    for field_name, name, doc in _ENGINE_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, link in links:
            fam.add_metric([tenant], getattr(link.blocks.counters, field_name))
        yield fam
    for field_name, name, doc in _LINK_COUNTERS:
        fam = CounterMetricFamily(name, doc, labels=["tenant"])
        for tenant, link in links:
            fam.add_metric([tenant], getattr(link.counters, field_name))
        yield fam
    errors = CounterMetricFamily("kvtier_remote_errors", "Failed remote calls by kind (timeout, connection, "
                                 "cluster_down, auth, oom, response, other).", labels=["tenant", "kind"])
    bad = CounterMetricFamily("kvtier_remote_bad_values", "Fetched values that were not the block asked for, "
                              "by reason (each a miss, deleted).", labels=["tenant", "reason"])
    breaker = GaugeMetricFamily("kvtier_remote_breaker_state", "1 for the circuit breaker's current state.",
                                labels=["tenant", "state"])
    queue_bytes = GaugeMetricFamily("kvtier_remote_upload_queue_bytes", "Payload bytes waiting for upload.",
                                    labels=["tenant"])
    queue_blocks = GaugeMetricFamily("kvtier_remote_upload_queue_blocks", "Blocks waiting for upload.",
                                     labels=["tenant"])
    latency = HistogramMetricFamily("kvtier_remote_fetch_seconds", "Time of one remote fetch call (a batch).",
                                    labels=["tenant"])
    for tenant, link in links:
        rc, lc = link.blocks.counters, link.counters
        for kind, n in sorted(rc.errors.items()):
            errors.add_metric([tenant, kind], n)
        for reason, n in sorted(lc.bad_values.items()):
            bad.add_metric([tenant, reason], n)
        for state in BreakerState:
            breaker.add_metric([tenant, state.value], 1.0 if rc.breaker_state == state.value else 0.0)
        queue_bytes.add_metric([tenant], lc.queue_bytes)
        queue_blocks.add_metric([tenant], lc.queue_blocks)
        h = rc.fetch_latency
        bounds = [floatToGoString(b) for b in h.bounds_s] + ["+Inf"]
        latency.add_metric([tenant], list(zip(bounds, itertools.accumulate(list(h.counts)))), h.sum_s)
    yield from (errors, bad, breaker, queue_bytes, queue_blocks, latency)
