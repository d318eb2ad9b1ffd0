"""Bulk copies of block payloads between buffers: a save into shared memory, a load out of it.

:func:`copy` is used wherever the client moves a whole payload and will not read it again
(``kvtier.client.shm.SegmentMap``, ``kvtier.client.into``); :func:`copy_many` makes the copies of a
whole batch of blocks in one call (a save's, a load's), so no Python runs between them. It runs the C
routine of ``kvtier._memcopy`` when that was built (setup.py builds it where a C compiler exists):
from ``NONTEMPORAL_MIN_BYTES`` on x86-64 it copies with non-temporal stores and without the GIL,
~1.5x the speed of ``memcpy`` for multi-MiB blocks on the development VM and leaving the CPU
caches to the code that runs next. Otherwise it is CPython's memoryview assignment (``memcpy``).

``kvtier bench dataplane`` times this same function as its baseline, so its ratios measure what
kvtier adds to the copy, whichever copy runs. Torch-free, stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

try:
    from kvtier import _memcopy
except ImportError:  # not built: no compiler at install time, or another interpreter
    _memcopy = None

NATIVE: bool = _memcopy is not None
"""True when the C routine is in use."""
NONTEMPORAL: bool = bool(_memcopy is not None and _memcopy.NONTEMPORAL)
"""True when large copies use non-temporal stores (the C routine, on x86-64)."""
NONTEMPORAL_MIN_BYTES: int = _memcopy.NONTEMPORAL_MIN_BYTES if _memcopy is not None else 0
"""Copies from this many bytes stream (when :data:`NONTEMPORAL`); smaller ones are a memcpy."""


def _check_pair(d: memoryview, s: memoryview, what: str) -> None:
    """Raise as the C routine does unless ``d`` can take the bytes of ``s``."""
    if d.readonly:
        raise BufferError(f"{what}: the destination is read-only")
    if not (d.c_contiguous and s.c_contiguous):
        raise BufferError(f"{what}: both buffers must be C-contiguous")
    if d.nbytes != s.nbytes:
        raise ValueError(f"{what}: destination holds {d.nbytes} bytes, source {s.nbytes}")


def copy_plain(dst: Any, src: Any) -> None:
    """``memcpy`` through memoryview assignment: the fallback, and a reference for benchmarks.
    Same contract as :func:`copy`."""
    with memoryview(dst) as d, memoryview(src) as s:
        _check_pair(d, s, "copy")
        with d.cast("B") as db, s.cast("B") as sb:
            db[:] = sb


def copy_many_plain(dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
    """:func:`copy_plain` of each pair, every pair checked first: the fallback of :func:`copy_many`."""
    if len(dsts) != len(srcs):
        raise ValueError(f"copy_many: {len(dsts)} destinations, {len(srcs)} sources")
    views: list[memoryview] = []
    try:
        for d, s in zip(dsts, srcs):
            views += (memoryview(d), memoryview(s))
            _check_pair(views[-2], views[-1], "copy_many")
        for d, s in zip(dsts, srcs):
            copy_plain(d, s)
    finally:
        for v in views:
            v.release()


copy: Callable[[Any, Any], None] = _memcopy.copy if _memcopy is not None else copy_plain
"""``copy(dst, src)``: the bytes of ``src`` into ``dst``. Both are C-contiguous buffers of the same
byte length, ``dst`` writable; they may overlap (then it is a memmove).

Raises:
    TypeError: an argument is not a buffer.
    BufferError: ``dst`` is read-only; or a buffer is not C-contiguous (numpy arrays say so
        with ValueError instead).
    ValueError: the byte lengths differ.
"""

copy_many: Callable[[Sequence[Any], Sequence[Any]], None] = (_memcopy.copy_many if _memcopy is not None
                                                              else copy_many_plain)
"""``copy_many(dsts, srcs)``: :func:`copy` of ``dsts[i], srcs[i]`` for every ``i``, in one call.
Every pair is checked before any byte moves, so an error copies nothing; the GIL is released once
for the whole batch. Raises what :func:`copy` raises, and ValueError if the counts differ."""

__all__ = ["NATIVE", "NONTEMPORAL", "NONTEMPORAL_MIN_BYTES", "copy", "copy_many", "copy_many_plain", "copy_plain"]
