"""Persisting memory blocks at a graceful close (``StoreConfig.flush_on_close``).

A clean shutdown is treated as the eviction of every memory block at once: each committed block
that has a host or GPU copy and no disk copy is written down, verified, exactly as a demotion
would write it — the admission filter and the disk's capacity apply, and the disk evicts its own
least valuable blocks to make room. Runs with the store's mutex held, after every lease ended.
"""

from __future__ import annotations

import logging

from kvtier_protocol.errors import KVTierError

from kvtier.daemon.store.index import BlockMeta
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.types import Tier

BATCH_BYTES = 64 << 20
"""Payload bytes copied out of memory per disk write: bounds the memory a flush holds at once."""

log = logging.getLogger(__name__)


async def persist_at_close(mover: Mover) -> None:
    """:func:`flush_to_disk`, then flush RocksDB's memtables and sync its log.

    A failure is logged, not raised: the caller closes the tiers all the same.
    """
    assert mover.disk is not None, "only a store with a disk tier persists at close"
    try:
        written = await flush_to_disk(mover)
        await mover.run(mover.disk.flush)
    except KVTierError as e:
        log.warning("kvtier store: persisting memory blocks at close failed: %s", e)
        return
    log.debug("kvtier store: wrote %d memory blocks to disk at close", written)


async def flush_to_disk(mover: Mover) -> int:
    """Write every committed memory block without a disk copy to disk; returns how many were written.

    Blocks go in eviction order (lowest priority class first, least recently used first), so
    that when the disk is short of room, later and more valuable blocks displace earlier ones,
    not the other way round. A copy that fails its checksum is not written (counted).
    """
    if mover.disk is None:
        return 0
    todo = sorted((m for m in mover.index.blocks() if _unsaved(m)), key=lambda m: (m.priority, m.last_access))
    todo = [m for m in todo if mover.wants_disk(m)]
    written = 0
    batch: list[BlockMeta] = []
    nbytes = disk_bytes = 0
    for meta in todo:
        charge = meta.charge(Tier.DISK)
        # A batch cannot evict its own blocks for room: when the disk is short, write what is
        # batched first, so that this block can displace it (it is worth more, coming later).
        if batch and (nbytes + meta.size > BATCH_BYTES or not await mover.make_room_disk(disk_bytes + charge)):
            written += await _write(mover, batch)
            batch, nbytes, disk_bytes = [], 0, 0
        batch.append(meta)
        nbytes += meta.size
        disk_bytes += charge
    if batch:
        written += await _write(mover, batch)
    return written


def _unsaved(meta: BlockMeta) -> bool:
    return meta.committed and not meta.on_disk and (meta.host_slot is not None or meta.gpu_slot is not None)


async def _write(mover: Mover, metas: list[BlockMeta]) -> int:
    payloads = await mover.snapshot(metas)
    good = []
    for meta, payload in zip(metas, payloads):
        if payload is None:
            mover.corrupt(meta, "memory copy (flush to disk)")  # a bad memory copy is never written down
        else:
            good.append((meta, payload))
    written = await mover.write_disk(good)
    for meta in written:
        mover.counters.tiers[Tier.HOST if meta.host_slot is not None else Tier.GPU].bytes_out += meta.size
    return len(written)
