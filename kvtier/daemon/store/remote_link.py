"""The store's side of the remote tier (issue 23): lookups and fetches below the disk tier, uploads.

::

    lookup:   index (gpu/host/disk) ─► n hits ─► remote.exists(keys[n:], budget) ─► + the run of "remote"
    acquire:  fetch(keys[n:]) outside the mutex (one GET per key however many acquires want it)
              ─► verify_record ─► under the mutex: host slot, copy, commit ─► served as a host hit
              a bad value: counted by reason, deleted remotely, a miss
    through:  commit ─► offer(meta) pins the host copy ─► uploader task: record = header + payload
              (checksum verified) ─► remote.put ─► STORED REMOTE event, unpin
    back:     host eviction ─► offer_copies(victims): records copied before the slots are freed
    queue:    bounded in payload bytes; an upload beyond it is dropped and counted
    codec:    with a lossy RemoteOptions.codec (or a lossy codec for the block's model in
              RemoteOptions.models; K's axis: RemoteOptions.k_axis), each record built for upload
              that is raw float KV is re-encoded on the way (transfers.recode_choice and
              recode_verified, the disk demotion's: verified source, new header, same key), on
              the I/O pool; the host copy stays as it is

The remote engine is a :class:`~kvtier.daemon.remote.backend.RemoteBlocks` (never raises for a
fault: a miss, ``False``); with :class:`~kvtier.daemon.remote.backend.NoRemoteBlocks` every method
here returns at once. Everything runs on the store's event loop; record building and verification
run on the store's I/O pool.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kvtier_protocol.codec_plan import CODECS
from kvtier_protocol.header import BlockHeader, payload_checksum
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.remote.backend import NoRemoteBlocks, RemoteBlocks, RemoteKey
from kvtier.daemon.remote.verify import MissReason, verify_namespace, verify_record
from kvtier.daemon.store.config import (K_AXES, TIER_COMPRESSIONS, CodecModels, StoreConfigError, any_lossy,
                                        check_codec_models, codec_for_model)
from kvtier.daemon.store.disk_io import BufferPool
from kvtier.daemon.store.host import HostTier
from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.stats import EventKind
from kvtier.daemon.store.transfers import recode_choice, recode_verified
from kvtier.daemon.store.types import NS_ID_LEN, BlockKey, Tier

if TYPE_CHECKING:
    from kvtier.daemon.store.disk import DiskTier

R = TypeVar("R")


class Mover(Protocol):
    """What the link uses of :class:`kvtier.daemon.store.moves.Mover` (which holds the link:
    named here, not imported, so the two modules do not import each other)."""

    index: BlockIndex
    host: HostTier
    disk: DiskTier | None
    remote: RemoteLink | None

    async def run(self, fn: Any, *args: Any) -> Any: ...
    def unlease(self, meta: BlockMeta) -> None: ...
    def emit(self, kind: EventKind, tier: Tier, meta: BlockMeta) -> None: ...

log = logging.getLogger(__name__)

WRITE_MODES = ("through", "back", "read-only")
UPLOAD_BATCH_BYTES = 32 << 20
"""Payload bytes of one upload call at most (records are built for one batch at a time)."""
UPLOAD_BATCH_BLOCKS = 32
FETCH_CHUNK_BYTES = 16 << 20
"""Payload bytes one fetch call asks for (about): each chunk has the whole call timeout."""
FETCH_FIRST_KEYS = 8
"""Keys of the first chunk when the block size is not known yet (the namespace is being learnt)."""
LOOKUP_WINDOW = 32
"""Keys a lookup asks the cluster about first; each window after a full run of hits is twice as large."""
PINNED_SHARE = 4
"""Write-through pins queued blocks in host memory: at most 1/PINNED_SHARE of the host tier."""


@dataclass(frozen=True, slots=True)
class RemoteOptions:
    """How a store uses its remote tier.

    Attributes:
        tenant: the tenant part of its keys (``[a-z0-9_-]{1,32}``; ``default`` for the default store).
        write_mode: ``through``, ``back`` or ``read-only`` (see the module docstring).
        upload_queue_bytes: payload bytes queued for upload at most (0: nothing is uploaded).
        lookup_budget_s: what a lookup may wait for the cluster.
        timeout_s: deadline of one fetch or upload call (None: the backend's own).
        codec: the codec of uploaded records (issue 25): ``"raw"`` uploads every record as it is;
            a quantizing codec re-encodes the raw float KV records (see the module docstring).
        compression: ``"lz4"`` or ``"none"``: the lossless stage of re-encoded records.
        k_axis: ``"channel"`` (default) or ``"token"``: what one K scale covers in the MHA
            records re-encoded with int8/int4/int2 (as ``StoreConfig.disk_k_axis``; fp8 and MLA
            ignore it).
        models: per-model exceptions to ``codec``: ``(fnmatch pattern, codec)`` pairs (a mapping
            is taken too), the first pattern matching a block's namespace model deciding (as
            ``StoreConfig.disk_models``).
    """

    tenant: str = "default"
    write_mode: str = "through"
    upload_queue_bytes: int = 256 << 20
    lookup_budget_s: float = 0.010
    timeout_s: float | None = None
    codec: str = "raw"
    compression: str = "none"
    k_axis: str = "channel"
    models: CodecModels = ()

    def __post_init__(self) -> None:
        RemoteKey.of(self.tenant, bytes(NS_ID_LEN + 8))  # raises ValueError for a bad tenant name
        if self.codec not in CODECS:
            raise StoreConfigError(f"codec must be one of {CODECS}, got {self.codec!r}")
        if self.k_axis not in K_AXES:
            raise StoreConfigError(f"k_axis must be one of {K_AXES}, got {self.k_axis!r:.80}")
        object.__setattr__(self, "models", check_codec_models("models", self.models))
        if self.compression not in TIER_COMPRESSIONS:
            raise ValueError(f"compression must be one of {TIER_COMPRESSIONS}, got {self.compression!r}")
        if self.write_mode not in WRITE_MODES:
            raise ValueError(f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")
        if self.upload_queue_bytes < 0 or not self.lookup_budget_s > 0:
            raise ValueError("upload_queue_bytes must be >= 0 and lookup_budget_s > 0")


@dataclass(slots=True)
class LinkCounters:
    """What the store did with its remote tier (the engine's own counters are the backend's
    :class:`~kvtier.daemon.remote.backend.RemoteCounters`).

    Attributes:
        lookup_keys / lookup_hits: keys asked of the cluster by lookups, and found (consecutive).
        fetched_blocks / fetched_bytes: remote blocks verified and placed into host memory.
        bad_values: values read back that were not the block asked for, by
            :class:`~kvtier.daemon.remote.verify.MissReason` value (each deleted remotely).
        uploads_queued: blocks queued for upload; upload_drops / upload_drop_bytes: offered
            uploads dropped because the queue was full; upload_failures: uploads the cluster did
            not acknowledge (or whose host copy failed its checksum).
        uploaded: blocks the cluster acknowledged.
        recoded / recoded_saved_bytes: records re-encoded with the remote codec for upload, and
            the record bytes that saved (raw record minus re-encoded record).
        queue_bytes / queue_blocks: what waits for upload now (gauges).
        namespaces_fetched / namespaces_uploaded: namespaces learnt from / stored in the cluster.
    """

    lookup_keys: int = 0
    lookup_hits: int = 0
    fetched_blocks: int = 0
    fetched_bytes: int = 0
    bad_values: dict[str, int] = field(default_factory=dict)
    uploads_queued: int = 0
    upload_drops: int = 0
    upload_drop_bytes: int = 0
    upload_failures: int = 0
    uploaded: int = 0
    recoded: int = 0
    recoded_saved_bytes: int = 0
    queue_bytes: int = 0
    queue_blocks: int = 0
    namespaces_fetched: int = 0
    namespaces_uploaded: int = 0


@dataclass(frozen=True, slots=True)
class Fetched:
    """A remote record that verified as the block asked for: its header bytes and payload."""

    key: BlockKey
    header: bytes
    parsed: BlockHeader
    payload: memoryview


@dataclass(slots=True)
class _Upload:
    """One queued upload: a pinned block (write-through) or a record copied already (write-back)."""

    key: RemoteKey
    size: int
    meta: BlockMeta | None = None  # leased until its record is built
    record: bytes | None = None


class RemoteLink:
    """One store's remote tier. :meth:`attach` it to the store's mover before use; :meth:`close`
    uploads what is queued (bounded by the call timeout) and closes the backend.

    Args:
        blocks: the engine (:class:`NoRemoteBlocks`: no remote tier).
        options: tenant, write mode, queue bound, lookup budget.
    """

    def __init__(self, blocks: RemoteBlocks | None = None, options: RemoteOptions | None = None) -> None:
        self.blocks: RemoteBlocks = blocks if blocks is not None else NoRemoteBlocks()
        self.options = options if options is not None else RemoteOptions()
        self.enabled = not isinstance(self.blocks, NoRemoteBlocks)
        self.counters = LinkCounters()
        self._mover: Mover | None = None
        self._queue: collections.deque[_Upload] = collections.deque()
        self._namespaces: collections.deque[Namespace] = collections.deque()
        self._wake = asyncio.Event()
        self._uploader: asyncio.Task[None] | None = None
        self._inflight: dict[BlockKey, asyncio.Future[bytes | bytearray | None]] = {}
        self._tasks: set[asyncio.Future[None]] = set()  # remote deletes of bad values, offer_missing
        self._limit = self.options.upload_queue_bytes
        self._idle = asyncio.Event()  # set while nothing waits for upload
        self._idle.set()
        self._closing = False
        self._known: dict[bytes, Namespace] = {}  # namespaces offered or learnt: MLA rope dims for re-encoding
        self._recode_pool = BufferPool(keep_bytes=UPLOAD_BATCH_BYTES) if self.recodes else None

    @property
    def recodes(self) -> bool:
        """Whether uploads may re-encode raw records (a lossy :attr:`RemoteOptions.codec`, or a
        lossy codec in :attr:`RemoteOptions.models`)."""
        return any_lossy(self.options.codec, self.options.models)

    def lossy_for(self, ns_id: bytes) -> bool:
        """Whether this store uploads the raw records of namespace ``ns_id`` re-encoded: the
        tier's codec for the namespace's model (known here, saved with the disk tier, else
        unknown: :attr:`RemoteOptions.codec`) is lossy."""
        o = self.options
        if not o.models:
            return o.codec != "raw"
        ns = self._namespace_of(ns_id)
        return codec_for_model(o.models, o.codec, ns.model if ns is not None else None) != "raw"

    def _namespace_of(self, ns_id: bytes) -> Namespace | None:
        """The namespace ``ns_id`` as this store knows it (offered, learnt, or saved with the disk tier)."""
        ns = self._known.get(ns_id)
        disk = self._mover.disk if self._mover is not None else None
        if ns is None and disk is not None:
            ns = disk.namespace(ns_id)
        return ns

    @property
    def uploads(self) -> bool:
        """Whether this store uploads at all (write mode, queue size)."""
        return self.enabled and self.options.write_mode != "read-only" and self._limit > 0

    @property
    def write_through(self) -> bool:
        return self.uploads and self.options.write_mode == "through"

    @property
    def write_back(self) -> bool:
        return self.uploads and self.options.write_mode == "back"

    def key(self, key: BlockKey) -> RemoteKey:
        """The remote key of a store key."""
        return RemoteKey.of(self.options.tenant, key)

    # --- lifecycle -----------------------------------------------------------------------------

    def attach(self, mover: Mover) -> None:
        """Bind to the store's open parts and start the uploader (on the running loop)."""
        self._mover = mover
        if self.enabled:  # else the mover's hot paths see None and skip the link
            mover.remote = self
            self.blocks.prepare()  # the first lookup's small budget must not pay the discovery
        if self.write_through:  # pinned blocks must leave most of the host tier to the clients
            self._limit = min(self._limit, max(1, mover.index.capacity[Tier.HOST] // PINNED_SHARE))
        if self.uploads:
            if self.recodes:
                _load_codecs()
            self._uploader = asyncio.create_task(self._upload_loop(), name="kvtier-remote-uploader")

    async def close(self) -> None:
        """Upload what is queued (each call bounded by the timeout; a dead cluster is skipped by
        the breaker), unpin what is left, close the engine. Idempotent."""
        self._closing = True
        self._wake.set()
        uploader, self._uploader = self._uploader, None
        if uploader is not None:
            try:
                await uploader
            except Exception:  # the loop catches its own faults; this is a bug, but close must finish
                log.exception("kvtier remote uploader failed")
        self._drop_queue()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for fut in self._inflight.values():
            if not fut.done():
                fut.set_result(None)
        await self.blocks.close()

    # --- lookup and fetch ----------------------------------------------------------------------

    async def lookup(self, keys: Sequence[BlockKey], *, exact: bool = False) -> int:
        """How many of ``keys``, from the first, the cluster holds (within the lookup budget).

        ``exact``: the request takes exact copies only. With a lossy codec for the keys'
        namespace (:meth:`lossy_for`) this daemon uploads its records re-encoded, and every daemon
        of a cluster is meant to have the same codec policy, so the cluster's copies count as
        lossy (EXISTS cannot tell): none is counted. (Acquire judges each fetched record by its
        header all the same.)
        """
        if not self.enabled or not keys or (exact and self.recodes and self.lossy_for(keys[0][:NS_ID_LEN])):
            return 0
        # Windows that double while every key is there: a long prompt whose prefix ends early
        # costs one small batch, not thousands of EXISTS; all windows share the one budget.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.options.lookup_budget_s
        n, window = 0, LOOKUP_WINDOW
        while n < len(keys):
            left = deadline - loop.time()
            if left <= 0:
                break
            ask = keys[n:n + window]
            found = await self.blocks.exists([self.key(k) for k in ask], timeout_s=left)
            self.counters.lookup_keys += len(ask)
            run = 0
            while run < len(found) and found[run]:
                run += 1
            n += run
            if run < len(ask):
                break
            window *= 2
        self.counters.lookup_hits += n
        return n

    async def fetch(self, ns_id: bytes, keys: Sequence[BlockKey],
                    namespace: Namespace | None) -> tuple[list[Fetched], Namespace | None]:
        """The verified records of the run of ``keys`` the cluster holds, from the first; and, when
        ``namespace`` (of ``ns_id``) is None, the namespace learnt from the cluster (verified)
        with the same wait, or None.

        Keys are fetched in chunks of about :data:`FETCH_CHUNK_BYTES`, each one call under the
        call timeout, until one comes back short: a long prefix from a slow cluster is not lost
        to one deadline, and a dead cluster costs one timeout. While a whole chunk is verified
        (on the I/O pool), the next one is on the network already; it is dropped if the chunk
        turns out bad. A key another caller is fetching already is not asked again: both wait
        for the one GET. A value that is not the block asked for ends the run: it is counted and
        deleted remotely.
        """
        if not self.enabled or not keys:
            return [], None
        learn = asyncio.ensure_future(self.namespace(ns_id)) if namespace is None else None
        out: list[Fetched] = []
        block_bytes = namespace.block_payload_bytes() if namespace is not None else 0
        step = max(1, FETCH_CHUNK_BYTES // block_bytes) if block_bytes else FETCH_FIRST_KEYS
        chunk = keys[:step]
        ahead: asyncio.Future[list[bytes | bytearray | None]] = asyncio.ensure_future(self._get_once(chunk))
        try:
            i = 0
            while True:
                values = await ahead
                if learn is not None and namespace is None:
                    namespace = await learn  # known before the first records are judged
                run = []
                for key, value in zip(chunk, values):
                    if value is None:
                        break
                    run.append((key, value))
                whole, i = len(run) == len(chunk), i + len(chunk)
                if whole and i < len(keys):
                    if not block_bytes and namespace is not None:
                        block_bytes = namespace.block_payload_bytes()
                        step = max(1, FETCH_CHUNK_BYTES // block_bytes)
                    # The next chunk's GETs overlap this one's verification.
                    ahead = asyncio.ensure_future(self._get_once(keys[i:i + step]))
                got = await self._judge(run, namespace)
                out += got
                if len(got) < len(chunk) or i >= len(keys):
                    break
                chunk = keys[i:i + step]
        finally:
            if not ahead.done():  # a chunk fetched ahead of a bad one, or our caller gave up
                ahead.cancel()
                ahead.add_done_callback(_retrieved)
            if learn is not None and not learn.done():
                learn.cancel()
        learnt = learn.result() if learn is not None and learn.done() and not learn.cancelled() else None
        return out, learnt

    async def _get_once(self, keys: Sequence[BlockKey]) -> list[bytes | bytearray | None]:
        """``get`` of ``keys``, sharing the GET of any key another caller is fetching now."""
        mine: list[BlockKey] = []
        futures: list[asyncio.Future[bytes | bytearray | None]] = []
        loop = asyncio.get_running_loop()
        for key in keys:
            fut = self._inflight.get(key)
            if fut is None:
                fut = self._inflight[key] = loop.create_future()
                mine.append(key)
            futures.append(fut)
        if mine:
            try:
                values = await self.blocks.get([self.key(k) for k in mine], timeout_s=self.options.timeout_s)
            except BaseException:
                for key in mine:
                    fut = self._inflight.pop(key, None)
                    if fut is not None and not fut.done():
                        fut.set_result(None)
                raise
            for key, value in zip(mine, values):
                fut = self._inflight.pop(key)
                if not fut.done():
                    fut.set_result(value)
        return [await fut for fut in futures]

    async def _judge(self, run: list[tuple[BlockKey, bytes | bytearray]], namespace: Namespace | None) -> list[Fetched]:
        """The verified prefix of ``run`` (on the I/O pool); the first bad value is counted and deleted."""
        if not run:
            return []
        assert self._mover is not None, "attach() before fetch()"
        verdicts = await self._mover.run(_verify_all, [self.key(k) for k, _ in run], [v for _, v in run], namespace)
        out: list[Fetched] = []
        for (key, _), verdict in zip(run, verdicts):
            if isinstance(verdict, MissReason):
                self._bad(key, verdict)
                break
            out.append(verdict)
        return out

    async def namespace(self, ns_id: bytes) -> Namespace | None:
        """A namespace this store never saw, from the cluster (verified), or None."""
        if not self.enabled:
            return None
        raw = await self.blocks.get_namespace(self.options.tenant, ns_id, timeout_s=self.options.timeout_s)
        ns = verify_namespace(ns_id, raw) if raw is not None else None
        if ns is not None:
            self.counters.namespaces_fetched += 1
            self._known.setdefault(ns_id, ns)
        return ns

    def _bad(self, key: BlockKey, reason: MissReason) -> None:
        c = self.counters.bad_values
        c[reason.value] = c.get(reason.value, 0) + 1
        log.warning("remote tier: the value under block %s is not that block (%s): a miss; deleted",
                    key[NS_ID_LEN:].hex()[:16], reason.value)
        task = asyncio.ensure_future(self.blocks.delete([self.key(key)], timeout_s=self.options.timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- uploads -------------------------------------------------------------------------------

    def offer(self, meta: BlockMeta) -> None:
        """Write-through: queue a committed block with a host copy for upload, pinning the copy
        until its record is built; dropped (counted) when the queue is full."""
        if not self.write_through or meta.remote or meta.host_slot is None or self._closing:
            return
        if not self._admit(meta.size):
            return
        assert self._mover is not None, "attach() before offer()"
        self._mover.index.lease(meta)
        self._push(_Upload(self.key(meta.key), meta.size, meta=meta))

    def offer_missing(self, metas: Sequence[BlockMeta], *, wait_for_room: bool = False) -> None:
        """Write-through: blocks visible in host again without a commit (promoted from disk,
        adopted after a crash) are queued for upload where the cluster does not hold them.

        In the background: batches of the committed host blocks not known to be remote are
        pinned, asked for (EXISTS, under the call timeout) and queued where missing; the ones
        the cluster holds are marked remote. The queue's byte cap applies: what does not fit is
        dropped and counted, as for commits; ``wait_for_room`` (a whole recovered host tier)
        first waits for the queue to drain before each batch, so that a large tier goes up
        batch by batch behind the commits instead of being dropped. Never waits itself.
        """
        if not self.write_through or self._closing:
            return
        todo = [m for m in metas if _missing_candidate(m)]
        if not todo:
            return
        task = asyncio.ensure_future(self._offer_missing(todo, wait_for_room))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _offer_missing(self, metas: list[BlockMeta], wait_for_room: bool) -> None:
        mover = self._mover
        assert mover is not None, "attach() before offer_missing()"
        c = self.counters
        todo = collections.deque(metas)
        while todo:
            if wait_for_room:
                await self._idle.wait()  # the queue drained: room for the next batch
            if self._closing:
                return
            batch: list[BlockMeta] = []
            while todo and len(batch) < UPLOAD_BATCH_BLOCKS:
                meta = todo[0]
                if wait_for_room and batch and c.queue_bytes + meta.size > self._limit:
                    break  # after this batch is up
                todo.popleft()
                if _missing_candidate(meta) and self._admit(meta.size):
                    batch.append(meta)
            if not batch:
                continue
            for meta in batch:
                mover.index.lease(meta)  # the host copy stays while the cluster is asked
            there: list[bool] | None = None  # None: the question failed (cancelled), nothing queued
            try:
                there = await self.blocks.exists([self.key(m.key) for m in batch], timeout_s=self.options.timeout_s)
            finally:
                for k, meta in enumerate(batch):
                    has = there is not None and there[k]
                    if there is None or has or self._closing or not _missing_candidate(meta):
                        if has and meta.linked:
                            meta.remote = True  # another host (or an earlier life) uploaded it
                        mover.unlease(meta)
                        c.queue_bytes -= meta.size
                    else:
                        self._push(_Upload(self.key(meta.key), meta.size, meta=meta))

    async def offer_copies(self, metas: Sequence[BlockMeta]) -> None:
        """Write-back: copy the records of host victims about to be freed and queue them
        (verified against their checksums; dropped, counted, when the queue is full)."""
        if not self.write_back or self._closing:
            return
        todo = [m for m in metas if m.committed and not m.remote and m.host_slot is not None]
        todo = [m for m in todo if self._admit(m.size)]
        if not todo:
            return
        mover = self._mover
        assert mover is not None, "attach() before offer_copies()"
        records = await self._build([m.header for m in todo], [mover.host.view(m.host_slot) for m in todo],
                                    [m.checksum for m in todo])
        for meta, record in zip(todo, records):
            if record is None:
                self.counters.upload_failures += 1
                self.counters.queue_bytes -= meta.size
                continue
            self._push(_Upload(self.key(meta.key), meta.size, record=record))

    def offer_namespace(self, ns: Namespace) -> None:
        """Queue a namespace's canonical bytes for upload (so daemons that never saw it serve it)."""
        self._known[ns.ns_id] = ns
        if self.uploads and not self._closing:
            self._namespaces.append(ns)
            self._wake.set()

    def _admit(self, size: int) -> bool:
        c = self.counters
        if c.queue_bytes + size > self._limit:
            c.upload_drops += 1
            c.upload_drop_bytes += size
            return False
        c.queue_bytes += size  # reserved now: offer_copies awaits before pushing
        return True

    def _push(self, item: _Upload) -> None:
        self._queue.append(item)
        self.counters.uploads_queued += 1
        self.counters.queue_blocks += 1
        self._idle.clear()
        self._wake.set()

    async def _upload_loop(self) -> None:
        while True:
            if not self._queue and not self._namespaces:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                await self._upload_namespaces()
                await self._upload_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one bad batch stop uploads for the daemon's life
                log.exception("kvtier remote upload batch failed")

    async def _upload_namespaces(self) -> None:
        while self._namespaces:
            ns = self._namespaces.popleft()
            if await self.blocks.put_namespace(self.options.tenant, ns.ns_id, ns.canonical_bytes(),
                                               timeout_s=self.options.timeout_s):
                self.counters.namespaces_uploaded += 1

    async def _upload_batch(self) -> None:
        batch: list[_Upload] = []
        nbytes = 0
        while self._queue and len(batch) < UPLOAD_BATCH_BLOCKS and (not batch or nbytes < UPLOAD_BATCH_BYTES):
            item = self._queue.popleft()
            batch.append(item)
            nbytes += item.size
        if not batch:
            return
        mover = self._mover
        assert mover is not None
        c = self.counters
        try:
            pinned = [u for u in batch if u.meta is not None]
            if pinned:
                # Built on the pool from the pinned host copies, then unpinned at once: the
                # network wait below holds no host memory but these records.
                live = [u for u in pinned if u.meta is not None and u.meta.linked and u.meta.host_slot is not None]
                records = await self._build([u.meta.header for u in live],  # type: ignore[union-attr]
                                            [mover.host.view(u.meta.host_slot) for u in live],  # type: ignore[union-attr,arg-type]
                                            [u.meta.checksum for u in live])  # type: ignore[union-attr]
                for u, record in zip(live, records):
                    u.record = record
        finally:
            for u in batch:
                if u.meta is not None:
                    mover.unlease(u.meta)
        ready = [u for u in batch if u.record is not None]
        c.upload_failures += len(batch) - len(ready)
        if ready:
            ok = await self.blocks.put([(u.key, u.record) for u in ready],  # type: ignore[misc]
                                       timeout_s=self.options.timeout_s)
            for u, good in zip(ready, ok):
                if not good:
                    c.upload_failures += 1
                    continue
                c.uploaded += 1
                meta = u.meta
                if meta is not None and meta.linked:
                    meta.remote = True
                    mover.emit(EventKind.STORED, Tier.REMOTE, meta)
        c.queue_bytes -= nbytes
        c.queue_blocks -= len(batch)
        if not self._queue:
            self._idle.set()

    def _drop_queue(self) -> None:
        """Unpin and forget what was not uploaded (at close)."""
        mover = self._mover
        while self._queue:
            item = self._queue.popleft()
            if item.meta is not None and mover is not None:
                mover.unlease(item.meta)
            self.counters.queue_bytes -= item.size
            self.counters.queue_blocks -= 1
        self._namespaces.clear()
        self._idle.set()

    async def drain(self) -> None:
        """Wait until nothing waits for upload (tests, benchmarks)."""
        await self._idle.wait()

    # --- precision by tier ---------------------------------------------------------------------

    async def _build(self, headers: list[bytes], views: list[memoryview], checksums: list[int]) -> list[bytes | None]:
        """The records to upload for host blocks (on the I/O pool), None where a host copy fails
        its checksum: each as it is, or, with a lossy codec, re-encoded where :meth:`_recode_how`
        says the tier's codec takes it."""
        mover = self._mover
        assert mover is not None, "attach() before uploads"
        if not self.recodes:
            return await mover.run(_records, headers, views, checksums)
        assert self._recode_pool is not None
        hows = [self._recode_how(h) for h in headers]
        compression = None if self.options.compression == "none" else self.options.compression
        try:
            records, saved = await mover.run(_recoded_records, headers, views, checksums, hows, self.options.k_axis,
                                             compression, self._recode_pool)
        except Exception:  # never expected (the codec refuses data with KVTierError): upload as they are
            log.exception("kvtier remote: re-encoding an upload batch failed; its records go up as they are")
            return await mover.run(_records, headers, views, checksums)
        self.counters.recoded += len(saved)
        self.counters.recoded_saved_bytes += sum(saved)
        return records

    def _recode_how(self, header: bytes) -> tuple[int, str] | None:
        """How the record of ``header`` goes up (:func:`~kvtier.daemon.store.transfers.recode_choice`,
        the disk demotion's rule): ``(rope dims kept raw, codec)`` when the tier's codec for its
        namespace's model re-encodes it, None when it goes up as it is."""
        return recode_choice(header, self._namespace_of, self.options.codec, self.options.models)


def _records(headers: Sequence[bytes], payloads: Sequence[memoryview], checksums: Sequence[int]) -> list[bytes | None]:
    """Each block's whole record (header + payload), or None where the payload fails its checksum
    (a bad host copy is never uploaded). Runs on the I/O pool."""
    out: list[bytes | None] = []
    for header, payload, checksum in zip(headers, payloads, checksums):
        out.append(b"".join((header, payload)) if payload_checksum(payload) == checksum else None)
    return out


def _recoded_records(headers: Sequence[bytes], views: Sequence[memoryview], checksums: Sequence[int],
                     hows: Sequence[tuple[int, str] | None], k_axis: str, compression: str | None,
                     pool: BufferPool) -> tuple[list[bytes | None], list[int]]:
    """:func:`_records`, with the blocks whose ``hows`` entry (rope dims, codec) is not None re-encoded by
    :func:`~kvtier.daemon.store.transfers.recode_verified` (the disk demotion's: the host copy
    verified first, the new payload checked against the new header; a block the codec refuses
    keeps its record). Also the bytes each re-encoded record saved. Runs on the I/O pool."""
    todo = [(i, how) for i, how in enumerate(hows) if how is not None]
    plain = [i for i, how in enumerate(hows) if how is None]
    out: list[bytes | None] = [None] * len(headers)
    for i, record in zip(plain, _records([headers[i] for i in plain], [views[i] for i in plain],
                                         [checksums[i] for i in plain])):
        out[i] = record
    saved: list[int] = []
    got = recode_verified([(headers[i], views[i], checksums[i], rope, codec) for i, (rope, codec) in todo],
                          k_axis, compression, pool) if todo else []
    for (i, _), rec in zip(todo, got):
        if rec is None:  # the host copy failed its checksum: never uploaded
            out[i] = None
            continue
        try:
            out[i] = b"".join((rec.header, rec.payload))
        finally:
            pool.give_back(rec.payload)
        if rec.lossy:
            saved.append(len(headers[i]) + views[i].nbytes - len(out[i]))  # type: ignore[arg-type]
    return out, saved


def _load_codecs() -> None:
    """Import torch and the codecs now, at start, not inside the first upload batch (an import
    of seconds, mostly holding the GIL, would stall the loop); one intra-op thread, as the disk
    codec sets it (:class:`kvtier.daemon.store.moves.Mover`: the I/O pool is the parallelism)."""
    import torch  # noqa: PLC0415  (only a lossy remote codec loads it here)

    import kvtier_protocol.block  # noqa: F401, PLC0415
    torch.set_num_threads(1)


def _verify_all(keys: Sequence[RemoteKey], values: Sequence[bytes | bytearray],
                namespace: Namespace | None) -> list[Fetched | MissReason]:
    """Judge fetched values (on the I/O pool), stopping at the first bad one."""
    out: list[Fetched | MissReason] = []
    for key, value in zip(keys, values):
        verdict = verify_record(key, value, namespace=namespace)
        if not verdict.ok:
            assert verdict.reason is not None
            out.append(verdict.reason)
            break
        assert verdict.header is not None and verdict.payload is not None
        header_len = len(value) - verdict.header.payload_len
        out.append(Fetched(BlockKey(key.ns_id + key.chain_hash), bytes(value[:header_len]), verdict.header,
                           verdict.payload))
    return out


def _retrieved(task: asyncio.Future[Any]) -> None:
    """Mark a dropped task's outcome as seen (a failure of work nobody waits for is not news)."""
    if not task.cancelled():
        task.exception()


def _missing_candidate(meta: BlockMeta) -> bool:
    """A committed block with a host copy, not known to be on the remote tier."""
    return meta.linked and meta.committed and not meta.remote and meta.host_slot is not None
