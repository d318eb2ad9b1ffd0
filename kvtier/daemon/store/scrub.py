"""Checking freshly committed host copies once, in the background, so that readers need not.

A client writes a payload into its reserved host slot and commits the header it computed over the
same bytes. Every later reader hashing that payload again would halve load bandwidth (a verified
load is a copy plus an xxh3 pass; see ``kvtier bench dataplane``), so the store checks each such
copy once, soon after its commit, on the I/O pool and off the request path::

    commit ─► queue ─► a pause in commits (or 1 s) ─► xxh3 of a batch of slots (one I/O pool call)
                                                       per block: same copy still, not in a move?
                                                       ├─ match:    mark host_checked ("checked")
                                                       └─ mismatch: re-checked under the mutex,
                                                                    count a checksum failure, delete

The queued blocks are taken in batches (:data:`BATCH_BYTES`), one hand-off to the I/O pool
per batch: a hand-off per block cost more CPU than hashing a 64 KiB block (a thread wake-up and
a future each, and the GIL passed back and forth). Each block is judged on its own afterwards.
A batch taken in a pause stops at the next block when a commit comes (the rest go back to the
front of the queue, for the next pause); one taken because its blocks waited ``MAX_DELAY_S``
holds only those, and finishes.

A committed slot is never written again until it is freed (and freeing resets the mark), so one
check holds for the life of the copy. Until it is checked, a block is served unchecked and the
reader verifies it itself; a full queue only means more of that, never a wrong hit. Copies made
by the store (promotions from disk, GPU → host) are verified as they are made and marked then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Iterable, Sequence

import xxhash

from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.stats import StoreCounters
from kvtier.daemon.store.types import Slot

log = logging.getLogger("kvtier.daemon.store")

QUEUE_BLOCKS = 65536
"""Committed blocks waiting to be checked; beyond this, readers check the overflow themselves."""
HASH_CHUNK = 1 << 20
"""Bytes hashed per call: the hash holds the GIL, so chunks let the event loop run in between."""
IDLE_S = 0.02
"""The scrub waits for a pause this long in commits: a burst of saves keeps the memory bandwidth
and the daemon's GIL (a scrub running beside a save stream cut its throughput by ~15 %)."""
BATCH_BYTES = 16 << 20
"""Payload bytes hashed per hand-off to the I/O pool (at least one block): one wake-up for 256
blocks of 64 KiB (a hand-off costs more than hashing one), while a batch keeps one pool thread
for only a millisecond or two (disk moves share the pool) and bounds the wait of
:meth:`CommitScrubber.stop` and of a corrupt block's drop."""
MAX_DELAY_S = 1.0
"""...but never longer than this after a block's commit, so a daemon that is never idle still
checks what it stores (until then, readers verify those blocks themselves)."""


class CommitScrubber:
    """Checks committed, unchecked host copies against their header checksum.

    Args:
        index: the store's index (marks and eligibility).
        mover: the store's mover (I/O pool, host views, lease drop, removal).
        counters: where checksum failures are counted.
        mutex: the store's mutex, held only to remove a corrupt block.
    """

    def __init__(self, index: BlockIndex, mover: Mover, counters: StoreCounters, mutex: asyncio.Lock) -> None:
        self.index = index
        self.mover = mover
        self.counters = counters
        self.mutex = mutex
        # A deque and two events rather than an asyncio.Queue: submit runs per commit, inside its
        # round trip, and Queue.put_nowait cost ~3 us a block (its waiter bookkeeping); this is
        # one append per block and one wake-up per commit.
        self._queue: deque[tuple[BlockMeta, float]] = deque()
        self._work = asyncio.Event()  # set: blocks are queued
        self._idle = asyncio.Event()  # set: nothing queued and nothing being checked
        self._idle.set()
        self._last_submit = 0.0  # loop time of the latest commit handed in
        self._task: asyncio.Task[None] | None = None
        self._hashing: asyncio.Future[list[int | None]] | None = None  # the batch hashing on the I/O pool
        # Read by the hashing thread between blocks: [stop() was called, a commit came].
        self._flags = [False, False]
        self.checked = 0  # copies found good
        self.dropped = 0  # copies found bad (and their blocks deleted)

    def start(self) -> None:
        """Start the background task (on the running loop)."""
        assert self._task is None, "a scrubber starts once"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvtier-scrub")

    async def stop(self) -> None:
        """Cancel the task and wait for a batch being hashed (it reads host slots, which the store
        unmaps next; it stops at the next block); blocks not checked stay unchecked (readers
        verify them)."""
        self._flags[0] = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        hashing, self._hashing = self._hashing, None
        if hashing is not None:
            with contextlib.suppress(Exception):
                await hashing

    def submit(self, metas: Iterable[BlockMeta]) -> None:
        """Queue newly committed blocks; what does not fit is left to the readers."""
        now = self._last_submit = asyncio.get_running_loop().time()
        self._flags[1] = True  # a batch hashed in a pause yields to this commit
        queue = self._queue
        before = len(queue)
        for meta in metas:
            if len(queue) >= QUEUE_BLOCKS:
                break
            if _eligible(meta):
                queue.append((meta, now))
        if len(queue) > before:
            self._idle.clear()
            self._work.set()

    async def drain(self) -> None:
        """Wait until every queued block has been checked (tests, benchmarks)."""
        await self._idle.wait()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        while True:
            if not queue:
                self._idle.set()
                self._work.clear()
                await self._work.wait()
                continue
            queued_at = queue[0][1]  # the oldest block waiting
            while (wait := min(IDLE_S - (loop.time() - self._last_submit),
                               MAX_DELAY_S - (loop.time() - queued_at))) > 0:
                await asyncio.sleep(wait)  # commits are still coming: let them have the machine
            now = loop.time()
            in_pause = now - self._last_submit >= IDLE_S
            # In a pause: whatever is queued, yielding to the next commit. Else only the blocks
            # that waited MAX_DELAY_S, to the end.
            batch = self._take_batch(None if in_pause else now - MAX_DELAY_S)
            if not batch:
                continue
            try:
                await self._check(batch, yielding=in_pause)
            except Exception:  # a scrub failure must not end the scrubber; the blocks stay unchecked
                log.exception("scrubbing %d blocks failed", len(batch))

    def _take_batch(self, queued_by: float | None) -> list[tuple[BlockMeta, Slot, float]]:
        """The next queued blocks still to be checked (only those queued by ``queued_by``, if
        given), with their host slots and queue times, up to :data:`BATCH_BYTES` of payload."""
        queue = self._queue
        batch: list[tuple[BlockMeta, Slot, float]] = []
        nbytes = 0
        while queue and nbytes < BATCH_BYTES and (queued_by is None or queue[0][1] <= queued_by):
            meta, queued_at = queue.popleft()
            if _eligible(meta):  # else deleted, evicted, in a move or already checked since queued
                batch.append((meta, meta.host_slot, queued_at))  # type: ignore[arg-type]  # eligible: a slot
                nbytes += meta.size
        return batch

    async def _check(self, batch: list[tuple[BlockMeta, Slot, float]], *, yielding: bool) -> None:
        # No pin: a scrub must never keep eviction from making room. If a copy is freed (and
        # its slot perhaps rewritten) while it is hashed, its digest means nothing and is
        # ignored: a freed copy loses its slot, and a new copy of the block is a verified one.
        view = self.mover.host.view
        self._flags[1] = False
        hashing = asyncio.ensure_future(self.mover.run(_digests, [view(slot) for _, slot, _ in batch],
                                                       self._flags, yielding))
        self._hashing = hashing
        digests = await asyncio.shield(hashing)  # a cancelled scrub still lets stop() await the thread
        self._hashing = None
        mark = self.index.mark_host_checked
        bad: list[tuple[BlockMeta, Slot]] = []
        later: list[tuple[BlockMeta, float]] = []
        for (meta, slot, queued_at), digest in zip(batch, digests):
            if digest is None:  # not hashed: the scrub stops, or yielded to a commit
                later.append((meta, queued_at))
                continue
            # Judged only if it is still the copy that was hashed and in no move (see _eligible).
            if not _eligible(meta) or meta.host_slot != slot:
                continue
            if digest == meta.checksum:
                mark(meta)
                self.checked += 1
            else:
                bad.append((meta, slot))
        if later and not self._flags[0]:
            self._queue.extendleft(reversed(later))  # first again, for the next pause
        if not bad:
            return
        async with self.mutex:
            # Nothing moves a block while the mutex is held: is each still the copy that was hashed?
            drop = [meta for meta, slot in bad
                    if _eligible(meta) and meta.host_slot == slot and self.index.get(meta.key) is meta]
            for meta in drop:
                self.counters.checksum_failures += 1
                self.dropped += 1
                log.warning("block %s: host payload does not match its checksum; deleted", meta.chain_hash.hex())
            if drop:
                await self.mover.remove(drop)


def _eligible(meta: BlockMeta) -> bool:
    # A block in a move is not read: its host copy may be one a promotion (or a copy down from
    # GPU) is still filling, and every move verifies the copy it makes (or frees the copy it
    # takes away). A block evicted after it was queued and promoted back is such a copy.
    return (meta.linked and meta.committed and meta.host_slot is not None and not meta.host_checked
            and not meta.moving)


def _digests(views: Sequence[memoryview], flags: list[bool], yielding: bool) -> list[int | None]:
    """The xxh3 of each view (on the I/O pool), in order; None for each one left unhashed once
    ``flags[0]`` is set (:meth:`CommitScrubber.stop`: the store unmaps the slots next) or, when
    ``yielding``, ``flags[1]`` (a commit came: it has the machine)."""
    out: list[int | None] = []
    intdigest = xxhash.xxh3_64_intdigest
    for view in views:
        if flags[0] or (yielding and flags[1]):
            out.append(None)
            continue
        n = view.nbytes
        if n <= HASH_CHUNK:
            out.append(intdigest(view))
            continue
        digest = xxhash.xxh3_64()
        for off in range(0, n, HASH_CHUNK):
            digest.update(view[off:off + HASH_CHUNK])
        out.append(digest.intdigest())
    return out
