"""Scheduler: chunked prefill budget, mixed batches, page refusal, prefix sharing, daemon lookup."""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import pytest
from kvtier_protocol.errors import CapacityError
from kvtier_protocol.keys import chain_hashes

from kvtier.engine.cache import PageAllocator
from kvtier.engine.scheduler import Scheduler, Sequence, SequenceStatus

BT = 16


def make_seq(seq_id: int, tokens: list[int], max_tokens: int = 4, **kw) -> Sequence:
    n_full = len(tokens) // BT
    return Sequence(seq_id, list(tokens), max_tokens, block_hashes=chain_hashes(tokens, BT)[:n_full], **kw)


def run_step(s: Scheduler, next_token: int = 7) -> list[tuple[int, int]]:
    """One step as the engine runs it: schedule, "compute", sample where a sequence reached its end."""
    batch = s.schedule()
    s.postprocess(batch)
    for seq in batch.seqs:
        if seq.num_computed_tokens == len(seq.token_ids):
            s.append_token(seq, next_token)
    return [(seq.seq_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]


def test_chunked_prefill_respects_the_budget() -> None:
    s = Scheduler(PageAllocator(32, BT), max_step_tokens=32)
    seq = make_seq(0, list(range(100)), max_tokens=3)
    s.add(seq)
    steps = [run_step(s) for _ in range(6)]
    assert steps == [[(0, 32)], [(0, 32)], [(0, 32)], [(0, 4)], [(0, 1)], [(0, 1)]]
    assert seq.is_finished and seq.finish_reason == "length" and seq.output_token_ids == [7, 7, 7]
    assert s.is_finished() and s.allocator.num_free == 32


def test_prefills_of_different_lengths_share_a_step() -> None:
    s = Scheduler(PageAllocator(32, BT), max_step_tokens=64)
    for i, n in enumerate((5, 20, 37)):
        s.add(make_seq(i, list(range(100 * i, 100 * i + n))))
    assert run_step(s) == [(0, 5), (1, 20), (2, 37)]
    assert run_step(s) == [(0, 1), (1, 1), (2, 1)]


def test_decodes_come_before_prefill_chunks() -> None:
    s = Scheduler(PageAllocator(32, BT), max_step_tokens=30)
    for i, n in enumerate((5, 20, 37)):
        s.add(make_seq(i, list(range(100 * i, 100 * i + n))))
    assert run_step(s) == [(0, 5), (1, 20), (2, 5)]
    assert run_step(s) == [(0, 1), (1, 1), (2, 28)]
    assert run_step(s) == [(0, 1), (1, 1), (2, 4)]


def test_max_num_seqs_bounds_the_running_set() -> None:
    s = Scheduler(PageAllocator(32, BT), max_step_tokens=100, max_num_seqs=2)
    for i in range(3):
        s.add(make_seq(i, [i] * 3, max_tokens=1))
    assert run_step(s) == [(0, 3), (1, 3)]
    assert run_step(s) == [(2, 3)]


def test_waits_for_pages_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    s = Scheduler(PageAllocator(4, BT), max_step_tokens=256)
    a, b = make_seq(0, list(range(40)), max_tokens=2), make_seq(1, list(range(100, 140)), max_tokens=2)
    s.add(a)
    s.add(b)  # each needs 3 pages of the 4
    with caplog.at_level(logging.INFO, logger="kvtier.engine.scheduler"):
        assert run_step(s) == [(0, 40)]
        assert run_step(s) == [(0, 1)]
    assert b.status is SequenceStatus.WAITING and a.is_finished
    assert sum("request 1 waits for KV pages: it needs 3, 1 are free" in r.message for r in caplog.records) == 1
    assert run_step(s) == [(1, 40)]


def test_a_request_larger_than_the_cache_is_refused() -> None:
    s = Scheduler(PageAllocator(4, BT), max_step_tokens=256)
    with pytest.raises(CapacityError, match="needs 5 KV pages"):
        s.add(make_seq(0, list(range(60)), max_tokens=10))


def test_pages_cover_prompt_and_every_new_token() -> None:
    s = Scheduler(PageAllocator(8, BT), max_step_tokens=256)
    seq = make_seq(0, list(range(16)), max_tokens=17)  # KV of 16 + 16 tokens: the last is never fed back
    s.add(seq)
    run_step(s)
    assert len(seq.block_table) == 2


def test_shared_system_prompt_is_computed_once() -> None:
    system = list(range(1000, 1040))  # 2 full blocks + 8 tokens
    s = Scheduler(PageAllocator(64, BT), max_step_tokens=512)
    seqs = [make_seq(i, system + [i] * 9, max_tokens=3) for i in range(8)]
    for seq in seqs:
        s.add(seq)
    # Step 1: only the first runs; the others wait for its blocks instead of computing them again.
    assert run_step(s) == [(0, 49)]
    assert all(q.status is SequenceStatus.WAITING for q in seqs[1:])
    # Step 2: the first decodes, the seven others share its two blocks and compute the rest.
    assert run_step(s) == [(0, 1)] + [(i, 49 - 32) for i in range(1, 8)]
    shared = seqs[0].block_table[:2]
    for q in seqs[1:]:
        assert q.block_table[:2] == shared and q.num_shared_tokens == 32
        assert not set(q.block_table[2:]) & set(seqs[0].block_table)
    assert [s.allocator.ref_count(p) for p in shared] == [8, 8]


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    prompt = list(range(32))
    s = Scheduler(PageAllocator(16, BT), max_step_tokens=512)
    first = make_seq(0, prompt, max_tokens=1)
    s.add(first)
    run_step(s)
    assert first.is_finished and s.allocator.num_cached == 2
    again = make_seq(1, prompt, max_tokens=1)
    s.add(again)
    assert run_step(s) == [(1, 16)]  # block 0 shared; block 1 holds the last token: computed
    assert again.num_shared_tokens == 16 and again.block_table[1] != s.allocator.page_of(again.block_hashes[1])


def test_daemon_lookup_covers_the_blocks_after_the_shared_ones() -> None:
    asked: list[list[bytes]] = []

    def lookup(hashes: Seq[bytes]) -> int:
        asked.append(list(hashes))
        return min(2, len(hashes))

    s = Scheduler(PageAllocator(32, BT), max_step_tokens=512, lookup=lookup)
    seq = make_seq(0, list(range(70)), max_tokens=1)  # 4 full blocks; 70 - 1 leaves 4 reusable
    s.add(seq)
    assert run_step(s) == [(0, 70 - 32)]
    assert asked == [seq.block_hashes[:4]]
    assert seq.num_lookup_tokens == 32 and seq.num_shared_tokens == 0
    # A second request reuses the 4 computed blocks in the engine and asks for nothing beyond them.
    seq2 = make_seq(1, list(range(70)) + [5] * 20, max_tokens=1)
    s.add(seq2)
    assert run_step(s) == [(1, 90 - 80)]
    assert asked[1] == seq2.block_hashes[4:5]
    assert seq2.num_shared_tokens == 64 and seq2.num_lookup_tokens == 16


def test_no_lookup_when_everything_reusable_is_shared() -> None:
    calls = []
    s = Scheduler(PageAllocator(32, BT), max_step_tokens=512, lookup=lambda h: calls.append(h) or 0)
    s.add(make_seq(0, list(range(33)), max_tokens=1))
    run_step(s)
    s.add(make_seq(1, list(range(33)), max_tokens=1))
    run_step(s)
    assert len(calls) == 1  # the second request shares both reusable blocks in the engine


def test_stop_token_finishes_and_frees() -> None:
    s = Scheduler(PageAllocator(8, BT), max_step_tokens=64)
    seq = make_seq(0, [1, 2, 3], max_tokens=10, stop_token_ids=frozenset({7}))
    s.add(seq)
    run_step(s, next_token=7)
    assert seq.finish_reason == "stop" and seq.output_token_ids == [7] and s.allocator.num_free == 8


def test_invalid_requests() -> None:
    with pytest.raises(ValueError):
        Sequence(0, [], 4)
    with pytest.raises(ValueError):
        Sequence(0, [1], 0)
    with pytest.raises(ValueError):
        Scheduler(PageAllocator(4, BT), max_step_tokens=0)
