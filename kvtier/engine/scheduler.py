"""Requests and the step scheduler: chunked prefill and decode in one batch, prefix sharing.

Each step has a token budget (``max_step_tokens``). Running sequences are served first, in
arrival order: a decoding sequence takes one token, a sequence in prefill takes the next chunk of
its prompt. What is left of the budget admits waiting sequences. Admitting a sequence:

1. shares the leading prompt blocks already computed in some page (in-engine prefix cache);
2. asks the daemon (``lookup``) how many of the following blocks it holds; the engine loads those
   into fresh pages before the step runs;
3. allocates every page the sequence can ever need (prompt + ``max_tokens``), so that, without
   preemption, a running sequence never runs out of pages. When too few pages are free the
   sequence waits (and the scheduler logs why) until running ones finish.

Reuse, in-engine or from the daemon, stops at the last full block before the prompt's final
token (as in vLLM): the engine always computes at least the last prompt token to get its logits.
A sequence whose next blocks are being computed by another running sequence waits a step and
then shares them, so a batch of requests with one system prompt computes and stores it once.

No torch here: this module is bookkeeping only.
"""

from __future__ import annotations

import enum
import logging
from collections import deque
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

from kvtier_protocol.errors import CapacityError

from kvtier.engine.cache import PageAllocator

log = logging.getLogger(__name__)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One request: its tokens, where its KV lives and how far it has been computed."""

    seq_id: int
    token_ids: list[int]  # the prompt, then each generated token
    max_tokens: int  # generated tokens at most
    block_hashes: list[bytes] = field(default_factory=list)  # chain hashes of the full prompt blocks
    stop_token_ids: frozenset[int] = frozenset()
    num_prompt_tokens: int = 0  # set from token_ids in __post_init__
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # page ids in token order
    num_computed_tokens: int = 0  # tokens whose KV is in the pages (computed, shared or loaded)
    num_shared_tokens: int = 0  # prompt tokens shared from pages computed in this engine
    num_lookup_tokens: int = 0  # prompt tokens the daemon said it holds, to load before the first step
    num_loaded_tokens: int = 0  # of those, tokens actually loaded (set by the engine)
    num_cached_blocks: int = 0  # leading full blocks whose pages are named by their hash
    finish_reason: str | None = None  # "stop" or "length"
    refused: bool = False  # it waited for pages (logged once)

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"request {self.seq_id}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.seq_id}: max_tokens must be >= 1, got {self.max_tokens}")
        self.num_prompt_tokens = len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """Prompt tokens remain to be computed."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def num_reused_tokens(self) -> int:
        """Prompt tokens not computed for this request (shared in the engine or loaded)."""
        return self.num_shared_tokens + self.num_loaded_tokens

    def num_pages_needed(self, block_tokens: int) -> int:
        """Pages for the prompt and every token it may generate (the last one is never cached)."""
        tokens = self.num_prompt_tokens + self.max_tokens - 1
        return -(-tokens // block_tokens)


@dataclass(slots=True)
class ScheduledBatch:
    """What one step computes: ``num_new_tokens[i]`` tokens of ``seqs[i]``, from its computed end."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # admitted this step; loads run first

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    """Waiting and running queues over one :class:`PageAllocator`.

    Args:
        allocator: the pages of the engine's KV cache.
        max_step_tokens: tokens computed per step at most (the chunked-prefill budget).
        max_num_seqs: running sequences at most.
        lookup: ``lookup(block_hashes) -> int``: how many leading blocks the daemon holds
            (``KVConnectorCore.lookup``); None without a daemon.
    """

    def __init__(self, allocator: PageAllocator, *, max_step_tokens: int = 2048, max_num_seqs: int = 256,
                 lookup: Callable[[Seq[bytes]], int] | None = None) -> None:
        if max_step_tokens < 1 or max_num_seqs < 1:
            raise ValueError(f"need max_step_tokens >= 1 and max_num_seqs >= 1, got {max_step_tokens}, {max_num_seqs}")
        self.allocator = allocator
        self.block_tokens = allocator.block_tokens
        self.max_step_tokens = max_step_tokens
        self.max_num_seqs = max_num_seqs
        self.lookup = lookup
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._pending: dict[bytes, int] = {}  # block hash -> id of the running sequence computing it

    def check_fits(self, seq: Sequence) -> None:
        """Raise CapacityError if ``seq`` needs more pages than the whole cache has (it could never run)."""
        need = seq.num_pages_needed(self.block_tokens)
        if need > self.allocator.num_pages:
            raise CapacityError(f"request {seq.seq_id} needs {need} KV pages ({seq.num_prompt_tokens} prompt + "
                                f"{seq.max_tokens} new tokens); the cache has {self.allocator.num_pages}")

    def add(self, seq: Sequence) -> None:
        """Queue ``seq``.

        Raises:
            CapacityError: see :meth:`check_fits`.
        """
        self.check_fits(seq)
        self.waiting.append(seq)

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def schedule(self) -> ScheduledBatch:
        """Pick this step's work: running sequences first, then admit waiting ones."""
        batch = ScheduledBatch()
        budget = self.max_step_tokens
        for seq in self.running:
            if budget == 0:
                break
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        deferred: list[Sequence] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting.popleft()
            admitted = self._admit(seq)
            if admitted is None:  # its prefix is being computed by another sequence: next step
                deferred.append(seq)
                continue
            if not admitted:  # out of pages: keep arrival order, stop admitting
                self.waiting.appendleft(seq)
                break
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            batch.admitted.append(seq)
            budget -= n
        self.waiting.extendleft(reversed(deferred))
        return batch

    def postprocess(self, batch: ScheduledBatch) -> None:
        """Record that ``batch`` ran: advance each sequence and name its newly computed blocks."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            assert seq.num_computed_tokens <= len(seq.token_ids), f"request {seq.seq_id} computed past its end"
            self._cache_blocks(seq)

    def append_token(self, seq: Sequence, token_id: int) -> bool:
        """Add a sampled token to ``seq``; finish it on a stop token or at ``max_tokens``.

        Returns:
            Whether ``seq`` finished.
        """
        seq.token_ids.append(token_id)
        if token_id in seq.stop_token_ids:
            self.finish(seq, "stop")
        elif seq.num_output_tokens >= seq.max_tokens:
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop ``seq`` and give back its pages (their prefixes stay cached)."""
        assert seq.status is SequenceStatus.RUNNING, f"request {seq.seq_id} is {seq.status.value}"
        for h in seq.block_hashes:
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _admit(self, seq: Sequence) -> bool | None:
        """Give ``seq`` its pages. True: running; False: too few pages; None: wait for a prefix."""
        bt = self.block_tokens
        reusable = (seq.num_prompt_tokens - 1) // bt  # keep the last prompt token to compute
        shared = self.allocator.num_cached_blocks(seq.block_hashes[:reusable])
        if any(h in self._pending for h in seq.block_hashes[shared:]):
            return None
        num_new = seq.num_pages_needed(bt) - shared
        if not self.allocator.can_allocate(seq.block_hashes[:shared], num_new):
            if not seq.refused:
                seq.refused = True
                log.info("request %d waits for KV pages: it needs %d, %d are free", seq.seq_id,
                         self.allocator.num_pages_to_take(seq.block_hashes[:shared], num_new), self.allocator.num_free)
            return False
        held = 0
        if self.lookup is not None and shared < reusable:
            held = min(self.lookup(seq.block_hashes[shared:reusable]), reusable - shared)
        table = self.allocator.allocate(seq.block_hashes[:shared], num_new)
        assert table is not None, "can_allocate said yes"
        seq.block_table = table
        seq.num_cached_blocks = shared
        seq.num_shared_tokens = shared * bt
        seq.num_lookup_tokens = held * bt
        seq.num_computed_tokens = (shared + held) * bt  # the engine lowers it if a load falls short
        for h in seq.block_hashes[shared:]:
            if self.allocator.page_of(h) is None:
                self._pending[h] = seq.seq_id
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    def _cache_blocks(self, seq: Sequence) -> None:
        full = min(seq.num_computed_tokens // self.block_tokens, len(seq.block_hashes))
        for i in range(seq.num_cached_blocks, full):
            h = seq.block_hashes[i]
            self.allocator.cache(h, seq.block_table[i])
            if self._pending.get(h) == seq.seq_id:
                del self._pending[h]
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)
