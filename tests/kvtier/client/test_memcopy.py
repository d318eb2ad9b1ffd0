"""kvtier.client.memcopy: the C routine (non-temporal stores) and its fallback copy the same bytes."""

from __future__ import annotations

import mmap
import os
import platform
import subprocess
import sys
import threading

import numpy as np
import pytest

from kvtier.client import memcopy
from tests.kvtier.client.daemonkit import ENV, ROOT

COPIES = [pytest.param(memcopy.copy, id="copy"), pytest.param(memcopy.copy_plain, id="copy_plain")]
MANY = [pytest.param(memcopy.copy_many, id="copy_many"), pytest.param(memcopy.copy_many_plain, id="copy_many_plain"),
        pytest.param(memcopy.copy_many_memcpy, id="copy_many_memcpy")]
NT_MIN = memcopy.NONTEMPORAL_MIN_BYTES or 256 * 1024


def _run_fresh(code: str) -> str:
    """What ``code`` prints, run by a fresh interpreter over the working tree."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=ROOT, env=ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _random(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_the_c_routine_is_built_where_a_compiler_is() -> None:
    # setup.py builds it as optional: a broken build must fail here, not fall back unnoticed.
    if sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64"):
        assert memcopy.NATIVE and memcopy.NONTEMPORAL
        assert memcopy.NONTEMPORAL_MIN_BYTES == 256 * 1024
        assert memcopy.copy is not memcopy.copy_plain
    else:
        assert memcopy.NONTEMPORAL is False or memcopy.NATIVE


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 63, 64, 65, 4095, NT_MIN - 1, NT_MIN, NT_MIN + 1,
                               NT_MIN + 63, 3 * (1 << 20) + 5])
@pytest.mark.parametrize("offsets", [(0, 0), (1, 0), (0, 7), (13, 5), (16, 32)])
def test_copies_every_byte_and_nothing_beyond(copy, n: int, offsets: tuple[int, int]) -> None:
    # Misaligned starts exercise the head before the first aligned streaming store; odd lengths,
    # the tail after the last whole 64 bytes. Guard bytes around the destination stay untouched.
    so, do = offsets
    src = bytearray(_random(n + so, n))
    dst = bytearray(b"\xa5" * (n + do + 64))
    copy(memoryview(dst)[do:do + n], memoryview(src)[so:])
    assert dst[do:do + n] == src[so:]
    assert dst[:do] == b"\xa5" * do and dst[do + n:] == b"\xa5" * 64


def test_every_relative_alignment_of_a_streaming_copy() -> None:
    # The streaming loop aligns the destination to a cache line and loads the source wherever it
    # then lies: all 64 offsets of one from the other, one size past the threshold, a ragged tail.
    n = NT_MIN + 100
    src = bytearray(_random(n + 128, 11))
    base = memoryview(src)
    dst = bytearray(n + 128)
    for rel in range(64):
        dst[:] = b"\x00" * len(dst)
        memcopy.copy(memoryview(dst)[rel:rel + n], base[:n])
        assert dst[rel:rel + n] == src[:n], f"offset {rel}"
        assert not any(dst[:rel]) and not any(dst[rel + n:])



@pytest.mark.parametrize("distance", [0, 1, 15, 16, 63, 64, 65, 112, 127, 128, 129, 2048, 4096 - 127,
                                      4096 - 64, 4096 - 1])
@pytest.mark.parametrize("src_offset", [0, 5, 64])
def test_streaming_copies_forward_and_backward(distance: int, src_offset: int) -> None:
    # Destinations 1-127 bytes ahead of the source modulo 4 KiB stream backward (4K aliasing),
    # all others forward: both loops, both window edges, ragged heads and tails, guard bytes.
    n = NT_MIN + 100
    with mmap.mmap(-1, n + 3 * 4096) as a, mmap.mmap(-1, n + 3 * 4096) as b:  # page-aligned bases
        src = np.frombuffer(a, np.uint8)[src_offset:src_offset + n]
        src[:] = np.frombuffer(_random(n, distance), np.uint8)
        dst_all = np.frombuffer(b, np.uint8)
        dst_all[:] = 0xA5
        start = src_offset + distance
        memcopy.copy(dst_all[start:start + n], src)
        assert (dst_all[start:start + n] == src).all(), f"distance {distance}"
        assert (dst_all[:start] == 0xA5).all() and (dst_all[start + n:] == 0xA5).all()
        del src, dst_all  # release the exports before the mappings close


@pytest.mark.parametrize("copy_many", MANY)
def test_copy_many_copies_every_pair(copy_many) -> None:
    # Small and large pairs in one call (memcpy and both streaming loops), in shared memory too.
    sizes = [0, 1, 4096, NT_MIN - 1, NT_MIN + 3, 3 * (1 << 20) + 5]
    srcs = [_random(n, n) for n in sizes]
    with mmap.mmap(-1, sum(sizes) + 64 * len(sizes)) as mm:
        with memoryview(mm) as view:
            dsts, off = [], 0
            for n in sizes:
                dsts.append(view[off + 17:off + 17 + n])  # odd offsets, guard bytes between
                off += n + 64
            copy_many(dsts + [bytearray(2)], srcs + [b"ab"])
            assert [bytes(d) for d in dsts] == srcs
            for d in dsts:
                d.release()
        assert copy_many([], []) is None


@pytest.mark.parametrize("copy_many", MANY)
def test_copy_many_checks_every_pair_before_it_copies(copy_many) -> None:
    big = NT_MIN + 1
    first = bytearray(big)
    for dsts, srcs, error in [
        ([first, bytearray(3)], [_random(big, 1), b"ab"], ValueError),  # lengths of the second pair
        ([first, b"xy"], [_random(big, 1), b"ab"], BufferError),  # read-only second destination
        ([first, memoryview(bytearray(8))[::2]], [_random(big, 1), b"abcd"], BufferError),
        ([first, bytearray(1)], [_random(big, 1), 1], TypeError),
        ([first], [_random(big, 1), b"a"], ValueError),  # counts differ
    ]:
        with pytest.raises(error):
            copy_many(dsts, srcs)
        assert first == bytearray(big), "nothing is copied when any pair is bad"
    with pytest.raises(TypeError):
        copy_many(1, [])


@pytest.mark.parametrize("streaming", [True, False])
@pytest.mark.parametrize("threads", [2, 3, 4, memcopy.MAX_COPY_THREADS])
def test_copy_many_threads_copies_every_pair(threads: int, streaming: bool) -> None:
    # Above PARALLEL_MIN_BYTES: the shares cut pairs apart, at odd offsets in shared memory.
    sizes = [5, 3 * (1 << 20) + 7, 4096, NT_MIN + 3, 6 * (1 << 20) + 1, 0, 1 << 20]
    assert sum(sizes) >= memcopy.PARALLEL_MIN_BYTES
    srcs = [_random(n, n + 1) for n in sizes]
    with mmap.mmap(-1, sum(sizes) + 64 * len(sizes)) as mm:
        mm.write(b"\xee" * len(mm))
        with memoryview(mm) as view:
            dsts, off = [], 0
            for n in sizes:
                dsts.append(view[off + 17:off + 17 + n])  # guard bytes between
                off += n + 64
            memcopy.copy_many_threads(dsts, srcs, threads, streaming=streaming)
            assert [bytes(d) for d in dsts] == srcs
            off = 0
            for n in sizes:
                assert view[off:off + 17] == b"\xee" * 17 and view[off + 17 + n:off + 64 + n] == b"\xee" * 47
                off += n + 64
            for d in dsts:
                d.release()


def test_copy_many_threads_copies_multi_byte_formats_by_bytes() -> None:
    halves = np.random.default_rng(3).random((2048, 2048)).astype(np.float16)  # 8 MiB, 2-D
    floats = np.random.default_rng(4).random((1024, 1024)).astype(np.float32)
    out_h, out_f = np.zeros_like(halves), np.zeros_like(floats)
    memcopy.copy_many_threads([out_h, out_f], [halves, floats], 3)
    assert out_h.tobytes() == halves.tobytes() and out_f.tobytes() == floats.tobytes()


def test_copy_many_threads_checks_every_pair_before_it_copies() -> None:
    big = memcopy.PARALLEL_MIN_BYTES
    first = bytearray(big)
    for dsts, srcs, error in [
        ([first, bytearray(3)], [_random(big, 1), b"ab"], ValueError),
        ([first, b"xy"], [_random(big, 1), b"ab"], BufferError),
        ([first, bytearray(1)], [_random(big, 1), 1], TypeError),
        ([first], [_random(big, 1), b"a"], ValueError),
    ]:
        with pytest.raises(error):
            memcopy.copy_many_threads(dsts, srcs, 2)
        assert first == bytearray(big), "nothing is copied when any pair is bad"
    for threads in (0, memcopy.MAX_COPY_THREADS + 1, 2.0, True):
        with pytest.raises(ValueError):
            memcopy.copy_many_threads([first], [bytes(big)], threads)


def test_shares_are_even_in_order_and_cut_at_aligned_offsets() -> None:
    sizes = [3 * (1 << 20) + 5, 7, 10 * (1 << 20) + 1, 1 << 20]
    srcs = [memoryview(bytearray(n)) for n in sizes]
    dsts = [memoryview(bytearray(n)) for n in sizes]
    total = sum(sizes)
    for parts in (2, 3, 4, 16):
        shares = memcopy._shares(dsts, srcs, total, parts)
        assert len(shares) == parts
        pieces = [(d, s) for ds, ss in shares for d, s in zip(ds, ss)]
        assert sum(d.nbytes for d, _ in pieces) == total
        assert all(d.nbytes == s.nbytes for d, s in pieces)
        assert all(abs(sum(d.nbytes for d in ds) - total / parts) < 4096 + 8 for ds, _ in shares[:-1])
        # In order, and every cut inside a pair at a multiple of 4 KiB from its start.
        pair, off = 0, 0
        for d, s in pieces:
            while off == sizes[pair]:
                pair, off = pair + 1, 0
            assert off % memcopy.SPLIT_ALIGN == 0
            assert d.obj is dsts[pair].obj and s.obj is srcs[pair].obj
            off += d.nbytes
        assert (pair, off) == (len(sizes) - 1, sizes[-1])


def test_the_runs_of_a_batch_are_about_run_bytes_each() -> None:
    sizes = [2 << 20] * 31 + [(1 << 20) + 4096 * 3 + 17]
    srcs = [memoryview(bytearray(n)) for n in sizes]
    dsts = [memoryview(bytearray(n)) for n in sizes]
    total = sum(sizes)
    parts = max(2, min(memcopy.MAX_RUNS, total // memcopy.RUN_BYTES))
    runs = memcopy._shares(dsts, srcs, total, parts)
    assert len(runs) == parts == total // memcopy.RUN_BYTES
    assert all(abs(sum(d.nbytes for d in ds) - total / parts) < 4096 + 8 for ds, _ in runs[:-1])
    assert sum(d.nbytes for ds, _ in runs for d in ds) == total


def test_a_batch_does_not_wait_for_a_helper_that_never_starts() -> None:
    """The pool's helpers all busy (another caller's batch, here a blocked task): the caller takes
    every run itself and returns, rather than wait for a helper to start."""
    big = 4 * memcopy.PARALLEL_MIN_BYTES
    src = _random(big, 11)
    dst = bytearray(big)
    release = threading.Event()
    pool = memcopy._POOL.executor(1)
    busy = [pool.submit(release.wait, 60) for _ in range(memcopy._POOL._workers)]  # every helper
    try:
        done = threading.Event()
        caller = threading.Thread(target=lambda: (memcopy.copy_many_threads([dst], [src], 2), done.set()))
        caller.start()
        finished = done.wait(30)
        assert finished, "copy_many_threads waited for a helper that could not start"
        assert dst == src
    finally:
        release.set()
        for f in busy:
            f.result(10)
        caller.join(30)


@pytest.mark.parametrize("cgroup, files, quota", [
    ("0::/kubepods/pod1\n", {"kubepods/pod1/cpu.max": "150000 100000\n"}, 1.5),  # v2
    ("0::/\n", {"cpu.max": "max 100000\n"}, None),  # v2, no limit
    ("4:memory:/x\n3:cpu,cpuacct:/docker/c1\n",  # v1, the cpu controller mounted with cpuacct
     {"cpu,cpuacct/docker/c1/cpu.cfs_quota_us": "200000\n", "cpu,cpuacct/docker/c1/cpu.cfs_period_us": "100000\n"}, 2.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
    ("0::/gone\n", {}, None),  # unreadable: no quota known
    ("0::/\n", {"cpu.max": "garbage\n"}, None),
])
def test_cgroup_cpu_quota_reads_v1_and_v2(tmp_path, cgroup: str, files: dict[str, str], quota: float | None) -> None:
    (tmp_path / "self-cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert memcopy.cgroup_cpu_quota(str(tmp_path / "self-cgroup"), str(tmp_path / "fs")) == quota


def test_default_copy_threads_follow_affinity_and_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(memcopy.COPY_THREADS_ENV, raising=False)
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.setattr(memcopy, "cgroup_cpu_quota", lambda: None)
    assert memcopy.default_copy_threads() == max(1, min(4, cpus))
    monkeypatch.setattr(memcopy, "cgroup_cpu_quota", lambda: 1.5)  # a container of 1.5 CPUs
    assert memcopy.default_copy_threads() == 1
    monkeypatch.setattr(memcopy, "cgroup_cpu_quota", lambda: 0.5)
    assert memcopy.default_copy_threads() == 1
    monkeypatch.setattr(memcopy, "cgroup_cpu_quota", lambda: 64.0)
    assert memcopy.default_copy_threads() == max(1, min(4, cpus))


def test_the_environment_sets_the_default_copy_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memcopy, "cgroup_cpu_quota", lambda: 1.0)  # the variable wins over the quota
    for text, threads in (("3", 3), (" 7 ", 7), ("1", 1), (str(memcopy.MAX_COPY_THREADS), memcopy.MAX_COPY_THREADS)):
        monkeypatch.setenv(memcopy.COPY_THREADS_ENV, text)
        assert memcopy.env_copy_threads() == threads and memcopy.default_copy_threads() == threads
    for text in ("0", "-2", "x", "2.5", str(memcopy.MAX_COPY_THREADS + 1)):
        monkeypatch.setenv(memcopy.COPY_THREADS_ENV, text)
        with pytest.raises(ValueError, match="KVTIER_COPY_THREADS"):
            memcopy.default_copy_threads()
    monkeypatch.setenv(memcopy.COPY_THREADS_ENV, "")
    assert memcopy.env_copy_threads() is None and memcopy.default_copy_threads() == 1


def test_copy_many_threads_works_again_in_a_forked_child() -> None:
    big = memcopy.PARALLEL_MIN_BYTES
    src = _random(big, 7)
    dst = bytearray(big)
    memcopy.copy_many_threads([dst], [src], 2)  # the parent's helper threads exist now
    pid = os.fork()
    if pid == 0:  # the child: the fork kept the executor object but none of its threads
        out = bytearray(big)
        try:
            memcopy.copy_many_threads([out], [src], 2)
            os._exit(0 if out == src else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert dst == src


@pytest.mark.parametrize("copy", COPIES)
def test_copies_into_shared_memory_and_numpy(copy) -> None:
    n = 2 * (1 << 20) + 3
    fd = os.memfd_create("kvtier-test-memcopy")
    try:
        os.ftruncate(fd, n + 4096)
        with mmap.mmap(fd, n + 4096) as mm:
            src = np.frombuffer(_random(n, 7), dtype=np.uint8).copy()
            with memoryview(mm) as view, view[4096:] as part:
                copy(part, src)
            assert mm[4096:] == src.tobytes()
            out = np.zeros(n, dtype=np.uint8)
            with memoryview(mm) as view, view[4096:] as part:
                copy(out, part)
            assert np.array_equal(out, src)
    finally:
        os.close(fd)


@pytest.mark.parametrize("copy", COPIES)
@pytest.mark.parametrize("shift", [-4097, -1, 1, 4097])
def test_overlapping_buffers_move_like_memmove(copy, shift: int) -> None:
    n = NT_MIN + 4096  # large enough for the streaming path, were overlap not checked first
    buf = bytearray(_random(n + 16384, 3))
    before = bytes(buf)
    d, s = 8192 + shift, 8192
    copy(memoryview(buf)[d:d + n], memoryview(buf)[s:s + n])
    assert buf[d:d + n] == before[s:s + n]


@pytest.mark.parametrize("copy", COPIES)
def test_bad_arguments_are_typed_errors(copy) -> None:
    with pytest.raises(ValueError, match="3 bytes, source 2"):
        copy(bytearray(3), b"ab")
    with pytest.raises(BufferError):
        copy(b"ab", b"cd")  # read-only destination
    with pytest.raises(BufferError):
        copy(memoryview(bytearray(8))[::2], b"abcd")  # not contiguous
    with pytest.raises(TypeError):
        copy(bytearray(1), 1)
    with pytest.raises(TypeError):
        copy(bytearray(1))  # type: ignore[call-arg]


@pytest.mark.skipif(not memcopy.NATIVE, reason="the C routine's own argument (no compiler at install)")
def test_the_streaming_argument_of_copy_many() -> None:
    from kvtier.client import _memcopy

    big = NT_MIN + 5
    for streaming in (False, 0, None, True, 1):  # truth-tested like any value
        dst = bytearray(big)
        _memcopy.copy_many([dst], [_random(big, 9)], streaming)
        assert dst == _random(big, 9)

    class Untruthful:
        def __bool__(self) -> bool:
            raise ValueError("no truth value")

    dst = bytearray(4)
    with pytest.raises(ValueError, match="no truth value"):
        _memcopy.copy_many([dst], [b"wxyz"], Untruthful())
    assert dst == bytearray(4)  # nothing copied
    with pytest.raises(TypeError, match="takes 2 or 3 arguments"):
        _memcopy.copy_many([dst], [b"wxyz"], False, 1)


def test_multi_byte_formats_copy_by_bytes() -> None:
    src = np.arange(NT_MIN // 8 + 3, dtype=np.float64)
    dst = np.zeros_like(src)
    memcopy.copy(dst, src)
    assert np.array_equal(dst, src)
    with pytest.raises(ValueError):
        memcopy.copy(np.zeros(4, dtype=np.float32), np.zeros(4, dtype=np.float64))


GIL_CHECK = """
import sys, threading, time
from kvtier.client import memcopy


def others_ran_during(copy, dst, src):
    # Whether another thread ran while `copy` copied, the switch interval so long that only a
    # released GIL lets it: the counting thread sleeps(0) after each count, handing the GIL back
    # at once, and otherwise cannot run while the copying thread holds it. The interval is set
    # before the thread starts: a thread already waiting for the GIL under a shorter one would
    # force a switch when that ran out, whoever held the GIL.
    counted = [0]
    stop = threading.Event()

    def count():
        while not stop.is_set():
            counted[0] += 1
            time.sleep(0)

    sys.setswitchinterval(30.0)
    t = threading.Thread(target=count)
    t.start()
    while not counted[0]:  # the thread runs: counting, yielding
        time.sleep(0.001)
    before = counted[0]
    # Copy until the other thread ran (between two copies this thread holds the GIL, so what the
    # count shows happened during a copy): a busy machine may schedule it late, never not at all.
    # The bound keeps the control, which never lets it run, well within the switch interval.
    for _ in range(64):
        copy(dst, src)
        if counted[0] > before:
            break
    ran = counted[0] > before
    stop.set()
    t.join(5)
    sys.setswitchinterval(0.005)
    return ran


n = 32 << 20
src, dst = bytearray(n), bytearray(n)
memcopy.copy(dst, src)  # fault both in first
many = lambda d, s: memcopy.copy_many([d[:n // 2], d[n // 2:]], [s[:n // 2], s[n // 2:]])
print(others_ran_during(memcopy.copy, dst, src), others_ran_during(memcopy.copy_plain, dst, src),
      others_ran_during(many, memoryview(dst), memoryview(src)))
"""


@pytest.mark.skipif(not memcopy.NONTEMPORAL, reason="the streaming path is x86-64 only")
def test_a_large_copy_lets_other_threads_run() -> None:
    # In a fresh interpreter: threads other tests left behind could force switches of their own.
    # The streaming copy lets the other thread run, also copy_many's; the control, a copy under
    # the GIL, does not.
    assert _run_fresh(GIL_CHECK).split() == ["True", "False", "True"]


def test_without_the_c_routine_the_plain_copy_stands_in() -> None:
    # As on a machine where setup.py found no compiler: the import of kvtier.client._memcopy fails.
    check = ("import sys; sys.modules['kvtier.client._memcopy'] = None\n"
             "from kvtier.client import memcopy\n"
             "assert not memcopy.NATIVE and not memcopy.NONTEMPORAL and memcopy.copy is memcopy.copy_plain\n"
             "assert memcopy.copy_many is memcopy.copy_many_plain\n"
             "src = bytes(range(256)) * 4096; dst = bytearray(len(src)); memcopy.copy(dst, src)\n"
             "print(dst == src)")
    assert _run_fresh(check).strip() == "True"
