"""Bulk copies of block payloads between buffers: a save into shared memory, a load out of it.

One function, :func:`copy`, used wherever the client moves a whole payload and will not read it
again (``kvtier.client.shm.SegmentMap.write``, ``kvtier.client.into.copy_plain``). It runs the C
routine of ``kvtier._memcopy`` when that was built (setup.py builds it where a C compiler exists):
from ``NONTEMPORAL_MIN_BYTES`` on x86-64 it copies with non-temporal stores and without the GIL,
~1.5x the speed of ``memcpy`` for multi-MiB blocks on the development VM and leaving the CPU
caches to the code that runs next. Otherwise it is CPython's memoryview assignment (``memcpy``).

``kvtier bench dataplane`` times this same function as its baseline, so its ratios measure what
kvtier adds to the copy, whichever copy runs. Torch-free, stdlib only.
"""

from __future__ import annotations

from collections.abc import Callable
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


def copy_plain(dst: Any, src: Any) -> None:
    """``memcpy`` through memoryview assignment: the fallback, and a reference for benchmarks.
    Same contract as :func:`copy`."""
    with memoryview(dst) as d, memoryview(src) as s:
        if d.readonly:
            raise BufferError("copy: the destination is read-only")
        if not (d.c_contiguous and s.c_contiguous):
            raise BufferError("copy: both buffers must be C-contiguous")
        if d.nbytes != s.nbytes:
            raise ValueError(f"copy: destination holds {d.nbytes} bytes, source {s.nbytes}")
        with d.cast("B") as db, s.cast("B") as sb:
            db[:] = sb


copy: Callable[[Any, Any], None] = _memcopy.copy if _memcopy is not None else copy_plain
"""``copy(dst, src)``: the bytes of ``src`` into ``dst``. Both are C-contiguous buffers of the same
byte length, ``dst`` writable; they may overlap (then it is a memmove).

Raises:
    TypeError: an argument is not a buffer.
    BufferError: ``dst`` is read-only; or a buffer is not C-contiguous (numpy arrays say so
        with ValueError instead).
    ValueError: the byte lengths differ.
"""

__all__ = ["NATIVE", "NONTEMPORAL", "NONTEMPORAL_MIN_BYTES", "copy", "copy_plain"]
