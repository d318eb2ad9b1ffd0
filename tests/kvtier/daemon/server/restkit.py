"""Helpers of the REST, metrics and admin-command tests: a real store, context and REST app.

Blocks are real records (kvtier_protocol header + payload) whose keys are a registered
namespace's ``block_keys`` of token ids, so ``/v1/lookup`` finds them by tokens.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.config import AuthConfig, DaemonConfig, DataPlaneConfig, EventsConfig, RestConfig
from kvtier.daemon.server.auth import Auth
from kvtier.daemon.server.context import DaemonContext
from kvtier.daemon.server.events import EventHub
from kvtier.daemon.server.metrics import Metrics
from kvtier.daemon.server.rest import create_rest_app
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.store import TieredStore

TOKEN = "test-token-0123456789"
SALT = "tenant-salt-do-not-leak"
NS = Namespace(model="test/model", revision="r1", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
               kv_dtype="float16", block_tokens=16, hash_tokens=16, tenant_salt=SALT)
NS_HEX = NS.ns_id.hex()
OTHER = Namespace(model="other/model", revision="r2", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
                  kv_dtype="float16", block_tokens=16, hash_tokens=16)  # the tests never register it
BLOCK = NS.block_payload_bytes()  # 4096: canonical [1, 2, 1, 16, 64] float16
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def store_config(tmp_path: Path, **overrides: object) -> StoreConfig:
    """A small store: 8 host blocks, a disk tier under ``tmp_path/disk``, no prefault or pinning."""
    settings: dict[str, object] = dict(
        host_bytes=8 * BLOCK, host_segment_bytes=8 * BLOCK, host_name_prefix=f"kvtier-rest-{os.getpid()}",
        host_prefault=False, host_pin=False, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 24)
    settings.update(overrides)
    return StoreConfig(**settings)  # type: ignore[arg-type]


def tokens_for(num_blocks: int, seed: int = 0) -> list[int]:
    """Token ids filling ``num_blocks`` whole blocks of :data:`NS`."""
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(num_blocks * NS.block_tokens)]


async def put_tokens(store: TieredStore, tokens: list[int], ns: Namespace = NS, *, batch: int = 4) -> list[bytes]:
    """Store every full block of ``tokens`` (reserve, write, commit; ``batch`` blocks a time, so
    that older blocks are demoted to disk when host memory fills); returns their chain hashes."""
    keys = ns.block_keys(tokens)
    for start in range(0, len(keys), batch):
        await _put(store, ns, keys[start:start + batch], keys[start - 1] if start else None)
    return keys


async def _put(store: TieredStore, ns: Namespace, keys: list[bytes], parent: bytes | None) -> None:
    size = ns.block_payload_bytes()
    res = await store.reserve(ns.ns_id, keys, [size] * len(keys))
    headers: list[bytes | None] = []
    for key, slot in zip(keys, res.slots):
        payload = random.Random(key).randbytes(size)
        if slot is not None:
            store.host.view(slot)[:] = payload
        h = BlockHeader(ns_id=ns.ns_id, chain_hash=key, parent_hash=parent,
                        num_tokens=ns.block_tokens, layout="canonical",
                        shape=(ns.num_layers, 2, ns.num_kv_heads, ns.block_tokens, ns.head_dim),
                        dtype=ns.kv_dtype, codec="raw", sections=(Section("payload", 0, size),),
                        payload_len=size, checksum=payload_checksum(payload), ns_fields=ns.to_wire(),
                        created_ms=int(time.time() * 1000) - 5000)
        headers.append(encode_header(h))
        parent = key
    assert res.num_reserved == len(keys), res.status
    assert all(await store.commit(res.lease_id, headers))


@asynccontextmanager
async def open_ctx(tmp_path: Path, *, token: str | None = TOKEN, ready: bool = True, public_reads: bool = True,
                   **store_overrides: object) -> AsyncIterator[DaemonContext]:
    """A started store with :data:`NS` registered, inside a daemon context; closed on exit.

    ``public_reads``: most tests here are about what the store routes answer, so they read
    without a token (``rest.public_reads``); the default (reads need a token) is tested with False.
    """
    config = DaemonConfig(store=store_config(tmp_path, **store_overrides),
                          dataplane=DataPlaneConfig(socket=str(tmp_path / "kvtier.sock")),
                          rest=RestConfig(public_reads=public_reads),
                          events=EventsConfig(), auth=AuthConfig(token=token), data_dir=str(tmp_path))
    store = TieredStore(config.store)
    await store.start()
    metrics = Metrics(gpu=False)
    events = EventHub(config.events, metrics)
    ctx = DaemonContext(config, store, Auth.from_config(config.auth, config.data_dir) if token else Auth(None),
                        metrics, events, started_at=time.time(), ready=ready)
    metrics.bind(ctx)
    store.register_namespace(NS)
    try:
        yield ctx
    finally:
        events.close()
        await store.close()


@asynccontextmanager
async def rest_client(ctx: DaemonContext, *, heartbeat_s: float = 15.0) -> AsyncIterator[TestClient]:
    """An aiohttp test client on the REST app of ``ctx`` (127.0.0.1, a free port)."""
    app = create_rest_app(ctx, heartbeat_s=heartbeat_s)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client
