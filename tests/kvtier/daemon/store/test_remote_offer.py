"""Write-through uploads of blocks that come back into host without a commit: promoted from disk,
or adopted from the host tier a crashed store left. The ones the cluster lacks are uploaded
(within the upload queue's byte cap, batch by batch), the ones it holds are only marked remote.
Against a real Redis Cluster on loopback (3 masters + 3 replicas of ``redis-server``)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from kvtier.bench.remote import LoopbackCluster
from kvtier.daemon.remote.backend import RemoteKey
from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.remote_link import RemoteOptions
from kvtier.daemon.store.store import TieredStore
from kvtier.daemon.store.types import Tier
from tests.kvtier.daemon.store.storekit import BLOCK, NS, get, make_rec, put
from tests.kvtier.daemon.store.test_host_recovery import HOST, SIZES, _run_and_kill


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.skip("redis-server and redis-cli are needed")
    c = LoopbackCluster()
    c.start()
    try:
        yield c.url
    finally:
        c.stop()


def _backend(url: str, prefix: str) -> RedisClusterBlocks:
    return RedisClusterBlocks(RedisClusterSettings(url, timeout_s=10.0, prefix=prefix))


async def _until(what: str, condition: Callable[[], Awaitable[bool]], timeout_s: float = 60.0) -> None:
    """Wait until ``condition()`` holds (polling the store and cluster), or fail after ``timeout_s``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await condition():
        assert loop.time() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)  # poll interval of the condition


def _config(tmp_path: Path, **kw: object) -> StoreConfig:
    settings: dict[str, object] = dict(host_bytes=16 * BLOCK, host_segment_bytes=16 * BLOCK,
                                       host_name_prefix=f"kvtier-offer-{os.getpid()}", host_prefault=False,
                                       host_pin=False, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 24)
    settings.update(kw)
    return StoreConfig(**settings)  # type: ignore[arg-type]


async def test_blocks_promoted_from_disk_are_uploaded_where_the_cluster_lacks_them(cluster: str,
                                                                                   tmp_path: Path) -> None:
    prefix = "offer" + secrets.token_hex(4)
    recs = [make_rec(i) for i in range(6)]
    # A store that never uploads (read-only) writes the blocks; a clean close leaves them on disk.
    first = TieredStore(_config(tmp_path), remote=_backend(cluster, prefix),
                        remote_options=RemoteOptions(write_mode="read-only"))
    await first.start()
    try:
        assert await put(first, recs) == [True] * 6
    finally:
        await first.close()
    probe = _backend(cluster, prefix)
    keys = [RemoteKey.of("default", NS + r.chain_hash) for r in recs]
    try:
        assert await probe.exists(keys) == [False] * 6
        # Another host uploaded block 1 meanwhile: it is only marked, not uploaded again.
        assert await probe.put([(keys[1], recs[1].header + recs[1].payload)]) == [True]
        store = TieredStore(_config(tmp_path), remote=_backend(cluster, prefix),
                            remote_options=RemoteOptions(write_mode="through"))
        await store.start()
        try:
            assert all(store.info(NS, r.chain_hash).tiers == [Tier.DISK] for r in recs)  # type: ignore[union-attr]
            assert await get(store, NS, [r.chain_hash for r in recs[:4]]) == [(r.header, r.payload) for r in recs[:4]]
            link = store.remote

            async def settled() -> bool:
                return link.counters.queue_blocks == 0 and not link._tasks and link.counters.uploaded == 3

            await _until("the three promoted blocks the cluster lacked uploaded", settled)
            assert await probe.exists(keys) == [True] * 4 + [False] * 2  # 4 and 5 were not promoted
            got = await probe.get(keys[:4])
            assert got == [r.header + r.payload for r in recs[:4]]
            assert all(store.info(NS, r.chain_hash).tiers[-1] == Tier.REMOTE for r in recs[:4])  # type: ignore[union-attr]
            assert link.counters.upload_drops == 0
        finally:
            await store.close()
    finally:
        await probe.close()


async def test_host_blocks_adopted_after_a_crash_are_uploaded_batch_by_batch(cluster: str,
                                                                            tmp_path: Path) -> None:
    prefix = "offer" + secrets.token_hex(4)
    host_prefix = f"kvtier-offer-crash-{os.getpid()}"
    disk = tmp_path / "disk"
    _run_and_kill(disk, host_prefix)  # 24 blocks written, 3 and 4 deleted, killed: no remote tier there
    kept = [i for i in range(24) if i not in (3, 4)]
    # A queue that holds a few blocks only: the 22 go up in several batches, none dropped.
    cap = 3 * max(SIZES)
    store = TieredStore(_config(tmp_path, host_bytes=HOST, host_segment_bytes=HOST // 2, host_name_prefix=host_prefix),
                        remote=_backend(cluster, prefix),
                        remote_options=RemoteOptions(write_mode="through", upload_queue_bytes=cap))
    probe = _backend(cluster, prefix)
    try:
        await store.start()
        assert store.host_recovery is not None and store.host_recovery.adopted == len(kept)
        link = store.remote

        async def settled() -> bool:
            return link.counters.uploaded == len(kept) and link.counters.queue_blocks == 0 and not link._tasks

        await _until("every adopted block uploaded", settled)
        assert link.counters.upload_drops == 0
        assert link.counters.queue_bytes == 0
        keys = [RemoteKey.of("default", NS + make_rec(i).chain_hash) for i in kept]
        got = await probe.get(keys)
        want = [make_rec(i, nbytes=SIZES[i % 4]) for i in kept]
        assert got == [r.header + r.payload for r in want]
        assert all(store.info(NS, r.chain_hash).tiers == [Tier.HOST, Tier.REMOTE] for r in want)  # type: ignore[union-attr]
    finally:
        await store.close()
        await probe.close()
