"""Inline payload buffers of the data plane, reused once nothing refers to them any more.

Used by the daemon (kvtier.daemon.server: TCP put payloads read in, get records written out) and by the
blocking client (kvtier.client.transport: large response payloads read in). Stdlib only.

Fresh memory is as dear here as copying it: a 64 MiB ``bytearray`` takes ~30 ms to allocate, zero
and fault in (a populated anonymous mapping ~24 ms, reusing one ~4 ms; 2-core VM), against ~12 ms
to copy 64 MiB. So inline payloads (the records of a TCP ``put`` coming in, of a ``get`` going out)
live in anonymous mappings the daemon keeps and hands out again::

    take(n) ──► mapping (a free one of n..2n bytes, else a new one, populated)
                   │   request: read into it / copy records into it / write it
    give(m) ◄──────┘   back on the free list (while the pool holds under keep_bytes)

A mapping is handed out again only once no buffer exported from it is alive (``mmap.resize``
refuses while one is, and costs ~1 us otherwise): a view kept by mistake past its request can
never see its bytes change under it. Such a mapping just stays unused until the view is gone.
"""

from __future__ import annotations

import asyncio
import collections
import mmap

PAGE = mmap.PAGESIZE
POOLED_PAYLOAD_BYTES = 1 << 20
"""Payloads above this go through the pool; smaller ones are cheap to allocate as they come."""
_LAZY_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_FLAGS = _LAZY_FLAGS | getattr(mmap, "MAP_POPULATE", 0)


class PayloadBuffers:
    """A pool of anonymous mappings for inline payloads, shared by a daemon's connections.

    Args:
        keep_bytes: the most bytes of free mappings kept for reuse (the rest are unmapped).
    """

    def __init__(self, keep_bytes: int) -> None:
        assert keep_bytes >= 0, "a byte budget"
        self.keep_bytes = keep_bytes
        self._free: list[mmap.mmap] = []
        self.reused = 0  # mappings handed out again, for tests and curiosity
        self.made = 0

    @property
    def free_bytes(self) -> int:
        """Bytes of the mappings on the free list."""
        return sum(len(m) for m in self._free)

    def take(self, n: int, *, populate: bool = True) -> mmap.mmap:
        """A mapping of at least ``n`` bytes (n > 0) that nothing else uses: its first ``n`` are
        the caller's until :meth:`give`. Its contents are unspecified.

        ``populate``: a new mapping is faulted in at once (fastest to fill from memory); False
        leaves its pages to be faulted in as they are written, so a payload received from a
        peer costs memory only for the bytes that actually arrived (a peer that announces
        256 MiB and sends nothing holds no memory)."""
        assert n > 0, "an empty payload needs no buffer"
        best: mmap.mmap | None = None
        for m in self._free:
            if n <= len(m) <= 2 * n and (best is None or len(m) < len(best)) and _unexported(m):
                best = m
        if best is not None:
            self._free.remove(best)
            self.reused += 1
            return best
        self.made += 1
        return mmap.mmap(-1, -(-n // PAGE) * PAGE, flags=_FLAGS if populate else _LAZY_FLAGS)

    def view(self, n: int, *, populate: bool = True) -> memoryview:
        """``n`` writable bytes of a mapping from :meth:`take`, already given back: it is handed
        out again only once this view and every view taken from it are gone. The usual way to use
        the pool: nobody has to remember to give the mapping back."""
        m = self.take(n, populate=populate)
        out = memoryview(m)[:n]
        self.give(m)  # exported now: neither reused nor unmapped while ``out`` lives
        return out

    def give(self, m: mmap.mmap) -> None:
        """Return a mapping from :meth:`take` (its views may still be alive: it is reused only
        once they are gone). Beyond ``keep_bytes``, the largest free mappings are dropped."""
        self._free.append(m)
        total = self.free_bytes
        while total > self.keep_bytes and self._free:
            drop = max(self._free, key=len)
            self._free.remove(drop)
            total -= len(drop)
            if _unexported(drop):
                drop.close()  # else it is unmapped when its last view goes

    def close(self) -> None:
        """Drop every free mapping."""
        free, self._free = self._free, []
        for m in free:
            if _unexported(m):
                m.close()


class ByteBudget:
    """A cap on bytes held at once (frame payloads received and not yet released), shared by
    whoever charges it: :meth:`take` waits, first come first served, until ``n`` bytes fit.

    A connection charges its own budget and the daemon's (``limit`` of each), so neither one
    peer nor many together hold more received bytes than configured, whatever they announce.

    Args:
        limit: the most bytes held at once (> 0); a single charge may not exceed it.
    """

    def __init__(self, limit: int) -> None:
        assert limit > 0, "a byte budget"
        self.limit = limit
        self.used = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def try_take(self, n: int) -> bool:
        """Charge ``n`` bytes now if they fit and nobody waits before; False otherwise."""
        assert 0 <= n <= self.limit, "a charge above the whole budget could never fit"
        if self._waiters or self.used + n > self.limit:
            return False
        self.used += n
        return True

    async def take(self, n: int) -> None:
        """Charge ``n`` bytes (0 <= n <= limit), waiting in line until they fit. A cancelled wait
        charges nothing."""
        if self.try_take(n):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.give(n)  # granted just as the wait was cancelled: hand it on
            else:
                self._waiters.remove(entry)
                self._grant()  # the line moved: those behind may fit now
            raise

    def give(self, n: int) -> None:
        """Release ``n`` bytes charged before; waiters that fit now are granted, in order."""
        assert 0 <= n <= self.used, "released more than was charged"
        self.used -= n
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            n, fut = self._waiters.popleft()
            if fut.done():
                continue
            self.used += n
            fut.set_result(None)


def _unexported(m: mmap.mmap) -> bool:
    """True when no buffer exported from ``m`` is alive (a resize to the same size is refused
    while one is). Where mmap cannot resize (not Linux), never: such mappings are not reused."""
    try:
        m.resize(len(m))
    except (BufferError, OSError, SystemError, ValueError):
        return False
    return True


__all__ = ["PAGE", "POOLED_PAYLOAD_BYTES", "ByteBudget", "PayloadBuffers"]
