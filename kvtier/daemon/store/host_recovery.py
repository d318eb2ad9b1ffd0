"""Indexing the host blocks a crashed daemon left: verify each journaled slot, claim it, index it.

Runs once at start, after the disk tier's index is rebuilt and before the store serves anything
(:func:`kvtier.daemon.store.parts.open_parts`), when the host tier adopted a dead daemon's segments
(:mod:`kvtier.daemon.store.host`, :mod:`kvtier.daemon.store.host_journal`). Every entry is checked
against the bytes in its slot before it is served: the header must decode (its own xxh3 checks
it), name a payload of exactly the slot's length, and the payload must match the header's
checksum. A torn or unverifiable one (the daemon died while a client wrote, or the bytes were
damaged) is dropped and counted in ``checksum_failures``; its slot goes back to the allocator.
Leases and grants of the dead daemon are void: their slots were never journaled, so they are free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.header import decode_header, payload_checksum

from kvtier.daemon.store.audit import parse_stored_header
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.index import BlockMeta
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.types import Slot, Tier, make_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostRecovery:
    """What an adoption of the host tier found (``TieredStore.host_recovery``)."""

    from_pid: int  # the crashed daemon whose segments were adopted
    journaled: int  # live slots its journal listed
    adopted: int  # blocks verified and indexed (served again)
    dropped: int  # entries whose slot did not verify (torn or damaged), or could not be indexed
    torn_entries: int  # 1 when the journal ended inside an entry (the daemon died while writing it)


def _verify(host: HostTier, entries: list[tuple[Slot, int, bytes]]) -> list[bool]:
    """Per entry: the header decodes, names the slot's length, and the payload matches it."""
    out = []
    for slot, _, header in entries:
        names = header_key(header)
        h = parse_stored_header(make_key(*names), header) if names is not None else None
        ok = False
        if h is not None and h.payload_len == slot.length:
            try:
                ok = payload_checksum(host.view(slot)) == h.checksum
            except Exception:  # noqa: BLE001 - a slot outside the segments: not adoptable
                ok = False
        out.append(ok)
    return out


def header_key(header: bytes) -> tuple[bytes, bytes] | None:
    """``(ns_id, chain_hash)`` a header names, or None when it does not decode."""
    try:
        h, _ = decode_header(header)
    except KVTierError:
        return None
    return h.ns_id, h.chain_hash


async def adopt_host_blocks(mover: Mover, now: float) -> HostRecovery | None:
    """Verify, claim and index the adopted host tier's journaled blocks (see the module docstring).

    Returns:
        What was found; None when the host tier adopted nothing.
    """
    host, index = mover.host, mover.index
    if host.adopted_from is None:
        return None
    entries = list(host.recovered.values())
    host.recovered = {}
    good = await mover.run(_verify, host, entries) if entries else []
    verified = [e for e, ok in zip(entries, good) if ok]
    claimed = host.adopt_slots([slot for slot, _, _ in verified])
    adopted = 0
    for (slot, priority, header), taken in zip(verified, claimed):
        if not taken:
            continue
        if _index(mover, slot, min(priority, index.num_classes - 1), header, now):
            adopted += 1
        else:
            host.free(slot)  # journals it gone, too
    for (slot, _, _), ok in zip(entries, good):
        if not ok:
            host.journal_forget(slot)
    for (slot, _, _), taken in zip(verified, claimed):
        if not taken:
            host.journal_forget(slot)
    host.journal_flush()
    dropped = len(entries) - adopted
    mover.counters.checksum_failures += dropped
    report = HostRecovery(host.adopted_from, len(entries), adopted, dropped, host.journal_torn)
    log.warning("host tier recovered after a crash of pid %d: %d of %d journaled blocks verified and "
                "served again, %d dropped (torn or unverifiable)%s", report.from_pid, adopted, len(entries),
                dropped, ", a torn journal entry dropped" if report.torn_entries else "")
    return report


def _index(mover: Mover, slot: Slot, priority: int, header: bytes, now: float) -> bool:
    """Index a verified host copy; False when the index cannot take it (its slot is then freed)."""
    index = mover.index
    names = header_key(header)
    assert names is not None, "verified headers decode"
    h = parse_stored_header(make_key(*names), header)
    assert h is not None, "verified headers decode"
    key = make_key(*names)
    meta = index.get(key)
    if meta is not None:
        # Indexed from the disk tier already: the same block gets its host copy back; another
        # encoding of the key keeps the disk one.
        if not meta.committed or meta.header != header or meta.host_slot is not None:
            return False
    elif not index.has_room(Tier.HOST, slot.length):
        return False
    else:
        meta = BlockMeta(key, h.payload_len, priority=priority)
        index.add(meta)
        index.commit(meta, header, h.parent_hash, h.num_tokens, h.checksum, now)
    if not index.has_room(Tier.HOST, meta.charge(Tier.HOST)):
        if not meta.tiers:
            index.unlink(meta)
        return False
    index.place(meta, Tier.HOST, slot)
    index.mark_host_checked(meta)  # verified just now
    return True
