"""The backend interface's parts that need no cluster: the Null backend, URLs, settings, keys,
counters, and a cluster that is not there at all (loopback, nothing listening)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvtier.daemon.remote.backend import LatencyHistogram, NoRemoteBlocks, RemoteKey
from kvtier.daemon.remote.breaker import BreakerSettings, BreakerState
from kvtier.daemon.remote.redis_cluster import (ClusterAddress, RedisClusterBlocks, RedisClusterSettings,
                                                block_key, namespace_key, parse_cluster_url)
from tests.kvtier.daemon.remote.remotekit import chain_hash, make_blocks, namespace_for

NS = namespace_for(4096)
KEY = RemoteKey("alice", NS.ns_id, chain_hash(1))


async def test_no_remote_blocks_misses_everything_and_stores_nothing() -> None:
    r = NoRemoteBlocks()
    blocks = make_blocks(NS, 3)
    assert await r.put(blocks) == [False] * 3
    assert await r.exists([k for k, _ in blocks]) == [False] * 3
    assert await r.get([k for k, _ in blocks]) == [None] * 3
    assert await r.put_namespace("default", NS.ns_id, NS.canonical_bytes()) is False
    assert await r.get_namespace("default", NS.ns_id) is None
    await r.delete([KEY])
    assert r.counters.misses == 3 and r.counters.put_failures == 3 and r.counters.blocks_up == 0
    await r.close()


@pytest.mark.parametrize("url, nodes, tls", [
    ("redis+cluster://10.0.0.1:7001", (("10.0.0.1", 7001),), False),
    ("redis+cluster://a:1,b:2,c", (("a", 1), ("b", 2), ("c", 6379)), False),
    ("rediss+cluster://[::1]:7000,[fe80::1]", (("::1", 7000), ("fe80::1", 6379)), True),
])
def test_cluster_urls_parse(url: str, nodes: tuple, tls: bool) -> None:
    addr = parse_cluster_url(url)
    assert addr == ClusterAddress(nodes, tls)
    assert parse_cluster_url(str(addr)) == addr


@pytest.mark.parametrize("url", [
    "redis://h:1", "redis+cluster://", "redis+cluster://h:x", "redis+cluster://h:0", "redis+cluster://h:70000",
    "redis+cluster://user:pw@h:1", "redis+cluster://h:1/0", "redis+cluster://h:1?x=1", "redis+cluster://[::1",
    "redis+cluster://a:1,,b:2", "h:1",
])
def test_bad_cluster_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        parse_cluster_url(url)


@pytest.mark.parametrize("kw", [dict(prefix="a:b"), dict(prefix="{x}"), dict(prefix=""), dict(timeout_s=0),
                                dict(batch_keys=0), dict(parallel=True), dict(url="redis://h:1")])
def test_bad_settings_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        RedisClusterSettings(**{"url": "redis+cluster://h:1", **kw})


def test_keys_spread_without_hash_tags_and_namespaces_have_their_own() -> None:
    k = block_key("kvt", KEY)
    assert k == f"kvt:alice:{NS.ns_id.hex()}:{KEY.chain_hash.hex()}".encode()
    assert b"{" not in k
    assert namespace_key("kvt", "alice", NS.ns_id) == f"kvt:alice:ns:{NS.ns_id.hex()}".encode()
    with pytest.raises(ValueError):
        namespace_key("kvt", "Alice", NS.ns_id)


def test_the_password_is_read_from_its_file_and_never_shown(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("s3cret-Pa55\n")
    s = RedisClusterSettings("redis+cluster://h:1", user="alice", password_file=str(pw))
    r = RedisClusterBlocks(s)
    assert "s3cret" not in repr(r) and "s3cret" not in repr(s) and "s3cret" not in str(r.address)
    assert r._password == "s3cret-Pa55"
    with pytest.raises(OSError):
        RedisClusterBlocks(RedisClusterSettings("redis+cluster://h:1", password_file=str(tmp_path / "none")))


def test_latency_histogram_buckets() -> None:
    h = LatencyHistogram(bounds_s=(0.001, 0.01), counts=[0, 0, 0])
    for s in (0.0005, 0.001, 0.002, 5.0):
        h.observe(s)
    assert h.counts == [2, 1, 1] and h.count == 4 and h.sum_s == pytest.approx(5.0035)


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_no_cluster_at_all_is_misses_then_an_open_breaker() -> None:
    s = RedisClusterSettings(f"redis+cluster://127.0.0.1:{_closed_port()}", timeout_s=2.0,
                             breaker=BreakerSettings(failures=2, backoff_s=60.0, max_backoff_s=60.0))
    r = RedisClusterBlocks(s)
    try:
        blocks = make_blocks(NS, 4)
        keys = [k for k, _ in blocks]
        assert await r.put(blocks) == [False] * 4
        assert r.breaker_state is BreakerState.CLOSED
        assert await r.get(keys) == [None] * 4
        assert r.breaker_state is BreakerState.OPEN and r.counters.breaker_state == "open"
        errors = dict(r.counters.errors)
        assert sum(errors.values()) == 2 and set(errors) <= {"connection", "cluster_down", "timeout"}
        # Open: answered at once, nothing attempted, nothing more counted as an error.
        assert await r.exists(keys) == [False] * 4
        assert await r.get_namespace("default", NS.ns_id) is None
        assert r.counters.skipped == 2 and r.counters.errors == errors
        c = r.counters
        assert (c.misses, c.put_failures, c.blocks_up, c.blocks_down, c.breaker_opens) == (4, 4, 0, 0, 1)
    finally:
        await r.close()
