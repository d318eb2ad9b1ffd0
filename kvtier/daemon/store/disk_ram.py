"""What the disk tier costs in RAM: sizing its buffers from the host tier, and glibc's malloc.

The soak bench (``kvtier bench soak``) holds the daemon to its tiers + 10 %; these are the knobs.
"""

from __future__ import annotations

import ctypes
import sys

MIB = 1 << 20
_malloc_tuned = False


def ram_budget(host_bytes: int) -> tuple[int, int, int]:
    """``(write_buffer_bytes, malloc_trim_bytes, buffer_pool_bytes)`` for a daemon whose host tier
    holds ``host_bytes``.

    RocksDB holds only keys and headers now (a few hundred bytes per block), so its memtable is
    small: 1/512 of the host tier within 1-8 MiB. The aligned snapshot buffers the tier keeps for
    reuse and glibc's trim threshold are each 1/128 of the host tier, within 2-256 MiB and
    8-512 MiB, so the daemon stays within its tiers + 10 % (``kvtier bench soak --quick``: a
    64 MiB host tier measured 20 MiB less private memory than with whole records in RocksDB).
    """
    share = host_bytes // 128
    return (min(8 * MIB, max(MIB, host_bytes // 512)), min(512 * MIB, max(8 * MIB, share)),
            min(256 * MIB, max(2 * MIB, share)))


def tune_glibc_malloc(trim_bytes: int = 512 * MIB) -> None:
    """Make glibc malloc keep and reuse large freed buffers (process-wide, once; a no-op elsewhere).

    glibc serves buffers above its mmap threshold with a new mapping each time, so every
    multi-megabyte ``bytes`` (a GPU snapshot, a record read whole for an audit) paid page faults
    that zero the memory: measured 0.4-0.6 GB/s before, 1.7-3 GB/s after. Raising the mmap
    threshold to its maximum (32 MiB) and the trim threshold keeps such buffers in the heap. The
    price: up to ``trim_bytes`` (``M_TRIM_THRESHOLD``) of freed memory stays in each malloc arena.
    """
    global _malloc_tuned
    if _malloc_tuned or not sys.platform.startswith("linux"):
        return
    _malloc_tuned = True
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return  # not glibc
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 * MIB)
    mallopt(m_trim_threshold, trim_bytes)
