"""Small shared types of the store. Torch-free, I/O-free."""

from __future__ import annotations

import enum
from typing import NamedTuple, NewType

from kvtier_protocol.namespace import NS_ID_LEN  # bytes in a namespace id (SPEC.md §2.4)

BlockKey = NewType("BlockKey", bytes)
"""``ns_id (16 bytes) || chain_hash`` — one block, globally. The same bytes are the RocksDB key."""


GRANT_NS = b"kvtier:granted\0\0"
"""The namespace of granted slots' placeholder keys (``TieredStore.grant``): a granted slot is a
pending block under ``GRANT_NS || n`` until ``place`` renames it. Refused in callers' keys."""
assert len(GRANT_NS) == NS_ID_LEN


def make_key(ns_id: bytes, chain_hash: bytes) -> BlockKey:
    """Pack a namespace id and a chain hash into one key."""
    return BlockKey(ns_id + chain_hash)


def split_key(key: BlockKey) -> tuple[bytes, bytes]:
    """Inverse of :func:`make_key`."""
    return key[:NS_ID_LEN], key[NS_ID_LEN:]


class Tier(enum.IntEnum):
    """Where a block lives, fastest first. The value orders tiers: lower is faster."""

    GPU = 0
    HOST = 1
    DISK = 2
    REMOTE = 3

    @property
    def medium(self) -> str:
        """The medium name used in KV events (vLLM's GPU / CPU / STORAGE)."""
        return _MEDIUM[self]

    @property
    def wire_name(self) -> str:
        """The tier's name on the wire (lookup's ``tiers``): ``"gpu"``, ``"host"``, ...

        A table lookup: ``name.lower()`` costs an Enum attribute access plus a new string per key.
        """
        return TIER_WIRE_NAMES[self]


_MEDIUM = {Tier.GPU: "GPU", Tier.HOST: "CPU", Tier.DISK: "STORAGE", Tier.REMOTE: "REMOTE"}
TIER_WIRE_NAMES: dict[Tier, str] = {t: t.name.lower() for t in Tier}
"""Each tier's wire name (SPEC.md §7 lookup ``tiers``), precomputed."""


class Slot(NamedTuple):
    """A byte range in one memory segment of a tier: what a client maps and copies into or out of.

    A named tuple (immutable and hashable) rather than a frozen dataclass, whose ``__init__`` sets
    each field through ``object.__setattr__``: one is made per block reserved (the allocator
    builds it with ``tuple.__new__``, 0.3 µs here against 1.4).
    """

    segment: int  # index of the segment in the tier's segment list
    offset: int  # byte offset inside the segment
    length: int  # bytes usable by the block (the allocator may reserve more; see Allocation)
