"""TieredStore: the one facade over index, policies, leases and tiers (docs/design.md §5).

::

    put:  reserve(ns, hashes, sizes) ─► slots ─► client writes host.view(slot) ─► commit(lease, headers)
    get:  lookup(ns, hashes) ─► acquire(ns, hashes) ─► client reads host.view(slot) ─► release(lease)

    tiers:  GPU ──evict──► host (shm) ──evict──► disk (files + RocksDB meta)   every move verified by checksum
            remote (a cluster shared by many hosts, optional): looked up and fetched below disk,
            uploaded at commit (write-through) or at host eviction (write-back); kvtier.daemon.store.remote_link

``reserve(..., tier=Tier.GPU)`` puts into the GPU tier (the client writes ``gpu.tensor(slot)``);
``acquire`` serves from host, promoting disk blocks and copying GPU-only blocks down;
``acquire(..., tier=Tier.GPU)`` serves GPU copies in place. ``close`` writes memory blocks to disk.

Concurrency: one asyncio task at a time runs a mutating async operation (reserve, commit, acquire,
delete, clear, check), under a mutex; their disk I/O and large copies run on a thread pool, so
the event loop keeps serving the synchronous calls (lookup, release, pin, touch, counters), which
are atomic with respect to it. Moves are therefore never interleaved, and a block flagged
``moving`` is only ever one the running operation is moving.

Expired leases are reclaimed lazily at the start of every call (and by :meth:`reclaim_expired`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier_protocol.errors import InvalidRequest, LeaseError, StorageError
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.store import validation as check
from kvtier.daemon.store.audit import audit
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.disk import DiskTier
from kvtier.daemon.store.exact import exact_run
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.host_recovery import HostRecovery
from kvtier.daemon.store.index import TIERS, BlockIndex, BlockMeta
from kvtier.daemon.store.lease import Lease, LeaseKind, LeaseTable
from kvtier.daemon.store.moves import MEMORY_TIERS, Mover
from kvtier.daemon.store.parts import Shared, StoreParts, close_parts, open_parts
from kvtier.daemon.store.policy import AdmissionFilter
from kvtier.daemon.store.remote_link import Fetched, RemoteLink, RemoteOptions
from kvtier.daemon.store.results import Acquired, BlockInfo, CheckReport, LookupResult, PlaceStatus, Reservation
from kvtier.daemon.store.scrub import CommitScrubber
from kvtier.daemon.store.stats import EventLog, StoreCounters, StoreEvent, StoreGauges, TierGauges
from kvtier.daemon.store.types import TIER_WIRE_NAMES, BlockKey, Tier

if TYPE_CHECKING:
    from kvtier.daemon.remote.backend import RemoteBlocks
    from kvtier.daemon.store.gpu import GpuTier

log = logging.getLogger(__name__)


class TieredStore:
    """Content-addressed KV blocks over a GPU tier (optional), host shared memory and a disk tier.

    Args:
        config: the settings.
        now: the clock for leases and recency (seconds, monotonic); injectable for tests.
        remote: the remote tier below disk (:mod:`kvtier.daemon.store.remote_link`); None: none.
            The store closes it at :meth:`close`.
        remote_options: how this store uses it (tenant, write mode, upload queue, lookup budget).

    Raises:
        StoreConfigError: ``gpu_bytes > 0`` on a CUDA ``gpu_device`` where CUDA is not available
            (checked here, before anything is opened; only then is torch imported).
    """

    def __init__(self, config: StoreConfig, *, now: Callable[[], float] = time.monotonic,
                 remote: RemoteBlocks | None = None, remote_options: RemoteOptions | None = None) -> None:
        if config.gpu_bytes:
            from kvtier.daemon.store.gpu_setup import check_gpu_device

            check_gpu_device(config)
        self.config = config
        self.now = now
        disk_bytes = config.disk_bytes if config.disk_path is not None else 0
        self.index = BlockIndex({Tier.GPU: config.gpu_bytes, Tier.HOST: config.host_bytes, Tier.DISK: disk_bytes},
                                config.priority_classes)
        self._counters = StoreCounters()
        self._taken = StoreCounters()
        self._events = EventLog(config.max_events, self._counters)
        self._admission: AdmissionFilter[BlockKey] = AdmissionFilter(config.disk_admit_hits,
                                                                     config.admission_ghosts)
        self._leases: LeaseTable[BlockMeta] = LeaseTable()
        self._namespaces: dict[bytes, Namespace] = {}
        self._mutex = asyncio.Lock()
        self._parts: StoreParts | None = None
        self._scrubber: CommitScrubber | None = None
        self._started = False
        # What start() adopted of the host tier a crashed daemon left (None: fresh segments).
        self.host_recovery: HostRecovery | None = None
        self.remote = RemoteLink(remote, remote_options)

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the tiers and rebuild the index from the disk tier's metadata (no payload reads).

        Raises:
            InvalidRequest: started twice (a closed store is not restarted: make a new one).
            StorageError: a tier cannot be opened (nothing stays open then).
        """
        if self._started:
            raise InvalidRequest("a TieredStore starts once; make a new one to reopen the tiers")
        self._started = True
        shared = Shared(self.index, self._counters, self._events, self._admission, self._leases, self.now)
        self._parts = await open_parts(self.config, shared)
        if self._parts.disk is not None:  # the namespaces saved before the restart
            self._namespaces.update({ns.ns_id: ns for ns in self._parts.disk.namespaces()})
        self.host_recovery = shared.recovery[0] if shared.recovery else None
        self.remote.attach(self._parts.mover)
        if self.host_recovery is not None:  # write-through: what survived a crash the cluster may lack
            self.remote.offer_missing([m for m in self.index.blocks() if m.host_slot is not None], wait_for_room=True)
        if self.config.scrub_commits:
            self._scrubber = CommitScrubber(self.index, self._parts.mover, self._counters, self._mutex)
            self._scrubber.start()

    async def close(self) -> None:
        """Drop every lease, persist the memory blocks, close the tiers. Idempotent.

        With ``flush_on_close`` (the default) and a disk tier, every committed host or GPU block
        that has no disk copy is first written to disk and verified, as if all memory were
        evicted at once (:mod:`kvtier.daemon.store.flush`): blocks the admission filter rejects are
        not written, and the disk's capacity applies (it evicts its least valuable blocks for
        them, as demotions do). Then RocksDB's memtables are flushed and its log synced, so a
        restart after a clean shutdown loses nothing the disk tier was allowed to keep. Without
        it, memory blocks are lost at close; committed disk blocks survive either way (the
        write-ahead log holds every acknowledged write). A failed flush is logged, not raised:
        the tiers are closed all the same.
        """
        scrubber, self._scrubber = self._scrubber, None
        if scrubber is not None:
            await scrubber.stop()
        await self.remote.close()  # uploads what is queued while the host copies are still there
        async with self._mutex:
            if self._parts is None:
                return
            for lease in self._leases.pop_all():
                self._end_lease(lease)
            parts, self._parts = self._parts, None
            # Forget every block: a closed store answers lookups with misses, not stale slots.
            self.index = BlockIndex(self.index.capacity, self.config.priority_classes)
            await close_parts(parts, persist=self.config.flush_on_close)

    async def __aenter__(self) -> TieredStore:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def parts(self) -> StoreParts:
        """The open tiers, mover, reader and writer (raises InvalidRequest before start and after close)."""
        if self._parts is None:
            raise InvalidRequest("the store is not open (call start(); a closed store stays closed)")
        return self._parts

    @property
    def mover(self) -> Mover:
        return self.parts.mover

    @property
    def host(self) -> HostTier | None:
        """The shared host-memory tier (None unless open)."""
        return self._parts.host if self._parts is not None else None

    @property
    def gpu(self) -> GpuTier | None:
        """The GPU tier (None unless open with ``gpu_bytes > 0``)."""
        return self._parts.gpu if self._parts is not None else None

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (None unless open with a ``disk_path``)."""
        return self._parts.disk if self._parts is not None else None

    # --- namespaces ----------------------------------------------------------------------------

    def register_namespace(self, ns: Namespace) -> None:
        """Commits into ``ns.ns_id`` will be checked against this namespace's geometry. A new one
        is saved with the disk tier (a small metadata write), so a restart still knows it."""
        new = ns.ns_id not in self._namespaces
        if new:
            self.remote.offer_namespace(ns)  # so daemons that never saw it can serve its blocks
        self._namespaces[ns.ns_id] = ns
        disk = self.disk
        if new and disk is not None:
            try:
                disk.save_namespace(ns)
            except StorageError as e:  # known until the restart all the same: the blocks are unaffected
                log.warning("namespace %s not saved with the disk tier: %s", ns.ns_id.hex(), e)

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def namespace(self, ns_id: bytes) -> Namespace | None:
        """The registered namespace ``ns_id`` (None when unknown): one dict probe, for the
        request path, where :meth:`namespaces` would build a list per request."""
        return self._namespaces.get(ns_id)

    # --- get -----------------------------------------------------------------------------------

    def lookup(self, ns_id: bytes, hashes: Sequence[bytes]) -> LookupResult:
        """How many of ``hashes``, from the first, are stored, and the fastest tier of each. O(keys).

        Raises:
            InvalidKey, InvalidRequest: malformed keys.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        self.reclaim_expired()
        metas = self.index.lookup(keys)
        self._count_lookup(len(keys), len(metas))
        return LookupResult(len(metas), [m.fastest_tier for m in metas])

    def lookup_names(self, ns_id: bytes, hashes: Sequence[bytes], *,
                     accept_lossy: bool | None = None) -> tuple[int, list[str]]:
        """:meth:`lookup` for the wire: the hits and each one's fastest tier by its wire name
        (``"gpu"``, ``"host"``, ``"disk"``), in one pass over the index. ``accept_lossy``: False
        counts only exact copies (a lossy one ends the prefix); None: ``config.accept_lossy``.

        Raises:
            InvalidKey, InvalidRequest: malformed keys.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        self.reclaim_expired()
        if self._exact_only(accept_lossy):
            metas = self.index.lookup(keys)
            names = [TIER_WIRE_NAMES[m.fastest_tier] for m in metas[:exact_run(metas)]]  # type: ignore[index]
        else:
            names = self.index.lookup_names(keys)
        self._count_lookup(len(keys), len(names))
        return len(names), names

    async def lookup_remote(self, ns_id: bytes, hashes: Sequence[bytes], *,
                            accept_lossy: bool | None = None) -> tuple[int, list[str]]:
        """:meth:`lookup_names`, then the remote tier for the rest of the prefix (within the
        lookup budget): its run of hits is named ``"remote"``. Without a remote tier, the same.

        Raises:
            InvalidKey, InvalidRequest: malformed keys.
        """
        n, names = self.lookup_names(ns_id, hashes, accept_lossy=accept_lossy)
        if self._exact_only(accept_lossy) and n < len(hashes) and self._lossy_from(ns_id, hashes[n]):
            return n, names  # acquire would not fetch past a lossy local copy either
        if self.remote.enabled and n < len(hashes):
            keys = check.check_keys(self.config, ns_id, hashes[n:])
            more = await self.remote.lookup(keys, exact=self._exact_only(accept_lossy))
            names += ["remote"] * more
            n += more
        return n, names

    def _exact_only(self, accept_lossy: bool | None) -> bool:
        """Whether a request serves exact copies only (its ``accept_lossy``, else the config's)."""
        return not (self.config.accept_lossy if accept_lossy is None else accept_lossy)

    def _lossy_from(self, ns_id: bytes, chain_hash: bytes) -> bool:
        """Whether an exact-only prefix stops at ``chain_hash`` for lack of exact copies: the
        block is stored here (lossy, or the prefix would not end there) or its namespace's
        writers encode lossily, so the remote tier holds no exact copy either."""
        ns = self._namespaces.get(ns_id)
        return ns_id + chain_hash in self.index or (ns is not None and ns.kv_codec != "raw")

    def _count_lookup(self, num_keys: int, num_hits: int) -> None:
        c = self._counters
        c.lookups += 1
        c.lookup_keys += num_keys
        c.lookup_hits += num_hits

    async def acquire(self, ns_id: bytes, hashes: Sequence[bytes], *, lease_s: float | None = None,
                      tier: Tier = Tier.HOST, accept_lossy: bool | None = None) -> Acquired:
        """Lease the stored prefix of ``hashes``, copying blocks into host memory where needed.

        By default every block is served from a host slot (``store.host.view(block.slot)``),
        which same-host clients map: a disk-only block is promoted into host and a GPU-only
        block is copied down into host first. With ``tier=Tier.GPU``, a block with a GPU copy
        is served in place instead (``block.pool`` is GPU: read ``store.gpu.tensor(block.slot)``
        and, on CUDA, synchronise that read before :meth:`release`); the others as by default.
        Every copy made for the call is verified before it is served; a bad one is dropped and
        counted and the prefix ends there. The lease pins every memory copy of the blocks
        (host and GPU) until :meth:`release`. ``accept_lossy`` as for :meth:`lookup_names`: with
        False, a block whose stored copy is lossy is a miss.

        Raises:
            InvalidKey, InvalidRequest: malformed keys, lease length, or a tier other than HOST
                and GPU.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        ttl = check.check_lease_seconds(self.config, lease_s)
        if tier not in MEMORY_TIERS:
            raise InvalidRequest(f"acquire serves from host or GPU memory, not {tier!r}")
        exact = self._exact_only(accept_lossy)
        fetched = await self._fetch_remote(ns_id, keys) if self.remote.enabled else None
        if exact and fetched:
            fetched = {k: f for k, f in fetched.items() if f.parsed.codec == "raw"} or None
        async with self._mutex:
            reader = self.parts.reader
            self.reclaim_expired()
            return await reader.acquire(keys, ttl, tier, fetched, accept_lossy=not exact)

    async def _fetch_remote(self, ns_id: bytes, keys: list[BlockKey]) -> dict[BlockKey, Fetched] | None:
        """The verified remote records of the keys after the local prefix (fetched outside the
        mutex: the network never holds up other operations), by key; None when there are none."""
        n = len(self.index.lookup(keys))
        if n == len(keys) or self._parts is None:
            return None
        # A namespace this daemon never saw is learnt from the cluster (verified), in the same wait.
        got, learnt = await self.remote.fetch(ns_id, keys[n:], self._namespaces.get(ns_id))
        if learnt is not None and ns_id not in self._namespaces:
            self._namespaces[ns_id] = learnt
        return {f.key: f for f in got} or None

    def release(self, lease_id: int) -> bool:
        """End a lease: a get lease unpins its blocks; a put lease or a grant abandons its
        uncommitted slots.

        Returns:
            False when the lease is unknown (already released, committed or expired).
        """
        self.reclaim_expired()
        lease = self._leases.pop(lease_id)
        if lease is None:
            return False
        self._end_lease(lease)
        return True

    # --- put -----------------------------------------------------------------------------------

    async def reserve(self, ns_id: bytes, hashes: Sequence[bytes], sizes: Sequence[int], *,
                      lease_s: float | None = None, priority: int = 0, tier: Tier = Tier.HOST) -> Reservation:
        """Reserve memory slots for new blocks, evicting (and demoting) older blocks as needed.

        Keys already stored are reported ``STORED`` and not rewritten; keys another client is
        writing are ``PENDING``; once a new key gets no room even after eviction it and every
        later new key are ``FULL`` (a prefix with a gap is worth nothing to lookup).

        Args:
            tier: HOST (write into ``store.host.view(slot)``) or, with a GPU tier, GPU (write
                into ``store.gpu.tensor(slot)`` or with ``store.gpu.copy_in``; on CUDA, the
                writes must be complete, e.g. their stream synchronised, before :meth:`commit`).
                Committed GPU blocks are looked up as GPU; GPU eviction demotes them into host.

        Raises:
            InvalidKey, InvalidRequest: malformed keys, sizes, priority, tier, lease length, or a
                key twice; GPU without a GPU tier. CapacityError: a size can never fit the host
                tier (or, with write-through, the disk tier; or, for GPU slots, the GPU tier).
                Nothing is changed when any of these is raised.
        """
        cfg = self.config
        keys = check.check_keys(cfg, ns_id, hashes)
        check.check_unique(keys)
        ttl = check.check_lease_seconds(cfg, lease_s)
        check.check_priority(cfg, priority)
        if tier not in MEMORY_TIERS:
            raise InvalidRequest(f"reserve writes into host or GPU memory, not {tier!r}")
        mover = self.mover
        if tier is Tier.GPU and mover.gpu is None:
            raise InvalidRequest("reserve(tier=GPU) needs a GPU tier (StoreConfig.gpu_bytes > 0)")
        check.check_sizes(cfg, sizes, len(keys), mover.host.can_ever_fit,
                          mover.gpu.can_ever_fit if tier is Tier.GPU and mover.gpu is not None else None)
        async with self._mutex:
            self.reclaim_expired()
            return await self.parts.writer.reserve(keys, list(sizes), ttl, priority, tier)

    async def commit(self, lease_id: int, headers: Sequence[bytes | None], *, checked: bool = False) -> list[bool]:
        """Make reserved blocks visible, once their payloads are in their slots.

        Args:
            lease_id: from :meth:`reserve`.
            headers: one per key of the reservation, in its order: the encoded header of each
                RESERVED key (None abandons that slot); ignored for other keys.
            checked: the caller hashed each payload in its slot after writing it and found its
                header's checksum (the daemon's inline put does, as it copies): the host copies
                are marked checked now instead of being queued for the background scrub.

        Returns:
            Per key: True when this call made the block visible (with write-through: and on
            disk). False: not reserved by this lease, abandoned, payload failing its checksum
            (verified with ``verify_on_commit`` or write-through), or a failed disk write.

        Raises:
            LeaseError: unknown or expired lease. InvalidRequest: wrong number of headers.
            HeaderError / NamespaceError: a header that does not decode, names another key or
            size, or contradicts the registered namespace; the lease is left intact to retry.
        """
        self.reclaim_expired()
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind is not LeaseKind.PUT:
            raise LeaseError(f"no open put lease {lease_id} (expired, committed or released)")
        parsed = check.check_commit(lease.blocks, headers, self._namespaces)
        self._leases.pop(lease_id)  # from here on, expiry cannot reclaim these slots
        async with self._mutex:
            ok = await self.parts.writer.commit(lease, headers, parsed, checked=checked)
        if self._scrubber is not None and not checked:
            self._scrubber.submit(m for m, good in zip(lease.blocks, ok) if good and m is not None)
        return ok

    async def grant(self, sizes: Sequence[int], *, lease_s: float | None = None, priority: int = 0,
                    tier: Tier = Tier.HOST) -> Reservation:
        """Reserve memory slots before their keys are known (a client's pool for later saves: it
        copies into them at once and names the keys in :meth:`place`, one round trip instead of
        reserve's two). Makes room exactly as :meth:`reserve`; ``priority`` is the blocks' class.

        Returns:
            A reservation whose ``status`` is RESERVED per granted slot and FULL from the first
            size that found no room; ``lease_id`` 0 when none did. Release or expiry frees the
            slots not placed yet.

        Raises:
            InvalidRequest, CapacityError: as :meth:`reserve` (sizes, priority, tier, lease length).
        """
        cfg = self.config
        if len(sizes) > cfg.max_batch:
            raise InvalidRequest(f"{len(sizes)} slots in one grant > max_batch {cfg.max_batch}")
        ttl = check.check_lease_seconds(cfg, lease_s)
        check.check_priority(cfg, priority)
        if tier not in MEMORY_TIERS or (tier is Tier.GPU and self.mover.gpu is None):
            raise InvalidRequest(f"grant gives host slots, or GPU slots with a GPU tier, not {tier!r}")
        mover = self.mover
        check.check_sizes(cfg, sizes, len(sizes), mover.host.can_ever_fit,
                          mover.gpu.can_ever_fit if tier is Tier.GPU and mover.gpu is not None else None)
        async with self._mutex:
            self.reclaim_expired()
            return await self.parts.writer.grant(list(sizes), ttl, priority, tier)

    async def place(self, lease_id: int, ns_id: bytes, hashes: Sequence[bytes], positions: Sequence[int],
                    headers: Sequence[bytes], *, checked: bool = False) -> list[PlaceStatus]:
        """Make blocks the caller wrote into granted slots visible: ``hashes[i]``'s payload is in
        slot ``positions[i]`` of grant ``lease_id`` (an index into its ``sizes``), its encoded
        header is ``headers[i]``. Each position is used once: after this call it belongs to the
        block (or, for a key already stored or being written, it is freed); the grant ends when
        none is left. ``checked`` as in :meth:`commit`.

        Returns:
            Per key: PLACED (visible now), EXISTS (already stored or being written: not stored
            twice) or FAILED (refused by ``verify_on_commit`` or write-through).

        Raises:
            LeaseError: unknown or expired grant. InvalidKey: malformed keys. InvalidRequest:
                unequal lengths, a key or position twice, a position out of range or already
                placed. HeaderError / NamespaceError: as :meth:`commit`. Nothing changes then.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        check.check_unique(keys)
        self.reclaim_expired()
        lease = self._leases.get(lease_id)
        if lease is None or lease.kind is not LeaseKind.GRANT:
            raise LeaseError(f"no open grant {lease_id} (expired, used up or released)")
        if not len(positions) == len(headers) == len(keys):
            raise InvalidRequest(f"place: {len(keys)} keys, {len(positions)} positions, {len(headers)} headers")
        metas = check.check_positions(lease.blocks, positions)
        namespace = self._namespaces.get(ns_id)
        parsed = [check.check_header(buf, key, meta.size, namespace) for buf, key, meta in zip(headers, keys, metas)]
        blocks = lease.blocks
        for pos in positions:  # out of the grant before any await: expiry cannot free them now
            blocks[pos] = None
        if len(positions) == len(lease.held):  # each position named a held slot, once: none left
            lease.held = []
            self._leases.pop(lease_id)
        else:
            lease.held = [b for b in blocks if b is not None]
        async with self._mutex:
            done = await self.parts.writer.place(lease_id, metas, keys, headers, parsed, checked=checked)
        if self._scrubber is not None and not checked:
            self._scrubber.submit(m for m, d in zip(metas, done) if d is PlaceStatus.PLACED)
        return done

    async def drain_scrub(self) -> None:
        """Wait until every block committed so far has been checked by the scrubber (tests,
        benchmarks); returns at once when ``scrub_commits`` is off."""
        if self._scrubber is not None:
            await self._scrubber.drain()

    # --- removal, priority, recency ------------------------------------------------------------

    async def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Remove committed blocks from every tier; returns how many were found.

        A block a reader still leases disappears from lookup at once; its memory slots are freed
        when the last lease ends. Pending (uncommitted) keys are left to their reservation.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        async with self._mutex:
            self.reclaim_expired()
            metas = self.index.visible_many(keys)
            await self.mover.remove(metas)
            return len(metas)

    async def clear(self, ns_id: bytes) -> int:
        """Remove every committed block of a namespace; returns how many."""
        check.check_keys(self.config, ns_id, [])
        async with self._mutex:
            self.reclaim_expired()
            metas = [m for m in self.index.namespace(ns_id) if m.committed]
            await self.mover.remove(metas)
            return len(metas)

    def pin(self, ns_id: bytes, hashes: Sequence[bytes], priority: int = 1) -> int:
        """Move stored blocks to eviction class ``priority`` (higher: evicted later).

        Returns:
            How many of the keys were stored. The class lives in memory only: after a restart
            every block is back in class 0.
        """
        keys = check.check_keys(self.config, ns_id, hashes)
        check.check_priority(self.config, priority)
        self.reclaim_expired()
        n = 0
        for key in keys:
            meta = self.index.visible(key)
            if meta is not None:
                self.index.set_priority(meta, priority)
                n += 1
        return n

    def unpin(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Put blocks back into class 0; returns how many were stored."""
        return self.pin(ns_id, hashes, 0)

    def touch(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Mark stored blocks most recently used; returns how many were stored."""
        keys = check.check_keys(self.config, ns_id, hashes)
        self.reclaim_expired()
        now = self.now()
        n = 0
        for key in keys:
            meta = self.index.visible(key)
            if meta is not None:
                self.index.touch(meta, now)
                n += 1
        return n

    # --- leases --------------------------------------------------------------------------------

    def reclaim_expired(self) -> int:
        """End every lease whose time ran out; returns how many. Runs at the start of each call."""
        expired = self._leases.pop_expired(self.now())
        for lease in expired:
            self._counters.lease_expiries += 1
            self._end_lease(lease)
        return len(expired)

    def _end_lease(self, lease: Lease[BlockMeta]) -> None:
        if lease.kind is LeaseKind.GET:
            mover = self.mover
            if mover.zombies:  # a block removed while leased is freed with its last lease
                mover.unlease_all(lease.held)
            else:
                self.index.unlease_all(lease.held)
            return
        for meta in lease.held:
            self.index.unlease(meta)
            self.parts.writer.abandon(meta)

    # --- audit and inspection -------------------------------------------------------------------

    async def check(self, *, fix: bool = False) -> CheckReport:
        """Audit the index against the GPU, host and disk tiers (reads and verifies every block).

        Args:
            fix: repair: forget missing copies, adopt valid orphans, delete invalid ones, drop
                corrupt copies.
        """
        async with self._mutex:
            self.reclaim_expired()
            return await audit(self.mover, fix=fix, now=self.now())

    def info(self, ns_id: bytes, chain_hash: bytes) -> BlockInfo | None:
        """Inspection view of one committed block, or None."""
        (key,) = check.check_keys(self.config, ns_id, [chain_hash])
        meta = self.index.visible(key)
        return BlockInfo.of(meta) if meta is not None else None

    def iter_blocks(self, ns_id: bytes | None = None) -> Iterator[BlockInfo]:
        """Inspection views of committed blocks (of one namespace, or all), from a snapshot."""
        metas = self.index.namespace(ns_id) if ns_id is not None else list(self.index.blocks())
        return iter([BlockInfo.of(m) for m in metas if m.committed])

    # --- counters and events -------------------------------------------------------------------

    @property
    def counters(self) -> StoreCounters:
        """A snapshot of the cumulative counters since start."""
        return self._counters.copy()

    def take_counters(self) -> StoreCounters:
        """The counters' increase since the previous call (the first call: since start)."""
        now = self._counters.copy()
        delta = now.minus(self._taken)
        self._taken = now
        return delta

    def gauges(self) -> StoreGauges:
        """Current occupancy of each tier."""
        index = self.index
        tiers = {t: TierGauges(index.capacity[t], index.used[t], index.count[t]) for t in TIERS}
        frag = self.host.stats.internal_fragmentation if self.host is not None else 0.0
        return StoreGauges(tiers, len(index) - index.pending, index.pending, len(self._leases), frag)

    def take_events(self) -> list[StoreEvent]:
        """Every event since the previous call, oldest first."""
        return self._events.take()

