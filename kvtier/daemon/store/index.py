"""The block index: per-block metadata, prefix lookup, LRU membership and byte accounting.

Torch-free, I/O-free, asyncio-free; every method is O(1) per block except :meth:`lookup`
(O(keys)) and the namespace scans (O(blocks in the namespace)).

A block is in one of two states. ``PENDING``: a reservation holds a host slot that a client is
writing; it counts against capacity but is invisible to lookup and never evicted. ``COMMITTED``:
visible, with a copy in one or more tiers. A block removed from the index while a reader still
holds a lease on it is *unlinked*: its key is free for a new block at once, its slot stays charged
until the last lease is released (a reader is still copying out of it).

Charges: a memory tier (GPU, host) is charged the payload size; the disk tier the whole record
(header + payload), which is what it stores.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.daemon.store.policy import PriorityLru
from kvtier.daemon.store.types import NS_ID_LEN, TIER_WIRE_NAMES, BlockKey, Slot, Tier, split_key

if TYPE_CHECKING:
    from kvtier_protocol.header import BlockHeader

TIERS = (Tier.GPU, Tier.HOST, Tier.DISK)
"""Tiers the index accounts for, fastest first (REMOTE is not local bookkeeping)."""
_GPU, _HOST, _DISK = TIERS
_GPU_NAME, _HOST_NAME, _DISK_NAME = (TIER_WIRE_NAMES[t] for t in TIERS)
_GPU_BIT, _HOST_BIT, _DISK_BIT = 1, 2, 4
_QUEUE_BITS = {_GPU: _GPU_BIT, _HOST: _HOST_BIT, _DISK: _DISK_BIT}
_MEMORY_BITS = _GPU_BIT | _HOST_BIT


class BlockState(enum.Enum):
    PENDING = "pending"
    COMMITTED = "committed"


@dataclass(slots=True, eq=False)
class BlockMeta:
    """Everything the store knows about one block. Mutated only through :class:`BlockIndex`."""

    key: BlockKey  # ns_id || chain_hash
    size: int  # payload bytes (what a memory slot holds)
    state: BlockState = BlockState.PENDING
    header: bytes = b""  # the encoded header (empty while pending)
    parent_hash: bytes | None = None  # header summary, for events and inspection
    num_tokens: int = 0  # header summary
    checksum: int = 0  # the header's payload checksum, verified on every move and disk read
    host_slot: Slot | None = None  # copy in the shared host tier
    host_checked: bool = False  # the host copy matched the checksum after it was written
    gpu_slot: Slot | None = None  # copy in the GPU tier
    on_disk: bool = False  # copy in the disk tier
    priority: int = 0  # eviction class: 0 goes first
    hits: int = 0  # acquires that served this block
    prior_accesses: int = 0  # accesses before it was last dropped (admission filter ghost)
    last_access: float = 0.0  # clock of the last commit / acquire / touch
    leases: int = 0  # open leases on the block; > 0 pins its memory copies
    moving: bool = False  # a transactional move is in flight; not a victim meanwhile
    linked: bool = False  # reachable by key (False: deleted while leased, or never added)
    queued: int = 0  # the LRU queues holding it, as bits (_QUEUE_BITS); BlockIndex._refresh's own
    remote: bool = False  # a copy went to (or came from) the remote tier; it may be evicted there since

    @property
    def ns_id(self) -> bytes:
        return split_key(self.key)[0]

    @property
    def chain_hash(self) -> bytes:
        return split_key(self.key)[1]

    @property
    def committed(self) -> bool:
        return self.state is BlockState.COMMITTED

    @property
    def accesses(self) -> int:
        """The commit that stored it, plus every hit, plus remembered earlier accesses."""
        return 1 + self.hits + self.prior_accesses

    def in_tier(self, tier: Tier) -> bool:
        if tier is _HOST:  # module constants: Enum member access is a slow path in Python 3.11
            return self.host_slot is not None
        if tier is _DISK:
            return self.on_disk
        if tier is _GPU:
            return self.gpu_slot is not None
        return False

    @property
    def tiers(self) -> list[Tier]:
        """Tiers holding a copy, fastest first (unrolled: every copy freed asks it)."""
        out = []
        if self.gpu_slot is not None:
            out.append(_GPU)
        if self.host_slot is not None:
            out.append(_HOST)
        if self.on_disk:
            out.append(_DISK)
        return out

    @property
    def shown_tiers(self) -> list[Tier]:
        """:attr:`tiers`, plus REMOTE when a copy went to (or came from) the remote tier: what
        inspection shows. Not :attr:`tiers`, which decides whether the block is left anywhere
        locally (the remote copy is not this store's to count on)."""
        local = self.tiers
        return local + [Tier.REMOTE] if self.remote else local

    @property
    def fastest_tier(self) -> Tier | None:
        """The fastest tier holding a copy (lookup's answer; kept cheap, it runs per key)."""
        if self.gpu_slot is not None:
            return _GPU  # module constants: Enum member access is a slow path in Python 3.11
        if self.host_slot is not None:
            return _HOST
        return _DISK if self.on_disk else None

    def charge(self, tier: Tier) -> int:
        """Bytes this block occupies in ``tier`` (see module docstring)."""
        return len(self.header) + self.size if tier is _DISK else self.size


class BlockIndex:
    """Key → :class:`BlockMeta`, per-tier LRU with priority classes, per-tier byte accounting.

    Args:
        capacities: byte budget per tier (0 for a tier that is off).
        num_classes: priority classes of the LRU queues.
    """

    def __init__(self, capacities: dict[Tier, int], num_classes: int) -> None:
        self.capacity = {t: capacities.get(t, 0) for t in TIERS}
        self.used = {t: 0 for t in TIERS}
        self.count = {t: 0 for t in TIERS}
        self.num_classes = num_classes
        self.pending = 0
        self._blocks: dict[BlockKey, BlockMeta] = {}
        self._by_ns: dict[bytes, set[BlockKey]] = {}
        # Queues hold the BlockMeta objects themselves (identity-hashed, eq=False): an unlinked block
        # and a newer block with the same key never collide.
        self._lru: dict[Tier, PriorityLru[BlockMeta]] = {t: PriorityLru(num_classes) for t in TIERS}
        self._queues = tuple((_QUEUE_BITS[t], self._lru[t]) for t in TIERS)

    # --- lookup ------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> BlockMeta | None:
        """The linked block with ``key`` (pending or committed), or None."""
        return self._blocks.get(key)

    def visible(self, key: BlockKey) -> BlockMeta | None:
        """The committed block with ``key``, or None."""
        meta = self._blocks.get(key)
        return meta if meta is not None and meta.committed else None

    def visible_many(self, keys: Iterable[BlockKey]) -> list[BlockMeta]:
        """The committed blocks of ``keys``, in order, the others skipped (:meth:`visible` of
        each, in one pass: a delete's keys)."""
        committed = BlockState.COMMITTED
        return [m for m in map(self._blocks.get, keys) if m is not None and m.state is committed]

    def lookup(self, keys: Iterable[BlockKey]) -> list[BlockMeta]:
        """The longest run of committed blocks from the start of ``keys``. O(len(result) + 1)."""
        out: list[BlockMeta] = []
        blocks, committed = self._blocks, BlockState.COMMITTED
        for key in keys:
            meta = blocks.get(key)
            if meta is None or meta.state is not committed:
                break
            out.append(meta)
        return out

    def lookup_names(self, keys: Iterable[BlockKey]) -> list[str]:
        """:meth:`lookup` answering the wire name of each hit's fastest tier, in one pass.

        The lookup hot path: no intermediate list of metas, no Enum values (see
        :attr:`BlockMeta.fastest_tier`, whose choice this repeats). A committed block always has a
        copy somewhere, so a block in neither memory tier is on disk.
        """
        out: list[str] = []
        blocks, committed = self._blocks, BlockState.COMMITTED
        for key in keys:
            meta = blocks.get(key)
            if meta is None or meta.state is not committed:
                break
            out.append(_GPU_NAME if meta.gpu_slot is not None
                       else _HOST_NAME if meta.host_slot is not None else _DISK_NAME)
        return out

    def namespace(self, ns_id: bytes) -> list[BlockMeta]:
        """Every linked block of a namespace (pending ones included)."""
        return [self._blocks[k] for k in self._by_ns.get(ns_id, ())]

    def blocks(self) -> Iterator[BlockMeta]:
        """Every linked block. Do not mutate the index while iterating."""
        return iter(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    # --- membership --------------------------------------------------------------------------

    def add(self, meta: BlockMeta) -> None:
        """Link a new block (pending or committed, in no tier yet)."""
        assert meta.key not in self._blocks, "key already indexed"
        assert (meta.host_slot is None and meta.gpu_slot is None and not meta.on_disk
                and not meta.linked), "add() takes a fresh block"
        assert 0 <= meta.priority < self.num_classes, "priority out of range"
        self._blocks[meta.key] = meta
        self._by_ns.setdefault(meta.ns_id, set()).add(meta.key)
        meta.linked = True
        if not meta.committed:
            self.pending += 1

    def add_reserved(self, key: BlockKey, size: int, tier: Tier, slot: Slot, priority: int,
                     prior_accesses: int) -> BlockMeta:
        """A new pending block of ``key`` with a copy in memory tier ``tier`` at ``slot``, leased
        once: :meth:`add`, :meth:`place` and :meth:`lease` in one step.

        The reserve hot path, run per block of every put: a pending block is in no LRU queue, so
        nothing is refreshed, and the checks are the ones those three would make.
        """
        assert key not in self._blocks, "key already indexed"
        assert 0 <= priority < self.num_classes, "priority out of range"
        assert tier is _HOST or tier is _GPU, "memory tiers take a slot"
        assert self.used[tier] + size <= self.capacity[tier], f"{tier.name} capacity exceeded"
        meta = BlockMeta(key, size, priority=priority, prior_accesses=prior_accesses, leases=1, linked=True)
        if tier is _HOST:
            meta.host_slot = slot
        else:
            meta.gpu_slot = slot
        self._blocks[key] = meta
        ns_id = key[:NS_ID_LEN]
        keys = self._by_ns.get(ns_id)
        if keys is None:
            keys = self._by_ns[ns_id] = set()
        keys.add(key)
        self.pending += 1
        self.used[tier] += size
        self.count[tier] += 1
        return meta

    def add_reserved_many(self, keys: Sequence[BlockKey], size: int, tier: Tier, slots: Sequence[Slot],
                          priority: int, prior_accesses: Sequence[int] | None = None) -> list[BlockMeta]:
        """:meth:`add_reserved` of ``keys[i]`` at ``slots[i]`` (one size; ``prior_accesses[i]``,
        None: none), for as many keys as there are slots: a grant's or a reserve's batch, with the
        charges and the pending count updated once for it."""
        blocks, by_ns = self._blocks, self._by_ns
        n = len(slots)
        assert 0 <= priority < self.num_classes, "priority out of range"
        assert tier is _HOST or tier is _GPU, "memory tiers take a slot"
        assert self.used[tier] + n * size <= self.capacity[tier], f"{tier.name} capacity exceeded"
        out: list[BlockMeta] = []
        append = out.append
        host = tier is _HOST
        ns_id: bytes | None = None
        ns_keys: set[BlockKey] = set()
        for key, slot in zip(keys, slots):
            assert key not in blocks, "key already indexed"
            meta = (BlockMeta(key, size, host_slot=slot, priority=priority, leases=1, linked=True) if host
                    else BlockMeta(key, size, gpu_slot=slot, priority=priority, leases=1, linked=True))
            blocks[key] = meta
            if key[:NS_ID_LEN] != ns_id:  # a grant's keys share one (placeholder) namespace
                ns_id = key[:NS_ID_LEN]
                got = by_ns.get(ns_id)
                if got is None:
                    got = by_ns[ns_id] = set()
                ns_keys = got
            ns_keys.add(key)
            append(meta)
        assert len(out) == n, "one key per slot"
        if prior_accesses is not None:
            for meta, prior in zip(out, prior_accesses):
                meta.prior_accesses = prior
        self.pending += n
        self.used[tier] += n * size
        self.count[tier] += n
        return out

    def rename(self, meta: BlockMeta, key: BlockKey, prior_accesses: int) -> None:
        """Move a pending block to ``key``: a granted slot (under a placeholder key, see
        ``kvtier.daemon.store.types.GRANT_NS``) becomes the block the client wrote into it.
        ``prior_accesses``: what the admission filter recalls of ``key``."""
        assert not meta.committed and meta.linked, "only pending, linked blocks are renamed"
        assert key not in self._blocks, "key already indexed"
        old = self._by_ns[meta.ns_id]
        old.discard(meta.key)
        if not old:
            del self._by_ns[meta.ns_id]
        del self._blocks[meta.key]
        meta.key = key
        meta.prior_accesses = prior_accesses
        self._blocks[key] = meta
        keys = self._by_ns.get(key[:NS_ID_LEN])
        if keys is None:
            keys = self._by_ns[key[:NS_ID_LEN]] = set()
        keys.add(key)

    def known(self, keys: Iterable[BlockKey]) -> set[BlockKey]:
        """Those of ``keys`` that are linked (pending or committed), in one C-level pass."""
        return self._blocks.keys() & keys

    def place_many(self, metas: Sequence[BlockMeta], keys: Sequence[BlockKey], recall: Callable[[BlockKey], int],
                   headers: Sequence[bytes], parsed: Sequence[BlockHeader], now: float, checked: bool) -> None:
        """:meth:`rename` each pending, leased block ``metas[i]`` to ``keys[i]`` (none of them
        linked; ``recall(key)``: its prior accesses), then :meth:`commit_reserved` it with
        ``headers[i]`` and the summary ``parsed[i]``: the place hot path, one pass over a batch
        of granted slots instead of two calls per block.
        """
        blocks, by_ns, committed = self._blocks, self._by_ns, BlockState.COMMITTED
        host_classes = self._lru[_HOST].classes
        for meta, key, buf, h in zip(metas, keys, headers, parsed):
            assert meta.linked and meta.state is not committed and meta.leases > 0, "place takes leased pending blocks"
            assert key not in blocks, "key already indexed"
            assert not meta.on_disk, "the disk charge depends on the header; place on disk after commit"
            old_key = meta.key
            old = by_ns[old_key[:NS_ID_LEN]]
            old.discard(old_key)
            if not old:
                del by_ns[old_key[:NS_ID_LEN]]
            del blocks[old_key]
            meta.key = key
            meta.prior_accesses = recall(key)
            blocks[key] = meta
            ns_keys = by_ns.get(key[:NS_ID_LEN])
            if ns_keys is None:
                ns_keys = by_ns[key[:NS_ID_LEN]] = set()
            ns_keys.add(key)
            self._commit_leased(meta, buf, h, now, checked, host_classes)
        self.pending -= len(metas)

    def _commit_leased(self, meta: BlockMeta, buf: bytes, h: BlockHeader, now: float, checked: bool,
                       host_classes: list[OrderedDict[BlockMeta, None]]) -> None:
        """One block of :meth:`place_many` / :meth:`commit_reserved_many`: commit it with header
        ``buf`` (summary ``h``), mark its host copy checked, drop the batch's lease."""
        meta.header = bytes(buf)
        meta.parent_hash = h.parent_hash
        meta.num_tokens = h.num_tokens
        meta.checksum = h.checksum
        meta.state = BlockState.COMMITTED
        meta.last_access = now
        if checked and meta.host_slot is not None:
            meta.host_checked = True
        meta.leases -= 1
        if not meta.leases and not meta.queued and meta.gpu_slot is None and not meta.moving \
                and meta.host_slot is not None:
            # The common block, a host copy now evictable: into the host queue as most recent
            # (_refresh's answer: it was pending, so in no queue), without it.
            host_classes[meta.priority][meta] = None
            meta.queued = _HOST_BIT
        else:
            self._refresh(meta)

    def commit_reserved(self, meta: BlockMeta, header: bytes, parent_hash: bytes | None, num_tokens: int,
                        checksum: int, now: float, *, checked: bool) -> None:
        """:meth:`commit`, then (``checked``) :meth:`mark_host_checked`, then :meth:`unlease`, in
        one step: the commit hot path, with one LRU refresh instead of two."""
        assert meta.leases > 0, "commit_reserved() takes a leased block"
        self._set_committed(meta, header, parent_hash, num_tokens, checksum, now)
        if checked and meta.host_slot is not None:
            meta.host_checked = True
        meta.leases -= 1
        self.pending -= 1
        self._refresh(meta)

    def commit_reserved_many(self, metas: Sequence[BlockMeta], headers: Sequence[bytes],
                             parsed: Sequence[BlockHeader], now: float, checked: bool) -> None:
        """:meth:`commit_reserved` of each leased pending block ``metas[i]`` with ``headers[i]``
        and its summary ``parsed[i]``: a trusted commit's batch, in one pass."""
        committed = BlockState.COMMITTED
        host_classes = self._lru[_HOST].classes
        for meta, buf, h in zip(metas, headers, parsed):
            assert meta.leases > 0, "commit_reserved() takes a leased block"
            assert meta.linked and meta.state is not committed, "a commit takes a linked pending block"
            assert not meta.on_disk, "the disk charge depends on the header; place on disk after commit"
            self._commit_leased(meta, buf, h, now, checked, host_classes)
        self.pending -= len(metas)

    def unlink(self, meta: BlockMeta) -> None:
        """Make the key unreachable. Charges stay until :meth:`unplace` frees each copy."""
        if not meta.linked:
            return
        del self._blocks[meta.key]
        keys = self._by_ns[meta.ns_id]
        keys.discard(meta.key)
        if not keys:
            del self._by_ns[meta.ns_id]
        meta.linked = False
        if not meta.committed:
            self.pending -= 1
        self._refresh(meta)

    def commit(self, meta: BlockMeta, header: bytes, parent_hash: bytes | None, num_tokens: int,
               checksum: int, now: float) -> None:
        """Turn a pending block visible, with its header and the header's summary."""
        self._set_committed(meta, header, parent_hash, num_tokens, checksum, now)
        self.pending -= 1
        self._refresh(meta)

    @staticmethod
    def _set_committed(meta: BlockMeta, header: bytes, parent_hash: bytes | None, num_tokens: int,
                       checksum: int, now: float) -> None:
        assert meta.linked and not meta.committed, "a commit takes a linked pending block"
        assert not meta.on_disk, "the disk charge depends on the header; place on disk after commit"
        meta.header = header
        meta.parent_hash = parent_hash
        meta.num_tokens = num_tokens
        meta.checksum = checksum
        meta.state = BlockState.COMMITTED
        meta.last_access = now

    @staticmethod
    def reencode(meta: BlockMeta, header: bytes, size: int, checksum: int) -> None:
        """Give a committed block held in no tier another encoding (issue 25: re-encoded on
        its way to disk): its header, payload size and checksum; key, parent and tokens stay."""
        assert meta.committed and meta.linked and not meta.tiers, "re-encode a block between its copies"
        meta.header, meta.size, meta.checksum = header, size, checksum

    # --- placement and accounting ------------------------------------------------------------

    def has_room(self, tier: Tier, nbytes: int) -> bool:
        return self.used[tier] + nbytes <= self.capacity[tier]

    def free_bytes(self, tier: Tier) -> int:
        return self.capacity[tier] - self.used[tier]

    def place(self, meta: BlockMeta, tier: Tier, slot: Slot | None = None) -> None:
        """Record a copy of ``meta`` in ``tier`` and charge its bytes."""
        assert not meta.in_tier(tier), f"block already in {tier.name}"
        assert (slot is None) == (tier is _DISK), "memory tiers take a slot, disk none"
        nbytes = meta.charge(tier)
        assert self.used[tier] + nbytes <= self.capacity[tier], f"{tier.name} capacity exceeded"
        if tier is _HOST:
            meta.host_slot = slot
        elif tier is _GPU:
            meta.gpu_slot = slot
        else:
            meta.on_disk = True
        self.used[tier] += nbytes
        self.count[tier] += 1
        self._refresh(meta)

    def unplace(self, meta: BlockMeta, tier: Tier) -> Slot | None:
        """Forget the copy in ``tier``, release its charge, return its slot for the caller to free."""
        assert meta.in_tier(tier), f"block not in {tier.name}"
        slot: Slot | None = None
        if tier is _HOST:
            slot, meta.host_slot = meta.host_slot, None
            meta.host_checked = False
        elif tier is _GPU:
            slot, meta.gpu_slot = meta.gpu_slot, None
        else:
            meta.on_disk = False
        self.used[tier] -= meta.charge(tier)
        self.count[tier] -= 1
        self._refresh(meta)
        return slot

    def unplace_many(self, metas: Sequence[BlockMeta], tier: Tier) -> list[Slot]:
        """:meth:`unplace` the copy of each of ``metas`` in memory tier ``tier`` (each has one),
        then :meth:`unlink` each block left in no tier; their slots, in order, for the caller to
        free. A delete's or an eviction's batch: the charges updated once for it, one LRU
        refresh per block (not one for the unplace and one for the unlink)."""
        assert tier is _HOST or tier is _GPU, "memory tiers hold slots"
        host = tier is _HOST
        blocks, by_ns, committed, refresh = self._blocks, self._by_ns, BlockState.COMMITTED, self._refresh
        host_classes = self._lru[_HOST].classes
        slots: list[Slot] = []
        append = slots.append
        nbytes = unlinked_pending = 0
        for meta in metas:
            if host:
                slot = meta.host_slot
                meta.host_slot = None
                meta.host_checked = False
            else:
                slot = meta.gpu_slot
                meta.gpu_slot = None
            assert slot is not None, f"block not in {tier.name}"
            append(slot)
            nbytes += meta.size  # charge(tier) of a memory tier
            if meta.linked and meta.host_slot is None and meta.gpu_slot is None and not meta.on_disk:
                key = meta.key  # unlink, inline
                del blocks[key]
                ns_id = key[:NS_ID_LEN]
                keys = by_ns[ns_id]
                keys.discard(key)
                if not keys:
                    del by_ns[ns_id]
                meta.linked = False
                if meta.state is not committed:
                    unlinked_pending += 1
            queued = meta.queued
            if queued == _HOST_BIT and host and not meta.on_disk:
                # The common host copy, queued for host eviction only, now in no queue
                # (_refresh's answer, without it).
                del host_classes[meta.priority][meta]
                meta.queued = 0
            elif queued:  # copies only go: a block in no queue stays in none
                refresh(meta)
        self.used[tier] -= nbytes
        self.count[tier] -= len(slots)
        self.pending -= unlinked_pending
        return slots

    def mark_host_checked(self, meta: BlockMeta) -> None:
        """Record that the host copy of ``meta`` matched its checksum after it was written; it
        stays so until the copy is freed (a committed slot is never written again)."""
        assert meta.host_slot is not None and meta.committed, "only committed host copies are checked"
        meta.host_checked = True

    # --- recency, priority, leases -----------------------------------------------------------

    def touch(self, meta: BlockMeta, now: float) -> None:
        """Mark ``meta`` most recently used in every tier where it is queued."""
        meta.last_access = now
        queued = meta.queued  # _refresh's record of its queues: no probe of the others
        if queued:
            for bit, queue in self._queues:
                if queued & bit:
                    queue.touch(meta, meta.priority)

    def set_priority(self, meta: BlockMeta, priority: int) -> None:
        assert 0 <= priority < self.num_classes, "priority validated by the caller"
        for tier in TIERS:
            self._lru[tier].remove(meta, meta.priority)
        meta.queued = 0
        meta.priority = priority
        self._refresh(meta)

    def lease(self, meta: BlockMeta) -> None:
        """Pin the memory copies of ``meta`` (not victims while leased)."""
        meta.leases += 1
        self._refresh(meta)

    def lease_all(self, metas: Iterable[BlockMeta]) -> None:
        """:meth:`lease` each of ``metas`` (an acquired prefix: one call, not one per block).

        A lease only takes a block out of the memory tiers' queues (:meth:`_refresh`), so a
        block in none of them (leased already) is left as it is, and the common block, queued
        for host eviction only, leaves that queue here without the general refresh.
        """
        refresh, host_classes = self._refresh, self._lru[_HOST].classes
        for meta in metas:
            meta.leases += 1
            queued = meta.queued
            if queued == _HOST_BIT:
                del host_classes[meta.priority][meta]
                meta.queued = 0
            elif queued & _MEMORY_BITS:
                refresh(meta)

    def unlease(self, meta: BlockMeta) -> None:
        assert meta.leases > 0, "unbalanced unlease"
        meta.leases -= 1
        self._refresh(meta)

    def unlease_all(self, metas: Iterable[BlockMeta]) -> None:
        """:meth:`unlease` each of ``metas`` (a released get lease: one call, not one per block).

        A block still leased stays out of the memory queues (nothing to refresh); the common
        block, a committed host-only copy in no queue, goes back into the host queue as most
        recently used here, without the general refresh.
        """
        refresh, host_classes, committed = self._refresh, self._lru[_HOST].classes, BlockState.COMMITTED
        for meta in metas:
            assert meta.leases > 0, "unbalanced unlease"
            meta.leases -= 1
            if meta.leases:
                continue
            if (not meta.queued and meta.host_slot is not None and meta.gpu_slot is None and not meta.on_disk
                    and meta.linked and meta.state is committed and not meta.moving):
                host_classes[meta.priority][meta] = None  # not queued: appended, i.e. most recent
                meta.queued = _HOST_BIT
            else:
                refresh(meta)

    def set_moving(self, meta: BlockMeta, moving: bool) -> None:
        meta.moving = moving
        self._refresh(meta)

    def set_moving_many(self, metas: Iterable[BlockMeta], moving: bool) -> None:
        """:meth:`set_moving` of each of ``metas``, in order (an eviction's victims)."""
        refresh = self._refresh
        for meta in metas:
            meta.moving = moving
            refresh(meta)

    def victims(self, tier: Tier) -> Iterator[BlockMeta]:
        """Evictable blocks of ``tier`` in eviction order. Collect, then act."""
        return self._lru[tier].victims()

    def evictable(self, meta: BlockMeta, tier: Tier) -> bool:
        """Committed, reachable, not in a move, and — for memory tiers — not leased.

        A lease pins only the memory copies: a reader copies out of a host slot, never out of
        the disk record, so the disk copy of a leased block may still be evicted.
        """
        if not (meta.linked and meta.committed and not meta.moving and meta.in_tier(tier)):
            return False
        return tier is Tier.DISK or meta.leases == 0

    def _refresh(self, meta: BlockMeta) -> None:
        """Bring LRU membership of ``meta`` in line with :meth:`evictable` (new entries go MRU).

        :meth:`evictable` for the three tiers, unrolled, against the membership ``meta.queued``
        records: this runs several times per block on every put and get (lease, commit,
        unlease), and most calls change nothing (a pending block stays out of every queue, a
        leased one too), so they cost a few attribute reads instead of three queue probes.
        """
        wanted = 0
        if meta.linked and meta.state is BlockState.COMMITTED and not meta.moving:
            if meta.on_disk:
                wanted = _DISK_BIT
            if meta.leases == 0:
                if meta.host_slot is not None:
                    wanted |= _HOST_BIT
                if meta.gpu_slot is not None:
                    wanted |= _GPU_BIT
        changed = wanted ^ meta.queued
        if not changed:
            return
        priority = meta.priority
        for bit, queue in self._queues:
            if changed & bit:
                if wanted & bit:
                    queue.push(meta, priority)
                else:
                    queue.remove(meta, priority)
        meta.queued = wanted

    # --- audit -------------------------------------------------------------------------------

    def accounting_errors(self, extra: Iterable[BlockMeta] = ()) -> list[str]:
        """Recompute the charges from the blocks; describe any mismatch (empty when sound).

        Args:
            extra: unlinked blocks that still hold a charge (removed while leased), which the
                index cannot reach by key.
        """
        used = {t: 0 for t in TIERS}
        count = {t: 0 for t in TIERS}
        pending = 0
        errors = []
        for meta in [*self._blocks.values(), *extra]:
            pending += meta.linked and not meta.committed
            for tier in meta.tiers:
                used[tier] += meta.charge(tier)
                count[tier] += 1
            queued = sum(bit for bit, queue in self._queues if queue.contains(meta, meta.priority))
            if queued != meta.queued:
                errors.append(f"block {meta.chain_hash.hex()[:16]}: in LRU queues {queued:03b}, "
                              f"its record says {meta.queued:03b}")
        for tier in TIERS:
            if used[tier] != self.used[tier] or count[tier] != self.count[tier]:
                errors.append(f"{tier.name}: index says {self.used[tier]} B / {self.count[tier]} blocks, "
                              f"blocks add up to {used[tier]} B / {count[tier]}")
            if self.used[tier] > self.capacity[tier]:
                errors.append(f"{tier.name}: {self.used[tier]} B used > capacity {self.capacity[tier]} B")
        if pending != self.pending:
            errors.append(f"pending: index says {self.pending}, blocks say {pending}")
        return errors
