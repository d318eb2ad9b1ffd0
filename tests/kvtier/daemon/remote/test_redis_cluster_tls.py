"""``rediss+cluster://``: the backend against a cluster that speaks TLS only (clients, cluster bus,
replication), in network namespaces like the plain one. A server the client cannot verify is a
miss, never an exception and never a plaintext fallback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings
from kvtier.daemon.remote.verify import verify_record
from tests.kvtier.daemon.remote.remotekit import make_blocks, namespace_for
from tests.manyhosts import ManyHosts, many_hosts

NS = namespace_for(2 << 20)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManyHosts]:
    with many_hosts(tmp_path_factory.mktemp("tls-hosts"), tls=True) as w:
        yield w


def test_records_round_trip_over_tls(world: ManyHosts) -> None:
    assert world.cluster.tls is not None and world.cluster.url.startswith("rediss+cluster://")
    blocks = make_blocks(NS, 4, tag=b"tls")
    keys = [k for k, _ in blocks]

    async def body() -> None:
        r = RedisClusterBlocks(RedisClusterSettings(world.cluster.url, timeout_s=10.0,
                                                    tls_ca_file=str(world.cluster.tls.ca)))
        try:
            assert await r.put(blocks) == [True] * 4
            got = await r.get(keys)
            assert got == [v for _, v in blocks]
            assert all(verify_record(k, v, namespace=NS).ok for k, v in zip(keys, got))
            await r.delete(keys)
            assert await r.exists(keys) == [False] * 4
        finally:
            await r.close()
    world.loop.run(body())


def test_an_unverifiable_server_or_plaintext_is_a_miss(world: ManyHosts) -> None:
    blocks = make_blocks(NS, 2, tag=b"tls-refused")

    async def body() -> None:
        # The system's CAs do not know the cluster's CA; a plaintext client meets a TLS port.
        untrusted = RedisClusterBlocks(RedisClusterSettings(world.cluster.url, timeout_s=3.0))
        plain = RedisClusterBlocks(RedisClusterSettings(world.cluster.url.replace("rediss+", "redis+"),
                                                        timeout_s=3.0))
        try:
            for r in (untrusted, plain):
                assert await r.put(blocks) == [False] * 2
                assert await r.get([k for k, _ in blocks]) == [None] * 2
                assert r.counters.errors and r.counters.blocks_up == 0
        finally:
            await untrusted.close()
            await plain.close()
    world.loop.run(body())
