"""Checking freshly committed host copies once, in the background, so that readers need not.

A client writes a payload into its reserved host slot and commits the header it computed over the
same bytes. Every later reader hashing that payload again would halve load bandwidth (a verified
load is a copy plus an xxh3 pass; see ``kvtier bench dataplane``), so the store checks each such
copy once, soon after its commit, on the I/O pool and off the request path::

    commit ─► queue ─► a pause in commits (or 1 s) ─► xxh3 of the slot (I/O pool); same copy still?
                                                       ├─ match:    mark host_checked ("checked")
                                                       └─ mismatch: count a checksum failure, delete

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
from collections.abc import Iterable

import xxhash

from kvtier.daemon.store.index import BlockIndex, BlockMeta
from kvtier.daemon.store.moves import Mover
from kvtier.daemon.store.stats import StoreCounters

log = logging.getLogger("kvtier.daemon.store")

QUEUE_BLOCKS = 65536
"""Committed blocks waiting to be checked; beyond this, readers check the overflow themselves."""
HASH_CHUNK = 1 << 20
"""Bytes hashed per call: the hash holds the GIL, so chunks let the event loop run in between."""
IDLE_S = 0.02
"""The scrub waits for a pause this long in commits: a burst of saves keeps the memory bandwidth
and the daemon's GIL (a scrub running beside a save stream cut its throughput by ~15 %)."""
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
        self._hashing: asyncio.Future[int] | None = None  # the hash running on the I/O pool
        self.checked = 0  # copies found good
        self.dropped = 0  # copies found bad (and their blocks deleted)

    def start(self) -> None:
        """Start the background task (on the running loop)."""
        assert self._task is None, "a scrubber starts once"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvtier-scrub")

    async def stop(self) -> None:
        """Cancel the task and wait for a hash in flight (it reads a host slot, which the store
        unmaps next); blocks still queued stay unchecked (readers verify them)."""
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
            meta, queued_at = queue.popleft()
            try:
                while (wait := min(IDLE_S - (loop.time() - self._last_submit),
                                   MAX_DELAY_S - (loop.time() - queued_at))) > 0:
                    await asyncio.sleep(wait)  # commits are still coming: let them have the machine
                await self._check(meta)
            except Exception:  # a scrub failure must not end the scrubber; the block stays unchecked
                log.exception("scrubbing block %s failed", meta.chain_hash.hex())

    async def _check(self, meta: BlockMeta) -> None:
        if not _eligible(meta):
            return  # deleted, evicted or already checked since it was queued
        slot = meta.host_slot
        assert slot is not None
        # No pin: a scrub must never keep eviction from making room. If the copy is freed (and
        # its slot perhaps rewritten) while it is hashed, the digest means nothing and is
        # ignored: a freed copy loses its slot, and a new copy of the block is a verified one.
        hashing = asyncio.ensure_future(self.mover.run(_digest, self.mover.host.view(slot)))
        self._hashing = hashing
        digest = await asyncio.shield(hashing)  # a cancelled scrub still lets stop() await the thread
        self._hashing = None
        if not _eligible(meta) or meta.host_slot != slot:
            return
        if digest == meta.checksum:
            self.index.mark_host_checked(meta)
            self.checked += 1
            return
        async with self.mutex:
            # Nothing moves a block while the mutex is held: is it still the copy that was hashed?
            if not (_eligible(meta) and meta.host_slot == slot and self.index.get(meta.key) is meta):
                return
            self.counters.checksum_failures += 1
            self.dropped += 1
            log.warning("block %s: host payload does not match its checksum; deleted", meta.chain_hash.hex())
            await self.mover.remove([meta])


def _eligible(meta: BlockMeta) -> bool:
    # A block in a move is not read: its host copy may be one a promotion (or a copy down from
    # GPU) is still filling, and every move verifies the copy it makes (or frees the copy it
    # takes away). A block evicted after it was queued and promoted back is such a copy.
    return (meta.linked and meta.committed and meta.host_slot is not None and not meta.host_checked
            and not meta.moving)


def _digest(view: memoryview) -> int:
    digest = xxhash.xxh3_64()
    for off in range(0, view.nbytes, HASH_CHUNK):
        digest.update(view[off:off + HASH_CHUNK])
    return digest.intdigest()
