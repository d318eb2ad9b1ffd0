"""protocol/kvtier_protocol/buffers.py: inline payload buffers are reused, but never while a view of one is alive;
a lazy one costs memory only as it is written; byte budgets grant in order and lose nothing to cancelled waits."""

from __future__ import annotations

import asyncio
import os

import pytest

from kvtier_protocol.buffers import PAGE, ByteBudget, PayloadBuffers

MiB = 1 << 20


def test_a_buffer_given_back_is_handed_out_again_for_a_payload_of_about_its_size() -> None:
    pool = PayloadBuffers(keep_bytes=64 * MiB)
    m = pool.take(3 * MiB + 1)
    assert len(m) == 3 * MiB + PAGE  # whole pages
    pool.give(m)
    assert pool.take(2 * MiB) is m  # within 2x: reused
    pool.give(m)
    assert pool.take(MiB) is not m  # more than twice the payload: a buffer of its own
    assert (pool.made, pool.reused) == (2, 1)


def test_a_buffer_is_not_handed_out_again_while_a_view_of_it_lives() -> None:
    pool = PayloadBuffers(keep_bytes=64 * MiB)
    m = pool.take(2 * MiB)
    view = memoryview(m)[:2 * MiB].toreadonly()  # e.g. a record some code kept by mistake
    m[:5] = b"bytes"
    pool.give(m)
    other = pool.take(2 * MiB)
    assert other is not m  # the kept view never sees its bytes change
    other[:5] = b"xxxxx"
    assert bytes(view[:5]) == b"bytes"
    view.release()
    pool.give(other)
    assert pool.take(2 * MiB) in (m, other)  # both free now


def test_the_pool_keeps_at_most_keep_bytes_dropping_the_largest() -> None:
    pool = PayloadBuffers(keep_bytes=5 * MiB)
    a, b, c = pool.take(MiB), pool.take(2 * MiB), pool.take(4 * MiB)
    for m in (a, b, c):
        pool.give(m)
    assert pool.free_bytes == 3 * MiB and c.closed  # the 4 MiB one went: 7 MiB > 5 MiB
    big = pool.take(8 * MiB)
    view = memoryview(big)  # a response still being written, say
    pool.give(big)  # over budget: dropped from the pool, but not unmapped under the view
    assert pool.free_bytes == 3 * MiB and not big.closed
    view[:1] = b"x"  # still mapped
    view.release()
    pool.close()
    assert pool.free_bytes == 0 and a.closed


def _rss_anon() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc")
def test_a_lazy_buffer_costs_memory_only_for_what_is_written() -> None:
    pool = PayloadBuffers(keep_bytes=0)
    before = _rss_anon()
    view = pool.view(256 * MiB, populate=False)
    view[:MiB] = b"x" * MiB
    assert _rss_anon() - before < 64 * MiB  # not the 256 MiB announced
    del view


async def test_a_byte_budget_grants_in_order_and_a_cancelled_wait_takes_nothing() -> None:
    budget = ByteBudget(10)
    assert budget.try_take(6) and not budget.try_take(5)
    big = asyncio.ensure_future(budget.take(8))
    small = asyncio.ensure_future(budget.take(2))
    await asyncio.sleep(0)
    assert not big.done() and not small.done(), "first come first served: the small one waits its turn"
    big.cancel()
    await asyncio.gather(big, return_exceptions=True)
    await asyncio.sleep(0)
    assert small.done() and budget.used == 8  # the line moved on
    budget.give(6)
    budget.give(2)
    assert budget.used == 0 and budget.try_take(10)
