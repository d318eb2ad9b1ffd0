"""Bulk copies of block payloads between buffers: a save into shared memory, a load out of it.

:func:`copy` is used wherever the client moves a whole payload and will not read it again
(``kvtier.client.shm.SegmentMap``, ``kvtier.client.load``); :func:`copy_many` makes the copies of a
whole batch of blocks in one call (a save's, a load's), so no Python runs between them. It runs the C
routine of ``kvtier.client._memcopy`` when that was built (setup.py builds it where a C compiler exists):
from ``NONTEMPORAL_MIN_BYTES`` on x86-64 it copies with non-temporal stores and without the GIL,
~1.5x the speed of ``memcpy`` for multi-MiB blocks on the development VM and leaving the CPU
caches to the code that runs next. Otherwise it is CPython's memoryview assignment (``memcpy``).

One core does not reach the memory's bandwidth (on the development VM one streams ~7 GB/s, two
~12), so :func:`copy_many_threads` cuts a large batch into runs of ~1 MiB that a few threads take
in turn, each running :func:`copy_many` without the GIL: what the client does with every save and
load.

``kvtier bench dataplane`` times these same functions as its strict baseline, so those ratios
measure what kvtier adds to the copy, whichever copy runs; :func:`copy_many_memcpy` (glibc's
memcpy on the same threads and runs) is its second, ordinary one. Torch-free, stdlib only.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

try:
    from kvtier.client import _memcopy
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


def copy_many_memcpy(dsts: Sequence[Any], srcs: Sequence[Any]) -> None:
    """:func:`copy_many` with the C library's ``memcpy`` for every size, no streaming stores: the
    reference ``kvtier bench`` sets the client's copies beside. Large pairs release the GIL as in
    :func:`copy_many`, so it runs on several threads alike. (Without the C routine it is
    :func:`copy_many_plain`, under the GIL.)"""
    if _memcopy is None:
        copy_many_plain(dsts, srcs)
    else:
        _memcopy.copy_many(dsts, srcs, False)


PARALLEL_MIN_BYTES = 8 << 20
"""A batch smaller than this is copied on the calling thread alone: handing shares to other
threads costs tens of µs, a few % of a 1 MiB copy but nothing next to a multi-MiB one."""
MAX_COPY_THREADS = 16
RUN_BYTES = 1 << 20
"""A batch shared out is cut into runs of about this many bytes, and each thread takes the next run
not yet taken until none is left (rather than one fixed share each): a thread the scheduler preempts
(on a busy host, for the daemon its request just woke) then holds the batch up by the rest of one
run (~0.15 ms), not by its whole share, while the others copy what it would have."""
MAX_RUNS = 1024
SPLIT_ALIGN = 4096
"""Runs are cut inside a pair at multiples of this (from the pair's start): both halves keep the
pair's alignment and its destination-source distance mod 4 KiB, which choose the C routine's loop."""


COPY_THREADS_ENV = "KVTIER_COPY_THREADS"
"""Environment variable that sets the default copy threads of every client of the process (the
engines' connectors included, which take no client options)."""


def env_copy_threads() -> int | None:
    """The copy threads :data:`COPY_THREADS_ENV` sets, or None when it is unset or empty.

    Raises:
        ValueError: it is not an integer in 1..MAX_COPY_THREADS.
    """
    text = os.environ.get(COPY_THREADS_ENV, "").strip()
    if not text:
        return None
    try:
        threads = int(text)
    except ValueError:
        threads = 0
    if not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"{COPY_THREADS_ENV} must be an integer in 1..{MAX_COPY_THREADS}, got {text!r}")
    return threads


def default_copy_threads() -> int:
    """Threads a client copies with by default: :data:`COPY_THREADS_ENV` when set; else the CPUs
    this process may run on (its affinity, and its cgroup's CPU quota: a container limited to 2
    CPUs of a 64-core host gets 2), at most 4 (enough for one socket's memory channels from the
    cores of a busy engine host).

    Raises:
        ValueError: :data:`COPY_THREADS_ENV` is malformed.
    """
    configured = env_copy_threads()
    if configured is not None:
        return configured
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    if quota is not None:
        cpus = min(cpus, max(1, int(quota)))
    return max(1, min(4, cpus))


def cgroup_cpu_quota(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroup may use per period (``cpu.max`` in cgroup v2,
    ``cpu.cfs_quota_us / cpu.cfs_period_us`` in v1), or None: no quota, or none readable."""
    try:
        with open(proc_cgroup, encoding="ascii") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        path = path.lstrip("/")
        try:
            if hid == "0" and controllers == "":  # v2: one unified hierarchy
                with open(os.path.join(root, path, "cpu.max"), encoding="ascii") as f:
                    quota, period = f.read().split()[:2]
                if quota != "max":
                    return int(quota) / int(period)
            elif "cpu" in controllers.split(","):  # v1: the cpu controller's hierarchy
                base = os.path.join(root, controllers, path)
                with open(os.path.join(base, "cpu.cfs_quota_us"), encoding="ascii") as f:
                    quota_us = int(f.read())
                with open(os.path.join(base, "cpu.cfs_period_us"), encoding="ascii") as f:
                    period_us = int(f.read())
                if quota_us > 0 and period_us > 0:
                    return quota_us / period_us
        except (OSError, ValueError, ZeroDivisionError):
            continue
    return None


class _Pool:
    """The helper threads of :func:`copy_many_threads`, made on first use and made again in a
    forked child (a fork keeps the executor object but none of its threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0
        self._workers = 0

    def executor(self, workers: int) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None or self._pid != os.getpid() or self._workers < workers:
                old = self._executor if self._pid == os.getpid() else None
                self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvtier-copy")
                self._pid, self._workers = os.getpid(), workers
                if old is not None:
                    old.shutdown(wait=False)
            return self._executor


_POOL = _Pool()


def _shares(dsts: Sequence[memoryview], srcs: Sequence[memoryview], total: int,
            parts: int) -> list[tuple[list[memoryview], list[memoryview]]]:
    """The byte views of the pairs cut into at most ``parts`` runs of about ``total / parts``
    bytes, in order; a pair crossing a boundary is cut at a multiple of SPLIT_ALIGN from its start.
    (:func:`copy_many_threads` asks for runs of at least min(PARALLEL_MIN_BYTES / MAX_COPY_THREADS,
    RUN_BYTES) >> SPLIT_ALIGN bytes, so a cut always lands inside the run being filled once that
    run is empty.)"""
    target = -(-total // parts)
    out: list[tuple[list[memoryview], list[memoryview]]] = []
    run_d: list[memoryview] = []
    run_s: list[memoryview] = []
    filled = 0
    for d, s in zip(dsts, srcs):
        off, n = 0, d.nbytes
        while off < n:
            take = n - off
            last = len(out) == parts - 1
            if not last and filled + take > target:
                take = (off + target - filled) // SPLIT_ALIGN * SPLIT_ALIGN - off  # <= 0: run ends here
            if take > 0:
                run_d.append(d[off:off + take])
                run_s.append(s[off:off + take])
                off += take
                filled += take
            if not last and (off < n or filled >= target):
                assert run_d, "a cut always lands inside an empty run"
                out.append((run_d, run_s))
                run_d, run_s, filled = [], [], 0
    if run_d:
        out.append((run_d, run_s))
    return out


def _nbytes(bufs: Sequence[Any]) -> int:
    """Bytes of the buffers, read without a new view where they are views already (the client's
    are): a small batch then reaches :func:`copy_many` with no Python per pair."""
    total = 0
    for b in bufs:
        if type(b) is memoryview:
            total += b.nbytes
        else:
            with memoryview(b) as v:
                total += v.nbytes
    return total


def _drain(runs: Sequence[tuple[list[memoryview], list[memoryview]]], turns: Iterator[int],
           copy_run: Callable[[Sequence[Any], Sequence[Any]], None]) -> None:
    """``copy_run`` of ``runs[i]`` for each ``i`` drawn from ``turns`` (shared by every thread of
    the batch: ``next`` on an ``itertools.count`` is atomic under the GIL) until all are taken."""
    for i in turns:
        if i >= len(runs):
            return
        copy_run(*runs[i])


def copy_many_threads(dsts: Sequence[Any], srcs: Sequence[Any], threads: int, *, streaming: bool = True) -> None:
    """:func:`copy_many` with the bytes shared out over up to ``threads`` threads (the caller's
    and ``threads - 1`` helpers), from PARALLEL_MIN_BYTES of batch on; below that, or with one
    thread, it is :func:`copy_many`. The batch is cut into runs of about RUN_BYTES, which the
    threads take in turn, so a preempted or late thread leaves its runs to the others (and a
    helper that has not started once they are all taken, the pool being busy with another
    caller's batch, is not waited for). ``streaming`` False: each run is :func:`copy_many_memcpy`
    (the benchmarks' reference, on the same threads and runs). Every pair is checked before any
    byte moves, so an error copies nothing. The pairs must not overlap one another (each may
    overlap itself: a memmove), since runs are copied at the same time.

    Raises:
        ValueError: ``threads`` is not in 1..MAX_COPY_THREADS; and what :func:`copy_many` raises.
    """
    if type(threads) is not int or not 1 <= threads <= MAX_COPY_THREADS:
        raise ValueError(f"copy threads must be an integer in 1..{MAX_COPY_THREADS}, got {threads!r}")
    copy_run = copy_many if streaming else copy_many_memcpy
    if threads == 1 or len(dsts) != len(srcs) or _nbytes(srcs) < PARALLEL_MIN_BYTES:
        copy_run(dsts, srcs)  # checks every pair itself (in C), and raises the count mismatch
        return
    views: list[memoryview] = []
    try:
        bd: list[memoryview] = []
        bs: list[memoryview] = []
        for d, s in zip(dsts, srcs):
            dv, sv = memoryview(d), memoryview(s)
            views += (dv, sv)
            _check_pair(dv, sv, "copy_many")
            bd.append(dv.cast("B") if dv.format != "B" or dv.ndim != 1 else dv)
            bs.append(sv.cast("B") if sv.format != "B" or sv.ndim != 1 else sv)
        views += bd + bs
        total = sum(v.nbytes for v in bd)
        runs = _shares(bd, bs, total, max(threads, min(MAX_RUNS, total // RUN_BYTES)))
        for run in runs:
            views += run[0] + run[1]
        turns = itertools.count()
        executor = _POOL.executor(threads - 1)
        futures: list[Future[None]] = [executor.submit(_drain, runs, turns, copy_run)
                                       for _ in range(min(threads, len(runs)) - 1)]
        try:
            _drain(runs, turns, copy_run)
        finally:
            # A helper still queued (the pool busy with another caller's batch) is not waited
            # for: the runs are all taken. Every run taken is done before a view is released,
            # also after an error.
            wait([f for f in futures if not f.cancel()])
        for f in futures:
            if not f.cancelled():
                f.result()  # raises a helper's error (none is expected: every pair was checked)
    finally:
        for v in reversed(views):
            v.release()


__all__ = ["COPY_THREADS_ENV", "MAX_COPY_THREADS", "NATIVE", "NONTEMPORAL", "NONTEMPORAL_MIN_BYTES", "PARALLEL_MIN_BYTES",
           "RUN_BYTES", "cgroup_cpu_quota", "copy", "copy_many", "copy_many_memcpy", "copy_many_plain",
           "copy_many_threads", "copy_plain", "default_copy_threads", "env_copy_threads"]
