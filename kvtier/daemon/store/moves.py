"""Transactional moves between tiers: eviction and demotion (GPU → host → disk), disk writes.

Every method here runs with the store's mutex held, so no other move, commit or delete
interleaves at an ``await``; a block being moved is also flagged ``moving`` so that a nested
eviction (a GPU eviction needs host room, which demotes host blocks, which may need disk room)
never picks it. The rule of every move: the source copy is freed only after the destination copy
is written and its bytes verified against the header checksum; a failed check or write drops the
block (a miss later), never serves or keeps bad bytes.

Copies and disk I/O run on the store's thread pool (:mod:`kvtier.daemon.store.transfers`) so the event
loop stays responsive.

Precision by tier (issue 25): with a lossy ``StoreConfig.disk_codec`` (or a lossy codec for the
block's model in ``disk_models``; K per channel or per token: ``disk_k_axis``), a host block demoted to
disk by eviction is re-encoded on the way (:func:`~kvtier.daemon.store.transfers.recode_verified`:
the host copy is verified, then encoded, then the new payload verified), written under the same
key, and only then, with its host copy freed, does the block take the new record's header, size
and checksum. A crash in between leaves the disk tier with the old record or the new one (its
files are written whole before their metadata commits, :mod:`kvtier.daemon.store.disk`), and a
host copy that survives it is dropped at start for the disk's other encoding of the key
(:mod:`kvtier.daemon.store.host_recovery`). A promotion back into host copies the lossy record
as it is: the host copy's header names its codec. This module imports no torch: the GPU tier is reached through its object.
Promotion into host (the get path) is in :mod:`kvtier.daemon.store.reads`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier_protocol.errors import StorageError

from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.index import BlockIndex, BlockMeta, BlockState
from kvtier.daemon.store.policy import AdmissionFilter
from kvtier.daemon.store.remote_link import RemoteLink
from kvtier.daemon.store.stats import EventKind, EventLog, StoreCounters, StoreEvent
from kvtier.daemon.store.transfers import (Recoded, gpu_snapshot_verified, gpu_to_host, recode_choice, recode_verified,
                                           snapshot_verified)
from kvtier.daemon.store.types import NS_ID_LEN, BlockKey, Slot, Tier

# module constants: emit runs per block, and Enum member access is a slow path in Python 3.11
_HOST_TIER, _STORED_KIND, _REMOVED_KIND = Tier.HOST, EventKind.STORED, EventKind.REMOVED
_COMMITTED = BlockState.COMMITTED

if TYPE_CHECKING:
    from kvtier_protocol.namespace import Namespace

    from kvtier.daemon.store.gpu import GpuTier

R = TypeVar("R")
Payload = bytes | memoryview  # a verified payload copy: memoryviews are the disk tier's aligned buffers
MEMORY_TIERS = (Tier.GPU, Tier.HOST)
RECODE_CHUNKS = 4
"""A demotion batch with a lossy disk codec is re-encoded and written in up to this many chunks,
one encoded while the one before is written (:meth:`Mover._write_recoded`): more overlap, at one
metadata commit per chunk."""


log = logging.getLogger(__name__)

class Mover:
    """Moves blocks between the GPU, host and disk tiers for :class:`~kvtier.daemon.store.store.TieredStore`."""

    def __init__(self, cfg: StoreConfig, index: BlockIndex, host: HostTier, disk: DiskTier | None,
                 gpu: GpuTier | None, counters: StoreCounters, events: EventLog,
                 admission: AdmissionFilter[BlockKey], pool: ThreadPoolExecutor) -> None:
        self.cfg = cfg
        self.index = index
        self.host = host
        self.disk = disk
        self.gpu = gpu
        self.counters = counters
        self.events = events
        self.admission = admission
        self.pool = pool
        self._recode_cpu: collections.deque[float] = collections.deque()  # see _recode_timed
        self.zombies: set[BlockMeta] = set()  # removed while leased: freed at their last release
        self.remote: RemoteLink | None = None  # the remote tier (RemoteLink.attach sets it)
        if cfg.disk_recodes and disk is not None:
            # The codecs run on torch: load it now, at start, rather than inside the first
            # eviction, where the import (seconds, mostly holding the GIL) would stall the loop.
            import torch  # noqa: PLC0415

            import kvtier_protocol.block  # noqa: F401, PLC0415
            # One intra-op thread: the I/O pool's threads are the daemon's parallelism, and
            # OpenMP workers spinning on a busy host made the codec's small ops (scales, checks)
            # 20x slower (2 MiB int8 encode: 330 ms against 14 ms, 2 busy cores). This process
            # runs no other torch work but the GPU tier's copies.
            torch.set_num_threads(1)

    async def run(self, fn: Callable[..., R], *args: Any) -> R:
        """Run blocking work (disk I/O, a large copy) on the I/O pool."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args))

    def corrupt(self, meta: BlockMeta, copy: str) -> None:
        """Count and log a copy of ``meta`` that failed its checksum (``copy`` says which: the
        caller drops it, and a read of it is a miss). Never expected: each one is worth a look."""
        self.counters.checksum_failures += 1
        log.warning("block %s: its %s failed the checksum; dropped", meta.chain_hash.hex(), copy)

    def emit(self, kind: EventKind, tier: Tier, meta: BlockMeta) -> None:
        """Announce a copy stored or removed. A host copy announced STORED has become visible
        (commit, demotion from GPU, promotion from disk): it is journaled here, for a restart
        after a crash (:mod:`kvtier.daemon.store.host_journal`)."""
        if tier is _HOST_TIER and kind is _STORED_KIND:
            self.host.journal_commit(meta.host_slot, meta.priority, meta.header)  # type: ignore[arg-type]
        events = self.events
        if events.enabled:
            key = meta.key  # split_key, inline: this runs per block stored and removed
            events.append(StoreEvent(kind, tier, key[:NS_ID_LEN], key[NS_ID_LEN:], meta.parent_hash, meta.num_tokens))

    def emit_many(self, kind: EventKind, tier: Tier, metas: Sequence[BlockMeta]) -> None:
        """:meth:`emit` of each of ``metas``, in order (one tier, one kind: a batch's events,
        built in one pass and queued in one step)."""
        if not metas:
            return
        if tier is _HOST_TIER and kind is _STORED_KIND:
            journal = self.host.journal  # host.journal_commit of each, in one pass
            if journal is not None:
                journal.commit_many([(m.host_slot, m.priority, m.header) for m in metas])  # type: ignore[misc]
        events = self.events
        if events.enabled:
            new, n = StoreEvent, NS_ID_LEN
            events.extend([new(kind, tier, key[:n], key[n:], meta.parent_hash, meta.num_tokens)
                           for meta in metas for key in (meta.key,)])

    def memory(self, tier: Tier) -> HostTier | GpuTier:
        """The slot pool of a memory tier (GPU or host)."""
        if tier is Tier.HOST:
            return self.host
        assert tier is Tier.GPU and self.gpu is not None, "GPU slots exist only with a GPU tier"
        return self.gpu

    # --- memory tiers: slots and eviction -------------------------------------------------------

    def take_slot(self, tier: Tier, nbytes: int) -> Slot | None:
        """A slot of ``nbytes`` in ``tier`` if one is free now (no eviction); None otherwise.

        Synchronous, so a batch whose room was made beforehand (``make_room``) takes its slots
        without a coroutine per block; :meth:`allocate` evicts when this finds none.
        """
        return self.memory(tier).allocate(nbytes) if self.index.has_room(tier, nbytes) else None

    async def allocate(self, tier: Tier, nbytes: int) -> Slot | None:
        """A slot of ``nbytes`` in ``tier``, evicting least valuable blocks as needed; None if impossible."""
        while True:
            slot = self.take_slot(tier, nbytes)
            if slot is not None:
                return slot
            # With room by the byte count but no free range of the right size (size classes,
            # fragmentation), free at least one more block and retry.
            want = nbytes if self.index.has_room(tier, nbytes) else nbytes - self.index.free_bytes(tier)
            if not await self.evict(tier, want):
                return None

    async def make_room(self, tier: Tier, nbytes: int) -> None:
        """Evict for a whole batch at once, so its demotions go down in one copy / one disk write."""
        short = nbytes - self.index.free_bytes(tier)
        if short > 0:
            await self.evict(tier, short)

    async def evict(self, tier: Tier, nbytes: int) -> bool:
        """Free at least ``nbytes`` of a memory tier (or one block); False when nothing is evictable.

        GPU victims without a host copy are demoted into host; host victims without a GPU copy
        are demoted to disk when the admission filter lets them.
        """
        victims: list[BlockMeta] = []
        freed = 0
        for meta in self.index.victims(tier):
            victims.append(meta)
            freed += meta.size
            if freed >= nbytes:
                break
        if not victims:
            return False
        recoded: dict[BlockMeta, Recoded] = {}
        self.index.set_moving_many(victims, True)
        try:
            if tier is Tier.GPU:
                await self._demote_to_host([m for m in victims if m.host_slot is None])
            else:
                # A block still in GPU memory goes down later, through host, when the GPU evicts it.
                recoded = await self._demote_to_disk([m for m in victims if m.gpu_slot is None and self.wants_disk(m)])
                if self.remote is not None:  # write-back: the records are copied before the slots go
                    await self.remote.offer_copies([m for m in victims if m.gpu_slot is None])
        finally:
            self.index.set_moving_many(victims, False)
        # Only now, with every lower copy written and verified, are these copies freed.
        if tier is Tier.HOST and recoded:
            for meta in victims:
                rec = recoded.get(meta)
                if rec is None:
                    self.free_copy(meta, tier)
                else:
                    self._swap_to_disk(meta, rec)
        else:
            self.free_copies(victims, tier)  # free_copy of each, in one pass
        self.counters.tiers[tier].evictions += len(victims)
        return True

    def wants_disk(self, meta: BlockMeta) -> bool:
        """Whether a block leaving memory should be written to disk (admission filter, capacity)."""
        if self.disk is None or meta.on_disk:
            return False
        if not self.admission.admits(meta.accesses):
            self.counters.admission_rejects += 1
            self.admission.forget(meta.key, meta.accesses)
            return False
        return meta.charge(Tier.DISK) <= self.index.capacity[Tier.DISK]

    def free_copy(self, meta: BlockMeta, tier: Tier, *, announce: bool = True) -> None:
        """Free the copy of ``meta`` in memory tier ``tier`` (caller checked it is not read); unlink
        the block if it is left in no tier.

        Args:
            announce: emit a REMOVED event (False for a copy that was never announced).
        """
        slot = self.index.unplace(meta, tier)
        assert slot is not None, "memory copies have slots"
        self.memory(tier).free(slot)
        if announce and meta.committed:
            self.emit(EventKind.REMOVED, tier, meta)
        if not meta.tiers:
            self.index.unlink(meta)

    def free_copies(self, metas: Sequence[BlockMeta], tier: Tier, *, announce: bool = True) -> None:
        """:meth:`free_copy` of each of ``metas`` in memory tier ``tier``, in order: the same
        slots freed, journal entries, REMOVED events and unlinks, with one pass over the index
        (:meth:`BlockIndex.unplace_many`), one over the slot pool and one over the events."""
        if not metas:
            return
        slots = self.index.unplace_many(metas, tier)
        self.memory(tier).free_many(slots)
        if announce:
            committed = _COMMITTED  # BlockMeta.committed of each, without the property call
            self.emit_many(_REMOVED_KIND, tier, [m for m in metas if m.state is committed])

    def free_memory(self, meta: BlockMeta, *, announce: bool = True) -> None:
        """Free every memory copy of ``meta`` (GPU and host); unlink it if nothing is left."""
        for tier in MEMORY_TIERS:
            if meta.in_tier(tier):
                self.free_copy(meta, tier, announce=announce)
        if not meta.tiers:
            self.index.unlink(meta)

    def unlease(self, meta: BlockMeta) -> None:
        """Drop one lease of ``meta``; a block removed while leased is freed with its last lease."""
        self.unlease_all((meta,))

    def unlease_all(self, metas: Iterable[BlockMeta]) -> None:
        """:meth:`unlease` each of ``metas`` (a released get lease: one call, not one per block)."""
        unlease, zombies = self.index.unlease, self.zombies
        for meta in metas:
            unlease(meta)
            if zombies and meta.leases == 0 and meta in zombies:
                zombies.discard(meta)
                self.free_memory(meta, announce=False)  # its removal was announced when it was removed

    async def remove(self, metas: Sequence[BlockMeta]) -> None:
        """Delete committed blocks from every tier (delete / clear).

        A leased block leaves the index at once but keeps its memory slots, charged, until the
        last reader releases it.
        """
        await self.delete_disk(metas, force=True)
        self.counters.deletes += len(metas)
        if not any(m.leases or m.gpu_slot is not None for m in metas):
            # The common delete: nothing leased, nothing in GPU memory. free_memory of each is
            # free_copy of its host copy (and an unlink, done already by delete_disk for those
            # only on disk): in one pass, the same frees, journal entries and events in order.
            in_host = [m for m in metas if m.host_slot is not None]
            if len(in_host) < len(metas):
                for meta in metas:
                    if meta.host_slot is None:
                        self.index.unlink(meta)  # a no-op for one delete_disk unlinked
            self.free_copies(in_host, _HOST_TIER)  # unlinks them too: they are left in no tier
            assert not any(m.linked for m in metas), "removed blocks are unreachable"
            self.host.journal_flush()  # a deleted block never comes back after a crash
            return
        for meta in metas:
            if meta.leases:
                for tier in MEMORY_TIERS:
                    if meta.in_tier(tier):
                        self.emit(EventKind.REMOVED, tier, meta)
                if meta.host_slot is not None:
                    self.host.journal_forget(meta.host_slot)  # deleted now, freed with its last lease
                self.index.unlink(meta)
                self.zombies.add(meta)
            else:
                self.free_memory(meta)
            assert not meta.linked, "removed blocks are unreachable"
        self.host.journal_flush()  # a deleted block never comes back after a crash

    # --- copies out of memory ------------------------------------------------------------------

    async def snapshot(self, metas: Sequence[BlockMeta], checksums: Sequence[int] | None = None) -> list[Payload | None]:
        """Verified copies of the payloads of ``metas``, from host where a host copy exists, else GPU.

        Host copies go into the disk tier's page-aligned buffers when there is a disk tier: written
        down in place and given back by :meth:`write_disk`, or freed with their last reference.

        Args:
            checksums: what to verify against (default: each block's committed checksum).

        Returns:
            Per block: the payload copy, or None when the copy fails its checksum.
        """
        sums = list(checksums) if checksums is not None else [m.checksum for m in metas]
        out: list[Payload | None] = [None] * len(metas)
        in_host = [i for i, m in enumerate(metas) if m.host_slot is not None]
        in_gpu = [i for i, m in enumerate(metas) if m.host_slot is None]
        if in_host:
            got = await self.run(snapshot_verified, [self.host.view(metas[i].host_slot) for i in in_host],
                                 [sums[i] for i in in_host], None if self.disk is None else self.disk.buffers)
            for i, data in zip(in_host, got):
                out[i] = data
        if in_gpu:
            assert self.gpu is not None and all(metas[i].gpu_slot is not None for i in in_gpu), "memory copies only"
            got = await self.run(gpu_snapshot_verified, self.gpu, [metas[i].gpu_slot for i in in_gpu],
                                 [sums[i] for i in in_gpu])
            for i, data in zip(in_gpu, got):
                out[i] = data
        return out

    async def copy_from_gpu(self, metas: list[BlockMeta]) -> list[str]:
        """Copy GPU copies into the host slots already placed for them; ``"ok"`` / ``"corrupt"`` each."""
        if not metas:
            return []
        assert self.gpu is not None, "blocks are in GPU memory only when a GPU tier exists"
        return await self.run(gpu_to_host, self.gpu, self.host, [m.gpu_slot for m in metas],
                              [m.host_slot for m in metas], [m.checksum for m in metas])

    # --- demotion ------------------------------------------------------------------------------

    async def _demote_to_host(self, metas: list[BlockMeta]) -> None:
        """Copy GPU victims into host slots (verified). Their GPU copies are freed by the caller;
        a victim that gets no host slot or fails verification is left to be dropped with it."""
        if not metas:
            return
        await self.make_room(Tier.HOST, sum(m.size for m in metas))
        placed: list[BlockMeta] = []
        try:
            for meta in metas:
                slot = await self.allocate(Tier.HOST, meta.size)
                if slot is None:
                    break
                self.index.place(meta, Tier.HOST, slot)
                placed.append(meta)
            results = await self.copy_from_gpu(placed)
        except BaseException:
            for meta in placed:  # roll back: the GPU copies are untouched
                self.free_copy(meta, Tier.HOST, announce=False)
            raise
        c = self.counters
        for meta, result in zip(placed, results):
            if result == "ok":
                c.demotions += 1
                c.tiers[Tier.GPU].demotions += 1
                c.tiers[Tier.GPU].bytes_out += meta.size
                c.tiers[Tier.HOST].bytes_in += meta.size
                self.index.mark_host_checked(meta)  # verified as it was copied down
                self.emit(EventKind.STORED, Tier.HOST, meta)
                if self.remote is not None:  # write-through of a block committed into GPU memory
                    self.remote.offer(meta)
            else:
                self.corrupt(meta, "GPU copy (demotion to host)")  # drop it, never keep it below
                self.free_copy(meta, Tier.HOST, announce=False)

    async def _demote_to_disk(self, metas: list[BlockMeta]) -> dict[BlockMeta, Recoded]:
        """Write host blocks to disk, verified on the way. Their host copies are freed by the caller.

        Returns:
            The blocks written through :meth:`_write_recoded` (a lossy ``disk_codec``), with the
            records written for them: not yet placed on disk, which the caller does with
            :meth:`_swap_to_disk` in place of freeing their host copies.
        """
        if not metas:
            return {}
        rope = self._recodable(metas) if self.cfg.disk_recodes else {}
        written = await self.write_disk_verified([m for m in metas if m not in rope] if rope else metas)
        recoded = await self._write_recoded([m for m in metas if m in rope], rope) if rope else {}
        c = self.counters
        c.demotions += len(written) + len(recoded)
        c.tiers[Tier.HOST].demotions += len(written) + len(recoded)
        c.tiers[Tier.HOST].bytes_out += sum(m.size for m in written) + sum(m.size for m in recoded)
        return recoded

    def _recodable(self, metas: Sequence[BlockMeta]) -> dict[BlockMeta, tuple[int, str]]:
        """The blocks of ``metas`` the disk tier re-encodes, each with the MLA rope dims it keeps
        raw and its codec (:func:`~kvtier.daemon.store.transfers.recode_choice`: ``disk_codec``,
        or the ``disk_models`` codec of its namespace's model; raw (uncompressed)
        float16/bfloat16/float32 KV only, MLA ones only when the namespace (saved with the disk
        tier, or in the header) names its rope dims). The others go down as they are."""
        disk = self.disk
        assert disk is not None, "demotion to disk needs a disk tier"
        known: dict[bytes, Namespace | None] = {}  # one look-up (under the disk tier's lock) per namespace

        def namespace(ns_id: bytes) -> Namespace | None:
            if ns_id not in known:
                known[ns_id] = disk.namespace(ns_id)
            return known[ns_id]

        cfg = self.cfg
        out: dict[BlockMeta, tuple[int, str]] = {}
        for meta in metas:
            how = recode_choice(meta.header, namespace, cfg.disk_codec, cfg.disk_models)
            if how is not None:
                out[meta] = how
        return out

    async def _write_recoded(self, metas: list[BlockMeta],
                             rope: dict[BlockMeta, tuple[int, str]]) -> dict[BlockMeta, Recoded]:
        """Re-encode host blocks, each with its disk codec (``rope``: :meth:`_recodable`'s rope
        dims and codec), on the I/O pool from verified copies, and
        write the records to disk under the same keys; the blocks written, with their records.

        A host copy that fails its checksum is counted and not written. Blocks that do not fit
        (after evicting disk LRU blocks) or whose write fails are left without a disk copy, as
        by :meth:`write_disk_verified`. The index is not touched: see :meth:`_swap_to_disk`.

        The batch goes down in chunks, each re-encoded while the chunk before is written (two
        threads of the I/O pool: the codec's C loops and the writes release the GIL), as the raw
        path copies a block while the one before is written; encoding the whole batch first left
        the disk idle for as long as the codec ran.
        """
        assert self.disk is not None, "demotion to disk needs a disk tier"
        if not metas:
            return {}
        compression = None if self.cfg.disk_compression == "none" else self.cfg.disk_compression
        items = [(m.header, self.host.view(m.host_slot), m.checksum, *rope[m]) for m in metas]
        step = max(1, -(-len(metas) // RECODE_CHUNKS))
        chunks = [range(i, min(len(metas), i + step)) for i in range(0, len(metas), step)]
        written: dict[BlockMeta, Recoded] = {}
        first = chunks[0]
        pending: Future[list[Recoded | None]] | None = self._recode_soon(items[first.start:first.stop], compression)
        try:
            for i, r in enumerate(chunks):
                got = await asyncio.wrap_future(pending)
                pending = self._recode_soon(items[chunks[i + 1].start:chunks[i + 1].stop], compression) \
                    if i + 1 < len(chunks) else None
                # the records written by earlier chunks are not placed yet: their room is kept
                done = await self._write_chunk(metas[r.start:r.stop], got,
                                               sum(len(rec.header) + rec.size for rec in written.values()))
                if done is None:  # the write failed: the rest is not written either
                    break
                written.update(done)
        finally:
            if pending is not None:  # still encoding (an error, a cancellation): its buffers go back after
                pending.add_done_callback(self._give_back_recoded)
            self._count_recode_time()
        return written

    def _recode_soon(self, items: list[tuple[bytes, memoryview, int, int, str]],
                     compression: str | None) -> Future[list[Recoded | None]]:
        """:func:`recode_verified` of ``items`` submitted to the I/O pool (a future of the pool's,
        not the loop's: :meth:`_give_back_recoded` can follow it even after a cancellation)."""
        assert self.disk is not None, "demotion to disk needs a disk tier"
        return self.pool.submit(self._recode_timed, items, self.cfg.disk_k_axis, compression, self.disk.buffers)

    def _recode_timed(self, *args: Any) -> list[Recoded | None]:
        """:func:`recode_verified` on a pool thread, its CPU time noted for the loop to count
        (:meth:`_count_recode_time`): a deque's append is atomic, a float's += is not."""
        start = time.thread_time()
        try:
            return recode_verified(*args)
        finally:
            self._recode_cpu.append(time.thread_time() - start)

    def _count_recode_time(self) -> None:
        cpu, tier = self._recode_cpu, self.counters.tiers[Tier.DISK]
        while cpu:
            tier.recode_seconds += cpu.popleft()

    def _give_back_recoded(self, fut: Future[list[Recoded | None]]) -> None:
        """Return the buffers of a re-encoded chunk that will never be written (any thread)."""
        assert self.disk is not None, "demotion to disk needs a disk tier"
        if fut.cancelled() or fut.exception() is not None:
            return
        for rec in fut.result():
            if rec is not None:
                self.disk.buffers.give_back(rec.payload)

    async def _write_chunk(self, metas: list[BlockMeta], got: list[Recoded | None],
                           kept: int) -> dict[BlockMeta, Recoded] | None:
        """Write one re-encoded chunk of :meth:`_write_recoded` (``got``: per block, its record or
        None for a host copy that failed its checksum), making room for it on top of ``kept``
        bytes (the earlier chunks' records, written but not yet placed); the blocks written, None
        when the write failed. Every buffer of ``got`` goes back to the disk tier's pool."""
        assert self.disk is not None, "demotion to disk needs a disk tier"
        todo: list[tuple[BlockMeta, Recoded]] = []
        for meta, rec in zip(metas, got):
            if rec is None:
                self.corrupt(meta, "host copy (re-encoding for disk)")  # never written down
            else:
                todo.append((meta, rec))
        try:
            batch: list[tuple[BlockMeta, Recoded]] = []
            batch_bytes = 0
            for meta, rec in todo:
                charge = len(rec.header) + rec.size  # the disk charge of the record written
                if await self.make_room_disk(kept + batch_bytes + charge):
                    batch.append((meta, rec))
                    batch_bytes += charge
            if not batch:
                return {}
            try:
                await self.run(self.disk.put_many, [(m.key, r.header, r.payload) for m, r in batch])
            except StorageError:
                self.counters.storage_errors += 1
                return None
            return dict(batch)
        finally:
            for _, rec in todo:
                self.disk.buffers.give_back(rec.payload)

    def _swap_to_disk(self, meta: BlockMeta, rec: Recoded) -> None:
        """Free the host copy of a block whose re-encoded record :meth:`_write_recoded` wrote,
        give the block that record's header, size and checksum, and place it on disk, in one
        step (no await: nobody sees the block in between, in no tier)."""
        slot = self.index.unplace(meta, Tier.HOST)
        assert slot is not None, "host copies have slots"
        self.host.free(slot)
        if meta.committed:
            self.emit(EventKind.REMOVED, Tier.HOST, meta)
        disk = self.counters.tiers[Tier.DISK]
        disk.recoded += 1
        disk.recoded_saved_bytes += meta.size - rec.size
        self.index.reencode(meta, rec.header, rec.size, rec.checksum)
        self._placed_on_disk([meta], announce=True)

    # --- disk ----------------------------------------------------------------------------------

    async def write_disk_verified(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """Write the host copies of committed blocks to disk through verified snapshots
        (:meth:`DiskTier.put_verified`: one copy per block, each overlapped with the write of the
        one before); returns the blocks written. A copy that fails its checksum is counted and
        not written; blocks that do not fit or whose write fails are left without a disk copy.
        """
        assert self.disk is not None, "callers check the disk tier exists"
        batch = await self._room_on_disk(metas)
        if not batch:
            return []
        items = [(m.key, m.header, self.host.view(m.host_slot), m.checksum) for m in batch]
        try:
            stored = await self.run(self.disk.put_verified, items)
        except StorageError:
            self.counters.storage_errors += 1
            return []
        for meta in (m for m, ok in zip(batch, stored) if not ok):
            self.corrupt(meta, "host copy (demotion to disk)")  # a bad host copy is never written down
        written = [m for m, ok in zip(batch, stored) if ok]
        self._placed_on_disk(written, announce=True)
        return written

    async def write_disk(self, items: Sequence[tuple[BlockMeta, Payload]], *, announce: bool = True) -> list[BlockMeta]:
        """Write verified payloads (from :meth:`snapshot`) of committed blocks to disk; returns the
        blocks written. The payload buffers go back to the disk tier's pool.

        Blocks that do not fit (after evicting disk LRU blocks) or whose write fails are left
        without a disk copy.

        Args:
            announce: emit STORED events (False when the caller announces the blocks itself).
        """
        assert self.disk is not None, "callers check the disk tier exists"
        try:
            payload_of = dict(items)
            batch = await self._room_on_disk([m for m, _ in items])
            if not batch:
                return []
            try:
                await self.run(self.disk.put_many, [(m.key, m.header, payload_of[m]) for m in batch])
            except StorageError:
                self.counters.storage_errors += 1
                return []
        finally:
            for _, payload in items:
                if isinstance(payload, memoryview):
                    self.disk.buffers.give_back(payload)
        self._placed_on_disk(batch, announce=announce)
        return batch

    async def _room_on_disk(self, metas: Sequence[BlockMeta]) -> list[BlockMeta]:
        """The blocks of ``metas`` that fit on disk, in order, after evicting disk LRU blocks."""
        batch: list[BlockMeta] = []
        batch_bytes = 0
        for meta in metas:
            if await self.make_room_disk(batch_bytes + meta.charge(Tier.DISK)):
                batch.append(meta)
                batch_bytes += meta.charge(Tier.DISK)
        return batch

    def _placed_on_disk(self, metas: list[BlockMeta], *, announce: bool) -> None:
        for meta in metas:
            self.index.place(meta, Tier.DISK)
            self.counters.tiers[Tier.DISK].bytes_in += meta.charge(Tier.DISK)
            if announce:
                self.emit(EventKind.STORED, Tier.DISK, meta)

    async def make_room_disk(self, nbytes: int) -> bool:
        """Evict least valuable disk blocks until ``nbytes`` fit; False if they never can."""
        if self.index.has_room(Tier.DISK, nbytes):
            return True
        need = nbytes - self.index.free_bytes(Tier.DISK)
        victims, freed = [], 0
        for meta in self.index.victims(Tier.DISK):
            victims.append(meta)
            freed += meta.charge(Tier.DISK)
            if freed >= need:
                break
        if freed < need:
            return False
        if not await self.delete_disk(victims):
            return False
        self.counters.tiers[Tier.DISK].evictions += len(victims)
        return True

    async def delete_disk(self, metas: Sequence[BlockMeta], *, force: bool = False) -> bool:
        """Remove the disk copies of ``metas``; unlink those left in no tier.

        Args:
            force: on an I/O error, forget the copies anyway (their records become orphans for
                ``check``); without it the index keeps them and False is returned.
        """
        metas = [m for m in metas if m.on_disk]
        if not metas:
            return True
        assert self.disk is not None, "blocks are on disk only when a disk tier exists"
        try:
            await self.run(self.disk.delete_many, [m.key for m in metas])
        except StorageError:
            self.counters.storage_errors += 1
            if not force:
                return False
        for meta in metas:
            self.index.unplace(meta, Tier.DISK)
            if meta.committed:
                self.emit(EventKind.REMOVED, Tier.DISK, meta)
            if not meta.tiers:
                self.index.unlink(meta)
        return True
