"""The get path of the store: acquire a stored prefix, copying blocks into host memory where needed.

Runs with the store's mutex held; the store validates every argument before calling in.

Where each acquired block is read from (:attr:`AcquiredBlock.pool`):

===============  ============================  ========================================
copies held      ``acquire(...)`` (HOST)       ``acquire(..., tier=Tier.GPU)``
===============  ============================  ========================================
host (± others)  host slot                     GPU slot if a GPU copy exists, else host
GPU only         copied down into a host slot  GPU slot, in place
disk only        promoted into a host slot     promoted into a host slot
===============  ============================  ========================================

A copy made for the call (GPU → host, disk → host) is verified before it is served and is kept
afterwards; its source copy is kept too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.exact import exact_run
from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.remote_link import Fetched
from kvtier.daemon.store.lease import LeaseKind, LeaseTable
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.results import EMPTY_ACQUIRED, Acquired, AcquiredBlock
from kvtier.daemon.store.stats import EventKind, StoreCounters
from kvtier.daemon.store.transfers import load_records
from kvtier.daemon.store.types import NS_ID_LEN, BlockKey, Tier


class BlockReader:
    """Acquires and promotions for :class:`~kvtier.daemon.store.store.TieredStore`."""

    def __init__(self, index: BlockIndex, mover: Mover, leases: LeaseTable[BlockMeta], counters: StoreCounters,
                 now: Callable[[], float]) -> None:
        self.index = index
        self.mover = mover
        self.leases = leases
        self.counters = counters
        self.now = now

    async def acquire(self, keys: list[BlockKey], ttl: float, tier: Tier,
                      fetched: Mapping[BlockKey, Fetched] | None = None, *, accept_lossy: bool = True) -> Acquired:
        """Lease the stored prefix of ``keys`` (see ``TieredStore.acquire``); ``fetched``: verified
        remote records that may continue the local prefix (placed into host slots first);
        ``accept_lossy`` False: exact copies only, the prefix ends at a lossy one."""
        in_place = tier is Tier.GPU
        metas = self.index.lookup(keys)
        if not accept_lossy:  # issue 25; a remote record is never adopted past the lossy key (indexed)
            del metas[exact_run(metas):]
        self.index.lease_all(metas)  # pins the memory copies while promotion makes room
        if fetched and len(metas) < len(keys):
            metas += await self.adopt_remote(keys[len(metas):], fetched)
        if not in_place and all(m.host_slot is not None for m in metas):
            return self._serve_host(keys, metas, ttl)
        found_in = [_source(m, in_place) for m in metas]
        n = len(metas)
        if any(not _served(m, in_place) for m in metas):
            n = await self.promote(metas, gpu_in_place=in_place)
        for meta in metas[n:]:
            self.mover.unlease(meta)
        pools = [Tier.GPU if in_place and m.gpu_slot is not None else Tier.HOST for m in metas[:n]]
        self.counters.count_acquire([(m.size, f, p) for m, f, p in zip(metas, found_in, pools)],
                                    missed=n < len(keys), disk_on=self.mover.disk is not None)
        if n == 0:
            return EMPTY_ACQUIRED
        now = self.now()
        lease = self.leases.open(LeaseKind.GET, keys[:n], list(metas[:n]), now + ttl)
        blocks = []
        for meta, found, pool in zip(metas, found_in, pools):
            meta.hits += 1
            self.index.touch(meta, now)
            slot = meta.gpu_slot if pool is Tier.GPU else meta.host_slot
            assert slot is not None, "served blocks have a copy in their pool"
            checked = pool is Tier.HOST and meta.host_checked
            blocks.append(AcquiredBlock(meta.chain_hash, slot, meta.header, found, pool, checked))
        return Acquired(lease.lease_id, blocks, lease.expires_at)

    def _serve_host(self, keys: list[BlockKey], metas: list[BlockMeta], ttl: float) -> Acquired:
        """The common acquire, :meth:`acquire` for a prefix whose every block (leased by the
        caller) has a host copy, served in place: no promotion, every block found in HOST and
        read from HOST. One pass per block, since this runs for every block of every load."""
        n = len(metas)
        self.counters.count_host_acquire(n, sum(m.size for m in metas), missed=n < len(keys),
                                         disk_on=self.mover.disk is not None)
        if n == 0:
            return EMPTY_ACQUIRED
        now = self.now()
        lease = self.leases.open(LeaseKind.GET, keys[:n], metas, now + ttl)
        touch, host = self.index.touch, Tier.HOST
        blocks = []
        for meta in metas:
            meta.hits += 1
            if meta.queued:  # leased: queued for disk eviction at most
                touch(meta, now)
            else:
                meta.last_access = now  # touch() of a block in no queue
            blocks.append(AcquiredBlock(meta.key[NS_ID_LEN:], meta.host_slot, meta.header, host, host,  # type: ignore[arg-type]
                                        meta.host_checked))
        return Acquired(lease.lease_id, blocks, lease.expires_at)

    async def adopt_remote(self, keys: Sequence[BlockKey], fetched: Mapping[BlockKey, Fetched]) -> list[BlockMeta]:
        """Place the run of ``keys`` found in ``fetched`` (verified remote records) into host
        slots and commit them, leased once each, as the blocks a client reads: they are served
        as host hits. Stops at the first key without a record, one the index has (a client is
        writing it), or one that gets no host slot."""
        mover, index = self.mover, self.index
        todo: list[Fetched] = []
        for key in keys:
            got = fetched.get(key)
            if got is None or index.get(key) is not None:
                break
            todo.append(got)
        if not todo:
            return []
        placed: list[tuple[BlockMeta, Fetched]] = []
        try:
            await mover.make_room(Tier.HOST, sum(f.parsed.payload_len for f in todo))
            for got in todo:
                if index.get(got.key) is not None:  # nothing adds keys meanwhile (the mutex); kept plain
                    break
                slot = await mover.allocate(Tier.HOST, got.parsed.payload_len)
                if slot is None:
                    break
                meta = BlockMeta(got.key, got.parsed.payload_len)
                index.add(meta)  # pending: invisible and never a victim until committed below
                index.place(meta, Tier.HOST, slot)
                placed.append((meta, got))
            if placed:
                await mover.run(_copy_payloads, [mover.host.view(m.host_slot) for m, _ in placed],
                                [f.payload for _, f in placed])
        except BaseException:
            for meta, _ in placed:
                mover.free_memory(meta, announce=False)
            raise
        now = self.now()
        c = self.counters
        out = []
        for meta, got in placed:
            h = got.parsed
            index.commit(meta, got.header, h.parent_hash, h.num_tokens, h.checksum, now)
            index.mark_host_checked(meta)  # verified as it was fetched
            meta.remote = True
            index.lease(meta)
            c.tiers[Tier.HOST].bytes_in += meta.size
            mover.emit(EventKind.STORED, Tier.HOST, meta)
            out.append(meta)
        if mover.remote is not None:
            mover.remote.counters.fetched_blocks += len(out)
            mover.remote.counters.fetched_bytes += sum(m.size for m in out)
        mover.host.journal_flush()
        return out

    async def promote(self, metas: list[BlockMeta], *, gpu_in_place: bool = False) -> int:
        """Give the blocks of a prefix a host copy where they need one, verifying each copy.

        A block needs a host copy when it has none, unless ``gpu_in_place`` and it has a GPU
        copy (the caller serves that one in place). The copy comes from the GPU copy when there
        is one, else from the disk record. The prefix stops at the first block that gets no host
        slot or fails verification; a failed block loses the bad copy (counted). The caller holds
        a lease on every block of ``metas`` (so their memory copies stay while room is made).

        Returns:
            How many blocks from the start of ``metas`` can now be served.
        """
        mover, index = self.mover, self.index
        need = [m for m in metas if not _served(m, gpu_in_place)]
        for meta in need:
            index.set_moving(meta, True)
        placed: list[BlockMeta] = []
        try:
            await mover.make_room(Tier.HOST, sum(m.size for m in need))
            for meta in need:
                slot = await mover.allocate(Tier.HOST, meta.size)
                if slot is None:
                    break
                index.place(meta, Tier.HOST, slot)  # charged now, so the next allocation sees it
                placed.append(meta)
            from_gpu = [m for m in placed if m.gpu_slot is not None]
            from_disk = [m for m in placed if m.gpu_slot is None]
            outcome = dict(zip(from_disk, await self._load(from_disk)))
            outcome.update(zip(from_gpu, await mover.copy_from_gpu(from_gpu)))
        except BaseException:
            for meta in placed:  # roll back: the source copies are untouched
                mover.free_copy(meta, Tier.HOST, announce=False)
            raise
        finally:
            for meta in need:
                index.set_moving(meta, False)
        good = 0
        for meta in metas:
            if outcome.get(meta, "ok") != "ok" or not _served(meta, gpu_in_place):
                break
            good += 1
        for meta, result in outcome.items():
            await self._settle(meta, result)
        if mover.remote is not None:  # write-through: blocks back from disk the cluster may lack
            mover.remote.offer_missing([m for m in from_disk if outcome.get(m) == "ok"])
        return good

    async def _settle(self, meta: BlockMeta, result: str) -> None:
        """Count a copy into host, or undo it and drop the bad source copy."""
        c, mover = self.counters, self.mover
        from_gpu = meta.gpu_slot is not None
        if result == "ok":
            # Valid copies after a failed one stay in host; they are just not served now.
            if from_gpu:
                c.tiers[Tier.GPU].bytes_out += meta.size
            else:
                c.promotions += 1
                c.tiers[Tier.DISK].bytes_out += meta.charge(Tier.DISK)
            c.tiers[Tier.HOST].bytes_in += meta.size
            self.index.mark_host_checked(meta)  # the copy was verified on its way in
            mover.emit(EventKind.STORED, Tier.HOST, meta)
            return
        mover.free_copy(meta, Tier.HOST, announce=False)
        if result == "error":
            return  # the disk could not be read now: keep the record, serve a miss
        if result == "corrupt":
            mover.corrupt(meta, "GPU copy (promotion to host)" if from_gpu else "disk record (promotion to host)")
        if from_gpu:
            if meta.leases <= 1:  # ours only: no other reader is copying out of the bad slot
                mover.free_copy(meta, Tier.GPU)
        else:
            await mover.delete_disk([meta], force=True)  # the record is bad or gone: forget the block

    async def _load(self, metas: list[BlockMeta]) -> list[str]:
        """Read, verify and copy disk records into the host slots placed for them."""
        if not metas:
            return []
        mover = self.mover
        assert mover.disk is not None, "blocks are on disk only when a disk tier exists"
        try:
            return await mover.run(load_records, mover.disk, [m.key for m in metas], [m.header for m in metas],
                                   [mover.host.view(m.host_slot) for m in metas])
        except StorageError:
            self.counters.storage_errors += 1
            return ["error"] * len(metas)


def _copy_payloads(slots: Sequence[memoryview], payloads: Sequence[memoryview]) -> None:
    """Copy verified payloads into the host slots placed for them (on the I/O pool)."""
    for slot, payload in zip(slots, payloads):
        slot[:len(payload)] = payload


def _served(meta: BlockMeta, gpu_in_place: bool) -> bool:
    """Whether ``meta`` can be served without a copy."""
    return meta.host_slot is not None or (gpu_in_place and meta.gpu_slot is not None)


def _source(meta: BlockMeta, gpu_in_place: bool) -> Tier:
    """The tier an acquire serves ``meta`` from (its ``AcquiredBlock.tier``)."""
    if gpu_in_place and meta.gpu_slot is not None:
        return Tier.GPU
    if meta.host_slot is not None:
        return Tier.HOST
    return Tier.GPU if meta.gpu_slot is not None else Tier.DISK
