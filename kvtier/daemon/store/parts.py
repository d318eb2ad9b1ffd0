"""Opening and closing what a started store is made of: the I/O pool, the tiers, the mover, the
reader and the writer. :class:`~kvtier.daemon.store.store.TieredStore` holds one :class:`StoreParts`
between ``start`` and ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvtier_protocol.errors import KVTierError

from kvtier.daemon.store.audit import rebuild_index
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.disk_ram import ram_budget
from kvtier.daemon.store.flush import persist_at_close
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.host_recovery import HostRecovery, adopt_host_blocks
from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.lease import LeaseTable
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.policy import AdmissionFilter
from kvtier.daemon.store.reads import BlockReader
from kvtier.daemon.store.stats import EventLog, StoreCounters
from kvtier.daemon.store.types import BlockKey, Tier
from kvtier.daemon.store.writes import BlockWriter

if TYPE_CHECKING:
    from kvtier.daemon.store.gpu import GpuTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoreParts:
    """The open pieces of a started store."""

    pool: ThreadPoolExecutor  # runs disk I/O and large copies
    host: HostTier
    gpu: GpuTier | None  # None: no GPU tier configured
    disk: DiskTier | None  # None: no disk tier configured
    mover: Mover
    writer: BlockWriter
    reader: BlockReader


@dataclass(frozen=True, slots=True)
class Shared:
    """The store's bookkeeping that outlives its parts (the index is replaced at close)."""

    index: BlockIndex
    counters: StoreCounters
    events: EventLog
    admission: AdmissionFilter[BlockKey]
    leases: LeaseTable[BlockMeta]
    now: Callable[[], float]
    recovery: list[HostRecovery | None] = field(default_factory=list)  # what open_parts adopted, once


async def open_parts(cfg: StoreConfig, shared: Shared) -> StoreParts:
    """Open the tiers (GPU only when ``gpu_bytes > 0``) and rebuild the index from the disk tier.

    Raises:
        StorageError: a tier cannot be opened (nothing stays open then).
        StoreConfigError / CapacityError: the GPU tier cannot be made as configured.
    """
    index = shared.index
    pool = ThreadPoolExecutor(cfg.io_threads, thread_name_prefix="kvtier-io")
    host: HostTier | None = None
    gpu: GpuTier | None = None
    disk: DiskTier | None = None
    try:
        # The disk tier first: it takes the directory's owner lock, which tells whether the
        # previous owner is gone (its shared-memory segments go before ours are made).
        if cfg.disk_path is not None:
            path = cfg.disk_path
            write_buffer, trim, buffers = ram_budget(cfg.host_bytes)
            disk = await asyncio.get_running_loop().run_in_executor(
                pool, lambda: DiskTier(path, cfg.disk_bytes, sync_writes=cfg.disk_sync_writes,
                                       write_buffer_bytes=write_buffer, malloc_trim_bytes=trim,
                                       buffer_pool_bytes=buffers))
            if disk.repair is not None:
                shared.counters.disk_meta_rebuilds += 1
        gone = frozenset([disk.previous_owner]) if disk is not None and disk.previous_owner else frozenset()
        # The host tier keeps its segment directory beside the disk tier's owner lock, so a daemon
        # restarted after a crash adopts the segments the dead one left (host_recovery).
        host = HostTier(cfg.host_bytes, segment_bytes=cfg.segment_bytes, name_prefix=cfg.host_name_prefix,
                        prefault=cfg.host_prefault, pin=cfg.host_pin, gone_pids=gone,
                        state_dir=disk.path if disk is not None else None)
        # The allocators round capacities down to whole pages / alignments: account against what exists.
        index.capacity[Tier.HOST] = min(cfg.host_bytes, host.capacity)
        if cfg.gpu_bytes:
            from kvtier.daemon.store.gpu_setup import open_gpu_tier  # imports torch

            gpu = open_gpu_tier(cfg)
            index.capacity[Tier.GPU] = min(cfg.gpu_bytes, gpu.capacity)
        mover = Mover(cfg, index, host, disk, gpu, shared.counters, shared.events, shared.admission, pool)
        parts = StoreParts(pool, host, gpu, disk, mover,
                           BlockWriter(cfg, index, mover, shared.leases, shared.admission, shared.counters, shared.now),
                           BlockReader(index, mover, shared.leases, shared.counters, shared.now))
        if disk is not None:
            await rebuild_index(mover, shared.now())
        shared.recovery.append(await adopt_host_blocks(mover, shared.now()))
        return parts
    except BaseException:
        if disk is not None:
            with contextlib.suppress(KVTierError):
                disk.close()
        _release(pool, host, gpu)
        raise


async def close_parts(parts: StoreParts, *, persist: bool) -> None:
    """Close the tiers; with ``persist``, write memory blocks to disk first (see ``TieredStore.close``)."""
    try:
        if parts.disk is not None:
            if persist:
                await persist_at_close(parts.mover)
            try:
                await asyncio.get_running_loop().run_in_executor(parts.pool, parts.disk.close)
            except KVTierError as e:
                # Logged, not raised (as a failed flush): what was acknowledged is in the log
                # already, and the tier released its handles and lock all the same.
                log.warning("kvtier store: closing the disk tier failed: %s", e)
    finally:
        _release(parts.pool, parts.host, parts.gpu)


def _release(pool: ThreadPoolExecutor, host: HostTier | None, gpu: GpuTier | None) -> None:
    try:
        if host is not None:
            host.close()
        if gpu is not None:
            gpu.close()
    finally:
        pool.shutdown(wait=True)
