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

import mmap

PAGE = mmap.PAGESIZE
POOLED_PAYLOAD_BYTES = 1 << 20
"""Payloads above this go through the pool; smaller ones are cheap to allocate as they come."""
_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


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

    def take(self, n: int) -> mmap.mmap:
        """A mapping of at least ``n`` bytes (n > 0) that nothing else uses: its first ``n`` are
        the caller's until :meth:`give`. Its contents are unspecified."""
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
        return mmap.mmap(-1, -(-n // PAGE) * PAGE, flags=_FLAGS)

    def view(self, n: int) -> memoryview:
        """``n`` writable bytes of a mapping from :meth:`take`, already given back: it is handed
        out again only once this view and every view taken from it are gone. The usual way to use
        the pool: nobody has to remember to give the mapping back."""
        m = self.take(n)
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


def _unexported(m: mmap.mmap) -> bool:
    """True when no buffer exported from ``m`` is alive (a resize to the same size is refused
    while one is). Where mmap cannot resize (not Linux), never: such mappings are not reused."""
    try:
        m.resize(len(m))
    except (BufferError, OSError, SystemError, ValueError):
        return False
    return True


__all__ = ["PAGE", "POOLED_PAYLOAD_BYTES", "PayloadBuffers"]
