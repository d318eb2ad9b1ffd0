"""Rebuilding the index from the disk tier at start, and auditing the index against storage.

Both run with the store's mutex held (or before the store serves anything), on the I/O pool.
"""

from __future__ import annotations

from kvtier_protocol.errors import KVTierError, StorageError
from kvtier_protocol.header import (BlockHeader, decode_header, payload_checksum, split_record,
                                    verify_payload)

from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.index import BlockMeta
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.results import CheckReport
from kvtier.daemon.store.stats import EventKind
from kvtier.daemon.store.transfers import gpu_snapshot_verified
from kvtier.daemon.store.types import BlockKey, Tier, make_key


def parse_stored_header(key: BlockKey, header: bytes) -> BlockHeader | None:
    """The header of a stored record if it decodes, is the whole buffer and names ``key``."""
    try:
        h, end = decode_header(header)
    except KVTierError:
        return None
    if end != len(header) or make_key(h.ns_id, h.chain_hash) != key:
        return None
    return h


def _adopt(mover: Mover, key: BlockKey, header: bytes, h: BlockHeader, now: float) -> bool:
    """Index a valid disk record as a committed disk block; False if it does not fit."""
    index = mover.index
    meta = index.get(key)
    if meta is not None:
        if not meta.committed or meta.header != header or meta.on_disk:
            return False  # another block holds the key: the record is not this block's copy
    else:
        meta = BlockMeta(key, h.payload_len)
        index.add(meta)
        index.commit(meta, header, h.parent_hash, h.num_tokens, h.checksum, now)
    if not index.has_room(Tier.DISK, meta.charge(Tier.DISK)):
        if not meta.tiers:
            index.unlink(meta)
        return False
    index.place(meta, Tier.DISK)
    return True


async def rebuild_index(mover: Mover, now: float) -> None:
    """Index every record of the disk tier from its stored header (no payload is read).

    Records whose header does not decode or names another key are deleted and counted as
    checksum failures; records beyond the configured capacity (it shrank) are deleted. No events
    are emitted: a daemon that announces its contents at start lists them with ``iter_blocks``.
    """
    disk = mover.disk
    assert disk is not None, "rebuild needs a disk tier"
    entries = await mover.run(_list_meta, disk)
    drop: list[BlockKey] = []
    for key, header in entries:
        h = parse_stored_header(key, header)
        if h is None:
            mover.counters.checksum_failures += 1
            drop.append(key)
        elif not _adopt(mover, key, header, h, now):
            drop.append(key)
    if drop:
        await mover.run(disk.delete_many, drop)


async def audit(mover: Mover, *, fix: bool, now: float) -> CheckReport:
    """Compare the index with what the GPU, host and disk tiers hold; optionally repair.

    Reads every stored byte: meant for an operator's ``check`` command, not the hot path.
    """
    index, report = mover.index, CheckReport(fixed=fix)
    in_host = [m for m in index.blocks() if m.committed and m.host_slot is not None]
    host_ok = await mover.run(_verify_views, [mover.host.view(m.host_slot) for m in in_host],
                              [m.checksum for m in in_host])
    bad = [(m, Tier.HOST) for m, ok in zip(in_host, host_ok) if not ok]
    if mover.gpu is not None:
        in_gpu = [m for m in index.blocks() if m.committed and m.gpu_slot is not None]
        copies = await mover.run(gpu_snapshot_verified, mover.gpu, [m.gpu_slot for m in in_gpu],
                                 [m.checksum for m in in_gpu])
        bad.extend((m, Tier.GPU) for m, data in zip(in_gpu, copies) if data is None)
    report.corrupt.extend((m.key, tier) for m, tier in bad)
    if mover.disk is not None:
        if mover.disk.repair is not None:
            report.notes.append(f"at start, disk tier {mover.disk.path}: {mover.disk.repair.describe()}")
        await _audit_disk(mover, report, fix, now)
    if fix:
        for meta, tier in bad:
            if meta.leases == 0 and meta.in_tier(tier):
                mover.free_copy(meta, tier)
    report.accounting = index.accounting_errors(mover.zombies)
    return report


async def _audit_disk(mover: Mover, report: CheckReport, fix: bool, now: float) -> None:
    index, disk = mover.index, mover.disk
    assert disk is not None
    stored = dict(await mover.run(_list_meta, disk))
    on_disk = [m for m in index.blocks() if m.on_disk]
    report.missing = [m.key for m in on_disk if m.key not in stored]
    known = {m.key for m in on_disk}
    report.orphans = [k for k in stored if k not in known]
    present = [m for m in on_disk if m.key in stored]
    status = await mover.run(_verify_records, disk, [m.key for m in present], [m.header for m in present])
    bad_disk = [m for m, s in zip(present, status) if s != "ok"]
    report.corrupt.extend((m.key, Tier.DISK) for m in bad_disk)
    orphan_status = await mover.run(_verify_records, disk, report.orphans, [stored[k] for k in report.orphans])
    # Block files the metadata does not list (and that are not free): valid records whose entries
    # were lost. Orphans too: ``fix`` lists them again and adopts them.
    every_unlisted = await mover.run(disk.unlisted)
    unlisted = [f for f in every_unlisted if f.key not in stored]  # the others: old copies of listed keys
    report.orphans.extend(dict.fromkeys(BlockKey(f.key) for f in unlisted))
    if not fix:
        return
    missing = set(report.missing)
    for meta in on_disk:
        if meta.key in missing:
            index.unplace(meta, Tier.DISK)
            mover.emit(EventKind.REMOVED, Tier.DISK, meta)
            if not meta.tiers:
                index.unlink(meta)
    await mover.delete_disk(bad_disk, force=True)
    junk = []
    for key, s in zip(report.orphans, orphan_status):
        h = parse_stored_header(key, stored[key]) if s == "ok" else None
        if h is not None and _adopt(mover, key, stored[key], h, now):
            report.adopted.append(key)
            mover.emit(EventKind.STORED, Tier.DISK, index.get(key))
        else:
            junk.append(key)
    if junk:
        await mover.run(disk.delete_many, junk)
    if not every_unlisted:
        return
    relisted = {BlockKey(k) for k in await mover.run(disk.adopt, every_unlisted)}  # old copies become free
    back = [f for f in unlisted if f.key in relisted]
    status = await mover.run(_verify_records, disk, [BlockKey(f.key) for f in back], [f.header for f in back])
    drop = []
    for f, s in zip(back, status):
        key = BlockKey(f.key)
        h = parse_stored_header(key, f.header) if s == "ok" else None
        if h is not None and _adopt(mover, key, f.header, h, now):
            report.adopted.append(key)
            mover.emit(EventKind.STORED, Tier.DISK, index.get(key))
        else:
            drop.append(key)
    if drop:
        await mover.run(disk.delete_many, drop)


def _list_meta(disk: DiskTier) -> list[tuple[BlockKey, bytes]]:
    return [(BlockKey(bytes(k)), bytes(h)) for k, h in disk.iter_meta()]


def _verify_views(views: list[memoryview], checksums: list[int]) -> list[bool]:
    return [payload_checksum(v) == c for v, c in zip(views, checksums)]


def _verify_records(disk: DiskTier, keys: list[BlockKey], headers: list[bytes]) -> list[str]:
    """Per key: ``"ok"``, ``"missing"`` or ``"corrupt"`` (one record in memory at a time)."""
    out = []
    for key, header in zip(keys, headers):
        try:
            record = disk.get(key)
        except StorageError:
            out.append("corrupt")  # unreadable (a damaged file): reported, and removed by fix
            continue
        if record is None:
            out.append("missing")
            continue
        try:
            h, payload = split_record(record)
            verify_payload(h, payload)
            good = memoryview(record)[:len(header)] == header and make_key(h.ns_id, h.chain_hash) == key
        except KVTierError:
            good = False
        out.append("ok" if good else "corrupt")
    return out
