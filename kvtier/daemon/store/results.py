"""Result types the store hands across its boundary (small, frozen, no internal structures)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvtier.daemon.store.index import BlockMeta
from kvtier.daemon.store.types import BlockKey, Slot, Tier


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How many keys, from the first, are stored, and the fastest tier holding each."""

    num_hits: int
    tiers: list[Tier]


EMPTY_LOOKUP = LookupResult(0, [])


class PutStatus(enum.Enum):
    """What ``reserve`` did with one key."""

    RESERVED = "reserved"  # a slot was reserved; write the payload into it, then commit
    STORED = "stored"  # already stored: reported, not rewritten (its recency was refreshed)
    PENDING = "pending"  # another reservation is writing this key right now
    FULL = "full"  # no room even after eviction (every later new key is FULL too)


class PlaceStatus(enum.Enum):
    """What ``place`` did with one key written into a granted slot."""

    PLACED = "placed"  # the block is now visible
    EXISTS = "exists"  # the key was already stored (or being written): the slot was freed
    FAILED = "failed"  # refused by verify_on_commit or write-through (bad payload, failed disk write)


@dataclass(frozen=True, slots=True)
class Reservation:
    """Answer to ``reserve``: one entry per key, in the caller's order.

    Attributes:
        lease_id: the put lease to commit or release; 0 when no slot was reserved.
        slots: the slot to write each RESERVED key's payload into; None otherwise.
        status: what happened to each key.
        expires_at: store clock value when the lease lapses and the slots are reclaimed.
        tier: the memory tier of ``slots``: HOST (write through ``store.host.view(slot)``) or
            GPU (``store.gpu.tensor(slot)`` / ``store.gpu.copy_in``).
    """

    lease_id: int
    slots: list[Slot | None]
    status: list[PutStatus]
    expires_at: float = 0.0
    tier: Tier = Tier.HOST

    @property
    def num_reserved(self) -> int:
        return sum(s is PutStatus.RESERVED for s in self.status)


@dataclass(slots=True)  # not frozen: built per block of every acquire, and a frozen init costs 4x
class AcquiredBlock:
    """One block of an acquired prefix: read ``slot.length`` payload bytes from ``slot``. Read-only
    by convention.

    Attributes:
        chain_hash: the block's chain hash.
        slot: where its payload lies, in the memory tier ``pool`` (valid until the lease is released).
        header: the encoded block header (preamble + map), as committed.
        tier: the tier it was served from: HOST, or GPU when found there (in place, or copied
            down into host for this call), or DISK (promoted into host for this call).
        pool: the memory tier ``slot`` belongs to: HOST (``store.host.view(slot)``) or, only when
            ``acquire(..., tier=Tier.GPU)`` found a GPU copy, GPU (``store.gpu.tensor(slot)``).
        checked: the payload in ``slot`` was verified against the header's checksum after it was
            written (at commit, by the scrubber, or as it was copied in); readers may skip it.
    """

    chain_hash: bytes
    slot: Slot
    header: bytes
    tier: Tier
    pool: Tier = Tier.HOST
    checked: bool = False


@dataclass(frozen=True, slots=True)
class Acquired:
    """Answer to ``acquire``: the consecutive prefix found, leased until ``release``.

    ``lease_id`` is 0 (nothing to release) when ``blocks`` is empty.
    """

    lease_id: int
    blocks: list[AcquiredBlock]
    expires_at: float = 0.0


EMPTY_ACQUIRED = Acquired(0, [])


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """Inspection view of one stored block (REST ``blocks``)."""

    ns_id: bytes
    chain_hash: bytes
    parent_hash: bytes | None
    num_tokens: int
    size: int  # payload bytes
    tiers: list[Tier]
    priority: int
    hits: int
    last_access: float
    leases: int
    header: bytes

    @staticmethod
    def of(meta: BlockMeta) -> BlockInfo:
        return BlockInfo(meta.ns_id, meta.chain_hash, meta.parent_hash, meta.num_tokens, meta.size, meta.shown_tiers,
                         meta.priority, meta.hits, meta.last_access, meta.leases, meta.header)


@dataclass(slots=True)
class CheckReport:
    """Outcome of ``check``: index against storage.

    Attributes:
        missing: keys the index places on disk that the disk does not hold.
        orphans: keys on disk that the index does not know.
        corrupt: (key, tier) whose stored bytes fail their checksum or header.
        accounting: mismatches between the index's byte counters and its blocks.
        adopted: orphans that were valid and were added to the index (``fix=True``).
        fixed: whether repairs were applied.
        notes: what was found and repaired before (the disk tier's metadata rebuilt at start);
            informative, not problems.
    """

    missing: list[BlockKey] = field(default_factory=list)
    orphans: list[BlockKey] = field(default_factory=list)
    corrupt: list[tuple[BlockKey, Tier]] = field(default_factory=list)
    accounting: list[str] = field(default_factory=list)
    adopted: list[BlockKey] = field(default_factory=list)
    fixed: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found wrong."""
        return not (self.missing or self.orphans or self.corrupt or self.accounting)
