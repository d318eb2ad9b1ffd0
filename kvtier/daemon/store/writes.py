"""The put path of the store: reserve host or GPU slots, then commit what the client wrote into them;
or grant slots without keys ahead of time, then place the blocks the client wrote into them.

Runs with the store's mutex held; the store validates every argument before calling in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from kvtier_protocol.header import BlockHeader

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.lease import Lease, LeaseKind, LeaseTable
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.policy import AdmissionFilter
from kvtier.daemon.store.results import PlaceStatus, PutStatus, Reservation
from kvtier.daemon.store.stats import EventKind, StoreCounters
from kvtier.daemon.store.types import GRANT_NS, BlockKey, Slot, Tier

_GPU, _HOST = Tier.GPU, Tier.HOST  # module constants: Enum member access is a slow path in Python 3.11
_STORED = EventKind.STORED
_RESERVED, _FULL = PutStatus.RESERVED, PutStatus.FULL
_PLACED = PlaceStatus.PLACED


class BlockWriter:
    """Reservations and commits for :class:`~kvtier.daemon.store.store.TieredStore`."""

    def __init__(self, cfg: StoreConfig, index: BlockIndex, mover: Mover, leases: LeaseTable[BlockMeta],
                 admission: AdmissionFilter[BlockKey], counters: StoreCounters, now: Callable[[], float]) -> None:
        self.cfg = cfg
        self.index = index
        self.mover = mover
        self.leases = leases
        self.admission = admission
        self.counters = counters
        self.now = now
        self._placeholders = itertools.count(1)

    async def reserve(self, keys: list[BlockKey], sizes: list[int], ttl: float, priority: int,
                      tier: Tier, kind: LeaseKind = LeaseKind.PUT) -> Reservation:
        """Slots of memory tier ``tier`` for the new keys, in order, until one does not fit
        (see ``TieredStore.reserve``)."""
        now = self.now()
        index, mover = self.index, self.mover
        status: list[PutStatus] = []
        blocks: list[BlockMeta | None] = []
        slots: list[Slot | None] = []
        size = sizes[0] if sizes else 0
        if size and sizes.count(size) == len(sizes) and not index.known(keys):
            # The common reserve, every key new and of one size: nothing to touch, and the slots
            # that fit after make_room are taken in one pass (as the loop below would, one by one).
            await mover.make_room(tier, size * len(keys))
            got = self._take_run(keys, size, tier, priority, blocks, slots)
            status += [_RESERVED] * got
        else:
            new_bytes = 0
            for key, size in zip(keys, sizes):
                meta = index.get(key)
                if meta is None:
                    new_bytes += size
                elif meta.committed:
                    index.touch(meta, now)  # first, so that making room below does not evict it
            await mover.make_room(tier, new_bytes)
        full = False
        recall, add_reserved = self.admission.recall, index.add_reserved
        for key, size in zip(keys[len(blocks):], sizes[len(blocks):]):
            meta = index.get(key)
            if meta is not None:
                status.append(PutStatus.STORED if meta.committed else PutStatus.PENDING)
                blocks.append(None)
                slots.append(None)
                continue
            # After make_room the slots usually fit as they are (take_slot); allocate evicts.
            slot = None if full else mover.take_slot(tier, size)
            if slot is None and not full:
                slot = await mover.allocate(tier, size)
            if slot is None:
                full = True
                status.append(PutStatus.FULL)
                blocks.append(None)
                slots.append(None)
                continue
            blocks.append(add_reserved(key, size, tier, slot, priority, recall(key)))
            status.append(PutStatus.RESERVED)
            slots.append(slot)
        if not any(m is not None for m in blocks):
            return Reservation(0, slots, status, tier=tier)
        lease = self.leases.open(kind, keys, blocks, now + ttl)
        return Reservation(lease.lease_id, slots, status, lease.expires_at, tier)

    async def grant(self, sizes: list[int], ttl: float, priority: int, tier: Tier) -> Reservation:
        """Slots of memory tier ``tier`` without keys yet (see ``TieredStore.grant``).

        Each granted slot is a reserved block under a fresh placeholder key ``GRANT_NS || n``:
        eviction, capacity, expiry, release and the audit then treat it exactly as any
        reservation, and :meth:`place` only renames it.
        """
        width = self.cfg.hash_bytes
        counter = self._placeholders
        # BlockKey is a NewType (identity at run time): calling it per key would only cost a call.
        keys: list[BlockKey] = [GRANT_NS + next(counter).to_bytes(width, "big") for _ in sizes]  # type: ignore[misc]
        now = self.now()
        # Placeholder keys are new by construction (a counter no caller's key can name: GRANT_NS is
        # refused in requests), so none is looked up, and none has an admission ghost to recall.
        await self.mover.make_room(tier, sum(sizes))
        index, mover = self.index, self.mover
        add_reserved = index.add_reserved
        pool = mover.memory(tier)
        slots: list[Slot | None] = []
        blocks: list[BlockMeta | None] = []
        size = sizes[0] if sizes else 0
        if size and sizes.count(size) == len(sizes):  # the common grant: slots of one size
            self._take_run(keys, size, tier, priority, blocks, slots, placeholders=True)
        for size in sizes[len(blocks):]:
            # After make_room the slots usually fit as they are; allocate evicts when they do not.
            slot = pool.allocate(size) if index.has_room(tier, size) else None
            if slot is None:
                slot = await mover.allocate(tier, size)
                if slot is None:
                    break  # FULL from here on: the rest of the grant gets no slot
            blocks.append(add_reserved(keys[len(blocks)], size, tier, slot, priority, 0))
            slots.append(slot)
        n = len(blocks)
        status = [_RESERVED] * n + [_FULL] * (len(sizes) - n)
        if not n:
            return Reservation(0, [None] * len(sizes), status, tier=tier)
        slots += [None] * (len(sizes) - n)
        blocks += [None] * (len(sizes) - n)
        lease = self.leases.open(LeaseKind.GRANT, keys, blocks, now + ttl)
        return Reservation(lease.lease_id, slots, status, lease.expires_at, tier)

    def _take_run(self, keys: list[BlockKey], size: int, tier: Tier, priority: int, blocks: list[BlockMeta | None],
                  slots: list[Slot | None], *, placeholders: bool = False) -> int:
        """Reserve slots of ``size`` for the new ``keys`` from the first, as many as fit in
        ``tier`` now (no eviction: the caller made room), appending the pending blocks and their
        slots to ``blocks`` and ``slots``; returns how many. One pass over the slab
        (``allocate_run``) and one over the index (``add_reserved_many``) for what the
        reserve and grant loops do block by block: ``take_slot``, then ``add_reserved``."""
        index = self.index
        got = self.mover.memory(tier).allocate_run(size, min(len(keys), index.free_bytes(tier) // size))
        # Placeholder keys have no admission ghost; others may (recall forgets it as it answers).
        recall, admission = self.admission.recall, self.admission
        priors = None if placeholders or not len(admission) else [recall(k) for k in keys[:len(got)]]
        blocks += index.add_reserved_many(keys, size, tier, got, priority, priors)
        slots += got
        return len(got)

    async def place(self, lease_id: int, metas: Sequence[BlockMeta], keys: Sequence[BlockKey],
                    headers: Sequence[bytes], parsed: Sequence[BlockHeader], *,
                    checked: bool = False) -> list[PlaceStatus]:
        """Make the blocks written into granted slots visible (see ``TieredStore.place``):
        rename each slot's placeholder ``metas[i]`` (already taken out of its grant, so that
        expiry cannot reclaim it meanwhile) to ``keys[i]`` and commit them as one reservation."""
        index = self.index
        known = index.known(keys)  # stored, or another client is writing it: not twice
        if not known and not self._verifies:
            # The common place: every key new, nothing to copy or await. Renamed and committed
            # in one pass over the batch (index.place_many), then announced.
            index.place_many(metas, keys, self.admission.recall, headers, parsed, self.now(), checked)
            self._announce_many(metas)
            self.mover.host.journal_flush()  # before the place is acknowledged
            return [_PLACED] * len(metas)
        blocks: list[BlockMeta | None] = []
        for meta, key in zip(metas, keys):
            if key in known:
                index.unlease(meta)
                self.abandon(meta)
                blocks.append(None)
            else:
                index.rename(meta, key, self.admission.recall(key))
                blocks.append(meta)
        put = Lease(lease_id, LeaseKind.PUT, list(keys), blocks, self.now(), [b for b in blocks if b is not None])
        ok = await self.commit(put, headers, [h if b is not None else None for h, b in zip(parsed, blocks)],
                               checked=checked)
        return [PlaceStatus.EXISTS if b is None else PlaceStatus.PLACED if good else PlaceStatus.FAILED
                for b, good in zip(blocks, ok)]

    @property
    def _verifies(self) -> bool:
        """Whether a commit copies its payloads out first (verify_on_commit, write-through)."""
        return self.cfg.verify_on_commit or self.cfg.write_through

    async def commit(self, lease: Lease[BlockMeta], headers: Sequence[bytes | None],
                     parsed: Sequence[BlockHeader | None], *, checked: bool = False) -> list[bool]:
        """Commit the blocks of a put lease the caller already took out of the lease table
        (``checked``: the caller verified every payload in its slot, see ``TieredStore.commit``).

        With ``verify_on_commit`` or write-through, each payload is copied out of its slot (host
        or GPU) and verified first; write-through then writes the verified copies to disk and
        only blocks that reached the disk are acknowledged.
        """
        cfg = self.cfg
        verify = cfg.verify_on_commit or cfg.write_through
        if not verify:
            return self._commit_trusted(lease, headers, parsed, checked)
        todo = [(i, meta, buf, h) for i, (meta, buf, h) in enumerate(zip(lease.blocks, headers, parsed))
                if meta is not None and buf is not None and h is not None]
        payloads: list[bytes | None] = [None] * len(todo)
        if todo:
            payloads = await self.mover.snapshot([m for _, m, _, _ in todo], [h.checksum for _, _, _, h in todo])
        now = self.now()
        committed: list[tuple[BlockMeta, bytes]] = []
        for (_, meta, buf, h), payload in zip(todo, payloads):
            if payload is None:
                self.mover.corrupt(meta, "committed copy (verified on commit)")
                continue
            self.index.commit(meta, bytes(buf), h.parent_hash, h.num_tokens, h.checksum, now)
            if meta.host_slot is not None:
                self.index.mark_host_checked(meta)
            committed.append((meta, payload))
        if cfg.write_through and committed:
            await self.mover.write_disk(committed, announce=False)
        ok = [False] * len(lease.keys)
        for i, meta, _, _ in todo:
            ok[i] = meta.committed and (meta.on_disk or not cfg.write_through)
        for i, meta in enumerate(lease.blocks):
            if meta is not None:
                self.index.unlease(meta)
                if ok[i]:
                    self._announce(meta)
                else:
                    self.abandon(meta)
        self.mover.host.journal_flush()  # before the commit is acknowledged
        return ok

    def _commit_trusted(self, lease: Lease[BlockMeta], headers: Sequence[bytes | None],
                        parsed: Sequence[BlockHeader | None], checked: bool) -> list[bool]:
        """The commit of :meth:`commit` without ``verify_on_commit`` or write-through: nothing to
        copy or await, each block committed, unleased and announced in one pass."""
        ok = [False] * len(lease.keys)
        done: list[BlockMeta] = []
        bufs: list[bytes] = []
        summaries: list[BlockHeader] = []
        for i, (meta, buf, h) in enumerate(zip(lease.blocks, headers, parsed)):
            if meta is None:
                continue
            if buf is None or h is None:  # abandoned by the client
                self.index.unlease(meta)
                self.abandon(meta)
                continue
            ok[i] = True
            done.append(meta)
            bufs.append(buf)
            summaries.append(h)
        self.index.commit_reserved_many(done, bufs, summaries, self.now(), checked)
        self._announce_many(done)
        self.mover.host.journal_flush()  # before the commit is acknowledged
        return ok

    def _announce_many(self, metas: Sequence[BlockMeta]) -> None:
        """:meth:`_announce` of blocks committed by one trusted commit or place (never on disk
        yet): the counters once for the batch, then each block's STORED event in order."""
        if not metas:
            return
        c = self.counters
        c.commits += len(metas)
        tiers = c.tiers
        mover = self.mover
        remote = mover.remote
        host_bytes = 0
        for meta in metas:
            if meta.gpu_slot is not None:
                break
            host_bytes += meta.size
        else:
            # The common batch, reserved in host: its events built and queued in one pass
            # (emit_many), in the order the loop below would emit them. (Never on disk yet:
            # commit_reserved_many and place_many assert it.)
            tiers[_HOST].bytes_in += host_bytes
            mover.emit_many(_STORED, _HOST, metas)
            if remote is not None:
                for meta in metas:
                    remote.offer(meta)
            return
        host_bytes = gpu_bytes = 0
        emit = mover.emit
        for meta in metas:
            assert not meta.on_disk, "a trusted commit writes nothing to disk"
            if meta.gpu_slot is not None:  # where it was reserved
                gpu_bytes += meta.size
                emit(_STORED, _GPU, meta)
            else:
                host_bytes += meta.size
                emit(_STORED, _HOST, meta)
                if remote is not None:  # a GPU block is offered when it reaches host
                    remote.offer(meta)
        if host_bytes:
            tiers[_HOST].bytes_in += host_bytes
        if gpu_bytes:
            tiers[_GPU].bytes_in += gpu_bytes

    def _announce(self, meta: BlockMeta) -> None:
        c = self.counters
        c.commits += 1
        tier = _GPU if meta.gpu_slot is not None else _HOST  # where it was reserved
        c.tiers[tier].bytes_in += meta.size
        self.mover.emit(_STORED, tier, meta)
        remote = self.mover.remote
        if remote is not None and tier is _HOST:  # a GPU block is offered when it reaches host
            remote.offer(meta)
        if meta.on_disk:
            c.write_throughs += 1
            self.mover.emit(_STORED, Tier.DISK, meta)

    def abandon(self, meta: BlockMeta) -> None:
        """Drop a block that did not make it: abandoned, bad payload, failed write-through, expired."""
        assert not meta.on_disk and not meta.leases, "only unacknowledged, unleased memory copies are abandoned"
        self.mover.free_memory(meta, announce=False)  # in no tier afterwards, so unlinked too
