"""The remote tier wired into the daemon (issue 23): daemons on simulated hosts share a Redis
Cluster of 3 masters + 3 replicas. A prefix the reference engine prefilled on host A is a hit on
host B (its own daemon, empty local tiers) with ``torch.equal`` logits; A's daemon killed, a
master killed, B's link cut: misses, never an error or a wrong block, and hits again afterwards;
a restarted daemon serves namespaces it never saw; planted garbage is a counted, deleted miss.

Hosts: the cluster runs on h1..h3; daemon A on h1; daemon B on h4, the client host (no cluster
node there, so cutting its link cuts off B alone). The engines run in the test process and reach
their daemon through its unix socket (a file: no network). One cluster for the module.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings
from kvtier.daemon.server.remote_views import REMOTE_METRIC_NAMES
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.checkpoint import make_random_checkpoint
from kvtier.engine.config import ModelConfig
from tests.kvtier.daemon.remote.hostdaemon import ROOT, HostDaemon
from tests.kvtier.daemon.remote.remotekit import make_blocks, make_record, namespace_for
from tests.kvtier.waitkit import wait_until
from tests.manyhosts import ManyHosts, many_hosts

MODEL = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                    num_kv_heads=2, head_dim=16, max_position_embeddings=2048)
PROMPT_TOKENS = 1000  # ~1K tokens: 62 full blocks of 16, the last 8 tokens always computed
FULL = PROMPT_TOKENS // 16 * 16
ONE = SamplingParams(max_tokens=1)
SMALL = namespace_for(16 << 10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ManyHosts]:
    with many_hosts(tmp_path_factory.mktemp("hosts")) as w:
        yield w


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    make_random_checkpoint(path, MODEL, seed=7)
    return path


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs on a shared 2-core machine
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def daemons(world: ManyHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, HostDaemon]]:
    workdir = tmp_path_factory.mktemp("daemons")
    out = {"a": HostDaemon(world.servers[0], workdir, world.cluster.url),
           "b": HostDaemon(world.client, workdir, world.cluster.url)}
    try:
        for d in out.values():
            d.start()
        yield out
    finally:
        for d in out.values():
            d.close()


@pytest.fixture(autouse=True)
def healthy(world: ManyHosts, daemons: dict[str, HostDaemon]) -> None:
    world.cluster.wait_healthy()
    for d in daemons.values():
        if not d.alive:
            d.start()


@pytest.fixture(scope="module")
def cluster(world: ManyHosts) -> Iterator[RedisClusterBlocks]:
    """The test's own connection to the cluster, from the client host (plants and checks keys)."""
    r = RedisClusterBlocks(RedisClusterSettings(world.cluster.url, timeout_s=10.0))
    yield r
    world.loop.run(r.close())


def prompt(seed: int) -> list[int]:
    return torch.randint(0, MODEL.vocab_size, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(seed)).tolist()


def run_engine(model_dir: Path, daemon: HostDaemon | None, tokens: Sequence[int]):
    """One request on a fresh engine (against ``daemon``, or none: a recompute); its output."""
    with Engine(model_dir, num_pages=128, kvtier_address=daemon.address if daemon else None,
                timeout_s=30.0) as engine:
        return engine.generate([list(tokens)], ONE)[0]


def recompute(model_dir: Path, tokens: Sequence[int]) -> torch.Tensor:
    return run_engine(model_dir, None, tokens).first_logits


def prefill_on(model_dir: Path, daemon: HostDaemon, tokens: Sequence[int]) -> None:
    """Prefill on ``daemon``'s host and wait until its daemon uploaded every full block."""
    before = daemon.remote()["uploaded"]
    out = run_engine(model_dir, daemon, tokens)
    assert out.loaded_tokens == 0
    wait_for_uploads(daemon, before + FULL // 16)


def wait_for_uploads(daemon: HostDaemon, uploaded: int) -> None:
    def done() -> bool:
        r = daemon.remote()
        return r["uploaded"] >= uploaded and r["queue_blocks"] == 0
    wait_until(done, what=f"{daemon.host.name}'s uploads")


def assert_exact(model_dir: Path, out, tokens: Sequence[int]) -> None:
    """A hit or a miss, never wrong KV: the logits equal a recompute's, bit for bit."""
    assert torch.equal(out.first_logits, recompute(model_dir, tokens))


def plant(world: ManyHosts, cluster: RedisClusterBlocks, items: Sequence[tuple[RemoteKey, bytes]]) -> None:
    """Store ``items`` (again until every one is acknowledged: after a failover the test's own
    client may need a call or two to learn the new topology)."""
    wait_until(lambda: all(world.loop.run(cluster.put(items))), what="the planted values stored")


def lookup_hits(daemon: HostDaemon, ns_id: bytes, hashes: Sequence[bytes]) -> int:
    with daemon.client() as c:
        return c.lookup(ns_id, hashes).num_hits


# --- cross-host reuse -----------------------------------------------------------------------------


def test_a_prefix_prefilled_on_host_a_is_an_exact_hit_on_host_b(world: ManyHosts, model_dir: Path,
                                                                daemons: dict[str, HostDaemon],
                                                                tmp_path: Path) -> None:
    a, b = daemons["a"], daemons["b"]
    tokens = prompt(1)
    # The reference engine on host A, as a user runs it: a process inside A's namespace.
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(map(str, tokens)))
    done = subprocess.run(world.servers[0].argv(sys.executable, "-m", "kvtier", "engine", "generate",
                                                "--model", str(model_dir), "--kvtier", a.address,
                                                "--prompt-file", str(prompt_file), "--max-tokens", "1", "--json"),
                          cwd=ROOT, env=a.env, capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["saved_blocks"] == FULL // 16 and result["loaded_tokens"] == 0
    wait_for_uploads(a, FULL // 16)
    assert a.remote()["namespaces_uploaded"] == 1
    # Host B: its own daemon, nothing local; every full block comes from the remote tier.
    assert b.remote()["fetched_blocks"] == 0
    out = run_engine(model_dir, b, tokens)
    assert out.loaded_tokens == FULL, json.dumps(b.remote())
    assert_exact(model_dir, out, tokens)
    assert out.token_ids == [result["token_ids"][0]]
    r = b.remote()
    assert r["fetched_blocks"] == FULL // 16 and r["lookup_hits"] >= FULL // 16
    assert r["namespaces_fetched"] == 1  # B never saw the namespace: learnt from the cluster
    assert r["bad_values"] == {} and r["breaker_state"] == "closed"


def test_host_a_gone_b_still_hits(model_dir: Path, daemons: dict[str, HostDaemon]) -> None:
    a, b = daemons["a"], daemons["b"]
    tokens = prompt(2)
    prefill_on(model_dir, a, tokens)
    a.kill()
    out = run_engine(model_dir, b, tokens)
    assert out.loaded_tokens == FULL
    assert_exact(model_dir, out, tokens)


def test_a_restarted_daemon_serves_remote_blocks_of_namespaces_it_never_saw(model_dir: Path,
                                                                            daemons: dict[str, HostDaemon]) -> None:
    a, b = daemons["a"], daemons["b"]
    tokens = prompt(3)
    prefill_on(model_dir, a, tokens)
    b.stop()
    b.start()  # a new process: no local tier, no namespace registered
    assert b.remote()["namespaces_fetched"] == 0
    out = run_engine(model_dir, b, tokens)
    assert out.loaded_tokens == FULL
    assert_exact(model_dir, out, tokens)
    assert b.remote()["namespaces_fetched"] == 1


# --- faults ---------------------------------------------------------------------------------------


def test_a_master_killed_misses_during_failover_and_hits_after(world: ManyHosts, model_dir: Path,
                                                               daemons: dict[str, HostDaemon],
                                                               cluster: RedisClusterBlocks) -> None:
    a, b = daemons["a"], daemons["b"]
    during, after = prompt(4), prompt(5)
    prefill_on(model_dir, a, during)
    prefill_on(model_dir, a, after)
    probe = make_blocks(SMALL, 48, tag=b"failover")  # 48 keys: every shard holds some
    plant(world, cluster, probe)
    world.cluster.wait_replicated()
    dead = world.cluster.masters()[0]
    world.cluster.kill(dead)
    try:
        out = run_engine(model_dir, b, during)  # no error: what the dead shard held is a miss
        assert out.loaded_tokens <= FULL
        assert_exact(model_dir, out, during)
        world.cluster.wait_failover(dead)
        hashes = [k.chain_hash for k, _ in probe]
        wait_until(lambda: lookup_hits(b, SMALL.ns_id, hashes) == len(probe), what="B's hits after failover")
        out = run_engine(model_dir, b, after)
        assert out.loaded_tokens == FULL
        assert_exact(model_dir, out, after)
    finally:
        world.cluster.start_node(dead)  # it rejoins as a replica
        world.cluster.wait_healthy()


def test_a_cut_link_is_misses_then_hits_when_it_returns(world: ManyHosts, model_dir: Path,
                                                        daemons: dict[str, HostDaemon],
                                                        cluster: RedisClusterBlocks) -> None:
    a, b = daemons["a"], daemons["b"]
    cut, back = prompt(6), prompt(7)
    prefill_on(model_dir, a, cut)
    prefill_on(model_dir, a, back)
    probe = make_blocks(SMALL, 16, tag=b"cut")
    plant(world, cluster, probe)
    hashes = [k.chain_hash for k, _ in probe]
    world.client.link_down()  # B's host, alone: no cluster node there
    try:
        out = run_engine(model_dir, b, cut)
        assert out.loaded_tokens == 0  # every lookup timed out into a miss, no error
        assert_exact(model_dir, out, cut)
        assert lookup_hits(b, SMALL.ns_id, hashes) == 0
        assert b.alive
    finally:
        world.client.link_up()
    wait_until(lambda: lookup_hits(b, SMALL.ns_id, hashes) == len(probe), what="B's hits after the link returned")
    out = run_engine(model_dir, b, back)
    assert out.loaded_tokens == FULL
    assert_exact(model_dir, out, back)
    errors = b.remote()["errors"]
    assert errors.get("timeout", 0) + errors.get("connection", 0) > 0


# --- bad input ------------------------------------------------------------------------------------


def _truncated(record: bytes) -> bytes:
    return record[:-100]


def _bad_header(record: bytes) -> bytes:
    return record[:40] + bytes([record[40] ^ 0xFF]) + record[41:]  # inside the header map: its checksum fails


def _bad_checksum(record: bytes) -> bytes:
    return record[:-1] + bytes([record[-1] ^ 0x01])  # the payload's last byte


@pytest.mark.parametrize("reason, spoil", [("truncated", _truncated), ("bad_header", _bad_header),
                                           ("bad_checksum", _bad_checksum), ("wrong_block", None)])
def test_planted_garbage_is_a_counted_miss_and_is_deleted(world: ManyHosts, daemons: dict[str, HostDaemon],
                                                          cluster: RedisClusterBlocks, reason: str, spoil) -> None:
    b = daemons["b"]
    blocks = make_blocks(SMALL, 6, tag=reason.encode())
    key, record = blocks[3]
    if spoil is not None:
        bad = spoil(record)
    else:  # a whole, valid record of the same chain hash in another namespace
        other = namespace_for(16 << 10, model="another-model")
        bad = make_record(other, key.chain_hash, seed=3)
    plant(world, cluster, blocks[:3] + [(key, bad)] + blocks[4:])
    before = b.remote()["bad_values"].get(reason, 0)
    hashes = [k.chain_hash for k, _ in blocks]
    with b.client() as c:
        got = c.load(SMALL.ns_id, hashes)
    assert got == [v for _, v in blocks[:3]]  # the good ones, byte for byte; then a miss
    assert b.remote()["bad_values"].get(reason, 0) == before + 1
    wait_until(lambda: world.loop.run(cluster.exists([key])) == [False], what="the bad value deleted")
    assert world.loop.run(cluster.exists([blocks[4][0]])) == [True]  # only the bad one
    assert b.alive


def test_tenants_keys_are_out_of_reach_of_another_tenants_user(world: ManyHosts, cluster: RedisClusterBlocks,
                                                               tmp_path: Path) -> None:
    # A daemon whose cluster user may touch only another tenant's keys: the default store's
    # blocks (``kvtier:default:*``) are misses for it, never an error.
    password = tmp_path / "bob.password"
    password.write_text("bob-secret-1\n")
    world.cluster.acl_setuser("bob", "on", ">bob-secret-1", "~kvtier:bob:*", "+@all")
    blocks = make_blocks(SMALL, 4, tag=b"tenants")
    plant(world, cluster, blocks)
    bob = HostDaemon(world.servers[1], tmp_path, world.cluster.url,
                     env={"KVTIER_REMOTE__USER": "bob", "KVTIER_REMOTE__PASSWORD_FILE": str(password)})
    try:
        bob.start()
        with bob.client() as c:
            assert c.lookup(SMALL.ns_id, [k.chain_hash for k, _ in blocks]).num_hits == 0
            assert c.load(SMALL.ns_id, [k.chain_hash for k, _ in blocks]) == []
        assert bob.remote()["errors"].get("auth", 0) > 0
        assert "bob-secret-1" not in bob.log()
    finally:
        bob.close()


def test_remote_keys_are_spread_under_the_tenant_prefix(world: ManyHosts, cluster: RedisClusterBlocks) -> None:
    # What the daemons wrote: block records under kvtier:default:<ns>:<hash>, none pinned by a hash tag.
    keys = world.loop.run(_scan(world))
    blocks = [k for k in keys if not k.startswith(b"kvtier:default:ns:")]
    assert blocks and all(k.startswith(b"kvtier:default:") and b"{" not in k for k in keys)
    assert len({world.cluster.master_of(k).address for k in blocks}) == 3


async def _scan(world: ManyHosts) -> list[bytes]:
    from redis.asyncio.cluster import RedisCluster

    host, port = world.cluster.url.removeprefix("redis+cluster://").split(",")[0].split(":")
    client = RedisCluster(host=host, port=int(port))
    try:
        return [k async for k in client.scan_iter(match="kvtier:*", count=1000)]
    finally:
        await client.aclose()


def test_status_tiers_metrics_and_events_show_the_remote_tier(world: ManyHosts, model_dir: Path,
                                                              daemons: dict[str, HostDaemon], tmp_path: Path) -> None:
    # A daemon with REST on its own host's loopback; the test reads it from inside that host.
    c = HostDaemon(world.client, tmp_path, world.cluster.url, rest="127.0.0.1:0")
    try:
        c.start()
        assert c.rest_url is not None
        token = (c.data_dir / "token").read_text().strip()
        subscribed = threading.Event()
        remote_event = asyncio.run_coroutine_threadsafe(_first_event(c.rest_url, token, '"REMOTE"', subscribed),
                                                        world.loop.loop)
        assert subscribed.wait(60), "the event stream did not open"
        prefill_on(model_dir, c, prompt(8))
        event = json.loads(remote_event.result(timeout=60))
        assert event["type"] == "BlockStored" and event["medium"] == "REMOTE" and event["tier"] == "remote"
        tiers, metrics = world.loop.run(_read_rest(c.rest_url, token))
        [row] = [t for t in tiers if t["tier"] == "remote"]
        assert row["medium"] == "REMOTE" and row["enabled"] and row["capacity_bytes"] is None
        assert row["remote"]["uploaded"] == FULL // 16 and row["remote"]["breaker_state"] == "closed"
        assert row["bytes_in"] > 0 and row["remote"]["address"].startswith("redis+cluster://")
        assert row["precision"] == {"codec": "raw", "k_axis": "channel", "compression": "none", "models": []}
        assert 'kvtier_remote_blocks_total{direction="up",tenant=""} 62.0' in metrics
        assert 'kvtier_remote_breaker_state{state="closed",tenant=""} 1.0' in metrics
        assert "kvtier_remote_fetch_seconds_bucket" in metrics and "kvtier_remote_upload_queue_bytes" in metrics
        samples = set(re.findall(r"^(kvtier_remote_[a-z_]+)", metrics, re.M))
        # What the dashboard may query is what is exported (errors and bad values only once there are some).
        assert samples == set(REMOTE_METRIC_NAMES) - {"kvtier_remote_errors_total", "kvtier_remote_bad_values_total"}
        status = subprocess.run(world.client.argv(sys.executable, "-m", "kvtier", "status", "--rest", c.rest_url,
                                                  "--token-file", str(c.data_dir / "token")),
                                cwd=ROOT, env=c.env, capture_output=True, text=True, timeout=120, check=True).stdout
        assert "remote" in status and "breaker closed" in status and "up 62 blocks" in status
        blocks = world.loop.run(_get_json(c.rest_url + "/v1/blocks?limit=5", token))
        assert all("remote" in b["tiers"] for b in blocks["blocks"])
    finally:
        c.close()


async def _get_json(url: str, token: str):
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        async with s.get(url) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def _read_rest(base: str, token: str) -> tuple[list, str]:
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        async with s.get(base + "/v1/tiers") as r:
            tiers = (await r.json())["tiers"]
        async with s.get(base + "/metrics") as r:
            metrics = await r.text()
    return tiers, metrics


async def _first_event(base: str, token: str, needle: str, subscribed: threading.Event) -> str:
    """The JSON of the first server-sent event that contains ``needle`` (``subscribed`` is set once
    the stream is open, so nothing published after it is missed)."""
    import aiohttp

    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as s:
        async with s.get(base + "/v1/events") as r:
            async for line in r.content:
                text = line.decode().strip()
                if text.startswith(": kvtier events"):
                    subscribed.set()
                elif text.startswith("data: ") and needle in text:
                    return text.removeprefix("data: ")
    raise AssertionError("the event stream ended")


# --- write modes ----------------------------------------------------------------------------------

BIG = namespace_for(1 << 20, model="write-modes")  # 1 MiB blocks


def test_write_back_uploads_host_victims_and_read_only_never_uploads(world: ManyHosts, daemons: dict[str, HostDaemon],
                                                                     tmp_path: Path) -> None:
    b = daemons["b"]
    back = HostDaemon(world.servers[1], tmp_path, world.cluster.url, host_bytes="8MiB",
                      env={"KVTIER_REMOTE__WRITE_MODE": "back"})
    ro = HostDaemon(world.servers[2], tmp_path, world.cluster.url, env={"KVTIER_REMOTE__WRITE_MODE": "read-only"})
    try:
        back.start()
        ro.start()
        blocks = make_blocks(BIG, 16, tag=b"write-back")
        hashes = [k.chain_hash for k, _ in blocks]
        with back.client() as c:
            for key, record in blocks:  # one at a time: the 8 MiB host tier evicts the oldest
                assert c.save(BIG.ns_id, [(key.chain_hash, record)]) == ["stored"]
        r = back.remote()
        assert r["uploads_queued"] >= 8 and r["upload_drops"] == 0  # evicted ones only, not at commit
        wait_for_uploads(back, r["uploads_queued"])
        with b.client() as c:  # the evicted first half is on the cluster: a hit on another host
            got = c.load(BIG.ns_id, hashes[:8])
        assert got == [v for _, v in blocks[:8]]
        more = make_blocks(BIG, 4, tag=b"read-only")
        with ro.client() as c:
            assert c.save(BIG.ns_id, [(k.chain_hash, v) for k, v in more]) == ["stored"] * 4
            assert c.load(BIG.ns_id, hashes[:2]) == [v for _, v in blocks[:2]]  # fetches all the same
        r = ro.remote()
        assert r["uploads_queued"] == 0 and r["blocks_up"] == 0 and r["fetched_blocks"] == 2
    finally:
        back.close()
        ro.close()


def test_a_full_upload_queue_drops_and_counts_never_waits(world: ManyHosts, tmp_path: Path) -> None:
    small = HostDaemon(world.servers[1], tmp_path, world.cluster.url, env={"KVTIER_REMOTE__UPLOAD_QUEUE_BYTES": "2MiB"})
    try:
        small.start()
        blocks = make_blocks(BIG, 8, tag=b"queue")
        with small.client() as c:  # one commit of 8 MiB: 2 MiB fit the queue, the rest is dropped
            assert c.save(BIG.ns_id, [(k.chain_hash, v) for k, v in blocks]) == ["stored"] * 8
        r = small.remote()
        assert r["uploads_queued"] == 2 and r["upload_drops"] == 6 and r["upload_drop_bytes"] == 6 << 20
        wait_for_uploads(small, 2)
    finally:
        small.close()


# --- the vLLM connector: prefill/decode disaggregation through the shared tier --------------------


def test_vllm_connector_producer_on_a_consumer_on_b(daemons: dict[str, HostDaemon],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.connectors.kvtier_vllm import vllmkit

    made = vllmkit.vllm_config

    def role(kv_role: str):
        def config(*args, **kwargs):  # the kv_transfer_config a P/D deployment gives each side
            cfg = made(*args, **kwargs)
            cfg.kv_transfer_config.kv_role = kv_role
            cfg.kv_transfer_config.is_kv_producer = kv_role == "kv_producer"
            return cfg
        return config

    a, b = daemons["a"], daemons["b"]
    model = "pd-remote-test"
    monkeypatch.setattr(vllmkit, "vllm_config", role("kv_producer"))
    producer = vllmkit.MiniEngine(a.address, "v033-lbnhc", model=model)
    monkeypatch.setattr(vllmkit, "vllm_config", role("kv_consumer"))
    consumer = vllmkit.MiniEngine(b.address, "v033-lbnhc", model=model)
    try:
        before = a.remote()["uploaded"]
        prompt = torch.randint(0, 32000, (6 * vllmkit.BLOCK + 2,), generator=torch.Generator().manual_seed(9)).tolist()
        ra = producer.add(vllmkit.Request("p", prompt))
        producer.run_until_idle()
        saved = {j: producer.layer_pages(ra.block_ids[j]) for j in range(6)}
        producer.finish(ra)
        producer.settle()
        wait_for_uploads(a, before + 6)
        fetched = b.remote()["fetched_blocks"]
        rb = consumer.add(vllmkit.Request("c", prompt))
        consumer.step()  # lookup: 6 full blocks, all on the remote tier for B
        assert consumer.matched["c"] == 6 * vllmkit.BLOCK
        consumer.run_until_idle()
        assert not consumer.invalid
        for j in range(6):
            for got, want in zip(consumer.layer_pages(rb.block_ids[j]), saved[j]):
                assert torch.equal(got, want), f"block {j} differs on the consumer"
        assert b.remote()["fetched_blocks"] == fetched + 6
    finally:
        producer.close()
        consumer.close()
