"""Fixtures of the TieredStore tests: a started store in a temporary directory, closed at teardown.

The store runs on the real host (shared memory) and disk (RocksDB) tiers.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.store import TieredStore
from tests.kvtier.daemon.store.storekit import BLOCK

OpenStore = Callable[..., Awaitable[TieredStore]]


@pytest.fixture
async def open_store(tmp_path) -> AsyncIterator[OpenStore]:
    """Factory of started stores (disk under ``tmp_path/disk``); each is closed at teardown."""
    opened: list[TieredStore] = []

    async def _open(*, now: Callable[[], float] | None = None, **overrides: object) -> TieredStore:
        settings: dict[str, object] = dict(
            host_bytes=16 * BLOCK, host_segment_bytes=16 * BLOCK, host_name_prefix=f"kvtier-test-{os.getpid()}",
            host_prefault=False, host_pin=False, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 24)
        settings.update(overrides)
        store = TieredStore(StoreConfig(**settings), **({"now": now} if now else {}))
        await store.start()
        opened.append(store)
        return store

    yield _open
    for store in opened:
        await store.close()
