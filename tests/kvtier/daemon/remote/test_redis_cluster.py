"""The Redis Cluster backend against a real cluster of 3 masters + 3 replicas on three simulated
hosts (network namespaces; needs root), talking from a fourth host: round trips of real records,
keys over every shard, planted garbage, per-tenant ACLs, a master killed, a host cut off, a dead
cluster and the breaker. One cluster for the module; a test that breaks it restores it and the
next one starts by waiting for a healthy cluster.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from redis.asyncio.cluster import RedisCluster as RawCluster
from redis.crc import key_slot
from redis.exceptions import NoPermissionError

from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.breaker import BreakerSettings, BreakerState
from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings, block_key
from kvtier.daemon.remote.verify import MissReason, verify_namespace, verify_record
from tests.kvtier.daemon.remote.remotekit import make_blocks, make_record, namespace_for
from tests.manyhosts import ManyHosts, many_hosts

MiB = 1 << 20
SMALL = namespace_for(64 << 10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManyHosts]:
    with many_hosts(tmp_path_factory.mktemp("hosts")) as w:
        yield w


@pytest.fixture(autouse=True)
def healthy(world: ManyHosts) -> None:
    world.cluster.wait_healthy()


def backend(world: ManyHosts, **kw) -> RedisClusterBlocks:
    """A backend for the cluster (made here; it connects from the client host on first use)."""
    return RedisClusterBlocks(RedisClusterSettings(world.cluster.url, **{"timeout_s": 10.0, **kw}))


def run(world: ManyHosts, coro):
    """Run ``coro`` on the client host."""
    return world.loop.run(coro)


async def until_hits(r: RedisClusterBlocks, blocks: Sequence[tuple[RemoteKey, bytes]],
                     timeout_s: float = 60) -> list[bytes | None]:
    """Poll ``get`` until every block reads back exactly, or ``timeout_s`` passed; the last answers."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = await r.get([k for k, _ in blocks])
        assert all(g is None or g == v for g, (_, v) in zip(got, blocks)), "a wrong value read back"
        if all(g is not None for g in got) or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)  # poll interval while the client learns the new topology


def test_the_cluster_spreads_over_the_hosts(world: ManyHosts) -> None:
    views = world.cluster.topology()
    masters = [v for v in views if v.is_master and v.slots]
    host_of = {v.address: v.address.split(":")[0] for v in views}
    assert len({host_of[m.address] for m in masters}) == 3
    for m in masters:
        [replica] = [v for v in views if v.master == m.id]
        assert host_of[replica.address] != host_of[m.address]
    # The client host runs no server, and nothing of the fabric exists outside its namespaces.
    assert world.client.address not in host_of.values()
    own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True).stdout
    assert "10.213.7." not in own


@pytest.mark.parametrize("size, n", [(2 * MiB, 8), (8 * MiB, 3)])
def test_round_trips_of_real_records(world: ManyHosts, size: int, n: int) -> None:
    ns = namespace_for(size)
    blocks = make_blocks(ns, n, tag=b"round-trip")
    keys = [k for k, _ in blocks]

    async def body() -> None:
        r = backend(world)
        try:
            assert await r.exists(keys) == [False] * n
            assert await r.put(blocks) == [True] * n
            assert await r.exists(keys) == [True] * n
            got = await r.get(keys)
            for (key, record), value in zip(blocks, got):
                assert value == record
                v = verify_record(key, value, namespace=ns)
                assert v.ok and v.payload is not None and v.payload.nbytes == size
            c = r.counters
            assert (c.blocks_up, c.blocks_down, c.misses) == (n, n, 0)
            assert c.bytes_up == c.bytes_down == sum(len(v) for _, v in blocks)
            assert c.fetch_latency.count == 1 and c.errors == {}
            await r.delete(keys[:1])
            assert await r.exists(keys) == [False] + [True] * (n - 1)
            assert await r.get(keys[:1]) == [None]
            assert r.counters.deleted == 1 and r.counters.misses == 1
            await r.delete(keys)
            assert await r.exists(keys) == [False] * n
        finally:
            await r.close()
    run(world, body())


def test_a_namespace_spreads_over_every_master_and_its_bytes_round_trip(world: ManyHosts) -> None:
    blocks = make_blocks(SMALL, 24, tag=b"spread")
    views = world.cluster.topology()
    masters = [v for v in views if v.is_master and v.slots]
    prefix = "kvtier"

    async def body() -> None:
        r = backend(world)
        try:
            assert await r.put(blocks) == [True] * len(blocks)
            assert await r.put_namespace("default", SMALL.ns_id, SMALL.canonical_bytes())
            raw = await r.get_namespace("default", SMALL.ns_id)
            assert raw is not None and verify_namespace(SMALL.ns_id, raw) == SMALL
            assert await r.get_namespace("default", namespace_for(128 << 10).ns_id) is None
            await r.delete([k for k, _ in blocks])
        finally:
            await r.close()
    run(world, body())
    owners = {next(m.address for m in masters if m.serves(key_slot(block_key(prefix, k)))) for k, _ in blocks}
    assert len(owners) == 3, "one namespace's blocks must land on every shard (no hash tag)"


def test_malformed_values_under_kvtier_keys_are_typed_misses(world: ManyHosts) -> None:
    ns, other = SMALL, namespace_for(64 << 10, model="another-model")
    blocks = make_blocks(ns, 4, tag=b"planted")
    keys = [k for k, _ in blocks]
    good = [v for _, v in blocks]  # each key's own record, then spoiled
    planted = {
        keys[0]: good[0][:len(good[0]) // 2],  # truncated
        keys[1]: b"NOPE" + good[1][4:],  # wrong header
        keys[2]: good[2][:-1] + bytes([good[2][-1] ^ 0xFF]),  # wrong checksum
        keys[3]: make_record(other, keys[3].chain_hash),  # another namespace's block
    }
    expected = [MissReason.TRUNCATED, MissReason.BAD_HEADER, MissReason.BAD_CHECKSUM, MissReason.WRONG_BLOCK]

    async def body() -> None:
        seed = world.servers[0]
        raw = RawCluster(host=seed.address, port=7001)
        r = backend(world)
        try:
            for k, value in planted.items():  # someone else's client writes under kvtier's keys
                assert await raw.set(block_key("kvtier", k), value)
            got = await r.get(keys)
            verdicts = [verify_record(k, v, namespace=ns) for k, v in zip(keys, got)]
            assert [v.reason for v in verdicts] == expected
            await r.delete([k for k, v in zip(keys, verdicts) if not v.ok])  # what the store will do
            assert await r.exists(keys) == [False] * 4
            assert r.counters.deleted == 4
        finally:
            await r.close()
            await raw.aclose()
    run(world, body())


def test_a_tenant_cannot_read_or_write_another_tenants_keys(world: ManyHosts, tmp_path: Path) -> None:
    rules = ("-@all", "+@read", "+@write", "+@connection", "+cluster|slots", "+cluster|shards",
             "+cluster|nodes", "+info", "+command")
    creds = {}
    for tenant in ("ta", "tb"):
        pw = tmp_path / f"{tenant}.pw"
        pw.write_text(f"pw-of-{tenant}-0123456789\n")
        pw.chmod(0o600)
        world.cluster.acl_setuser(tenant, "reset", "on", f">pw-of-{tenant}-0123456789",
                                  f"~kvtier:{tenant}:*", *rules)
        creds[tenant] = str(pw)
    a_blocks = make_blocks(SMALL, 6, tenant="ta", tag=b"acl")
    b_blocks = make_blocks(SMALL, 6, tenant="tb", tag=b"acl")

    async def body() -> None:
        a = backend(world, user="ta", password_file=creds["ta"])
        b = backend(world, user="tb", password_file=creds["tb"])
        raw_b = RawCluster(host=world.servers[0].address, port=7001, username="tb",
                           password="pw-of-tb-0123456789")
        try:
            assert await a.put(a_blocks) == [True] * 6
            assert await b.put(b_blocks) == [True] * 6
            assert await b.get([k for k, _ in b_blocks]) == [v for _, v in b_blocks]
            # B's credentials: A's blocks are misses, B cannot overwrite or delete them.
            assert await b.get([k for k, _ in a_blocks]) == [None] * 6
            assert await b.exists([k for k, _ in a_blocks]) == [False] * 6
            assert await b.put([(k, b"forged") for k, _ in a_blocks]) == [False] * 6
            await b.delete([k for k, _ in a_blocks])
            assert b.counters.errors.get("auth", 0) >= 4
            assert b.breaker_state is BreakerState.CLOSED  # a refusal is not a dead cluster
            assert await a.get([k for k, _ in a_blocks]) == [v for _, v in a_blocks]
            # And not only through kvtier: the server refuses B's user on A's keys.
            with pytest.raises(NoPermissionError):
                await raw_b.get(block_key("kvtier", a_blocks[0][0]))
            await a.delete([k for k, _ in a_blocks])
            await b.delete([k for k, _ in b_blocks])
        finally:
            await a.close()
            await b.close()
            await raw_b.aclose()
    run(world, body())


def test_a_killed_master_is_misses_during_failover_and_hits_after(world: ManyHosts) -> None:
    cluster = world.cluster
    blocks = make_blocks(SMALL, 24, tag=b"failover")
    run(world, _put(world, blocks))
    cluster.wait_replicated()
    victim = cluster.master_of(block_key("kvtier", blocks[0][0]))
    slots = next(v.slots for v in cluster.topology() if v.address == victim.address)
    on_victim = [any(lo <= key_slot(block_key("kvtier", k)) <= hi for lo, hi in slots) for k, _ in blocks]
    cluster.kill(victim)
    try:
        async def body() -> None:
            r = backend(world, timeout_s=1.0)
            try:
                during = await r.get([k for k, _ in blocks])  # no exception, whatever the state
                for (_, v), got, lost in zip(blocks, during, on_victim):
                    assert got is None if lost else got in (None, v)
                assert r.counters.misses >= sum(on_victim)
                await asyncio.to_thread(cluster.wait_failover, victim)
                after = await until_hits(r, blocks)
                assert after == [v for _, v in blocks]
            finally:
                await r.close()
        run(world, body())
    finally:
        cluster.start_node(victim)  # rejoins as a replica of the promoted one
    cluster.wait_healthy()
    run(world, _delete(world, blocks))


def test_a_host_cut_off_is_misses_within_the_timeout_then_hits_when_it_returns(world: ManyHosts) -> None:
    cluster = world.cluster
    blocks = make_blocks(SMALL, 24, tag=b"link-cut")
    run(world, _put(world, blocks))
    cluster.wait_replicated()
    victim = cluster.master_of(block_key("kvtier", blocks[0][0]))
    r = backend(world, timeout_s=0.5)
    victim.host.link_down()
    try:
        async def during() -> list[bytes | None]:
            # Bounded by the call's timeout; wait_for only turns a hang into a failure.
            return await asyncio.wait_for(r.get([k for k, _ in blocks]), 30)
        got = run(world, during())
        assert got[0] is None
        assert all(g in (None, v) for g, (_, v) in zip(got, blocks))
        assert r.counters.errors.get("timeout", 0) >= 1
    finally:
        victim.host.link_up()
    cluster.wait_healthy()

    async def after() -> None:
        try:
            assert await until_hits(r, blocks) == [v for _, v in blocks]
        finally:
            await r.close()
    run(world, after())
    run(world, _delete(world, blocks))


def test_the_breaker_opens_on_a_dead_cluster_and_closes_when_it_returns(world: ManyHosts) -> None:
    blocks = make_blocks(SMALL, 6, tag=b"breaker")
    keys = [k for k, _ in blocks]
    run(world, _put(world, blocks))
    r = backend(world, timeout_s=0.3, breaker=BreakerSettings(failures=2, backoff_s=0.5, max_backoff_s=1.0))
    for host in world.servers:
        host.link_down()
    try:
        async def dead() -> None:
            for _ in range(2):
                assert await asyncio.wait_for(r.get(keys), 30) == [None] * 6
            assert r.breaker_state is BreakerState.OPEN and r.counters.breaker_opens == 1
            errors = sum(r.counters.errors.values())
            assert await r.get(keys) == [None] * 6  # refused at once, not tried
            assert r.counters.skipped >= 1 and sum(r.counters.errors.values()) == errors
        run(world, dead())
    finally:
        for host in world.servers:
            host.link_up()

    async def back() -> None:
        try:
            assert await until_hits(r, blocks) == [v for _, v in blocks]
            assert r.breaker_state is BreakerState.CLOSED and r.counters.breaker_state == "closed"
        finally:
            await r.close()
    run(world, back())
    world.cluster.wait_healthy()
    run(world, _delete(world, blocks))


async def _put(world: ManyHosts, blocks: Sequence[tuple[RemoteKey, bytes]]) -> None:
    r = backend(world)
    try:
        assert await r.put(blocks) == [True] * len(blocks)
    finally:
        await r.close()


async def _delete(world: ManyHosts, blocks: Sequence[tuple[RemoteKey, bytes]]) -> None:
    r = backend(world)
    try:
        await r.delete([k for k, _ in blocks])
    finally:
        await r.close()


def test_a_host_gone_long_enough_for_failover_is_served_by_the_promoted_replicas(world: ManyHosts) -> None:
    cluster = world.cluster
    blocks = make_blocks(SMALL, 24, tag=b"host-gone")
    run(world, _put(world, blocks))
    cluster.wait_replicated()
    victim = cluster.master_of(block_key("kvtier", blocks[0][0]))
    r = backend(world, timeout_s=0.5)
    victim.host.link_down()
    try:
        assert run(world, r.get([blocks[0][0]])) == [None]
        # The other hosts' nodes promote the cut master's replica; the client, still talking to
        # the old master, must find the new one without the link coming back (and soon: a client
        # that only learns the new map by luck took 40 s here).
        cluster.wait_failover(cluster.node_at(victim.address), among=[n for n in cluster.live()
                                                                      if n.host is not victim.host])
        assert run(world, until_hits(r, blocks, timeout_s=15)) == [v for _, v in blocks]
    finally:
        victim.host.link_up()
        run(world, r.close())
    cluster.wait_healthy()
    run(world, _delete(world, blocks))
