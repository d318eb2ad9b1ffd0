"""The scheduler's half of the connector (runs in vLLM's EngineCore process, next to the scheduler).

It decides, never moves KV: a lookup per waiting request (how many of its blocks the daemon
holds), a load per request that takes a hit, a save per step for the blocks each request's
forward completes. Keys are the request's own ``request.block_hashes`` (vLLM's chain at
``hash_block_size`` tokens; a block is keyed by its last unit's hash), so what kvtier stores is
named exactly as vLLM's prefix cache names it.

Saves run on the workers after the forward and are reported back per worker
(:class:`KVTierWorkerMeta`). A request that finishes with saves not yet reported by every worker
keeps its blocks (``request_finished`` returns True) until each worker has finished them and
reports the request in ``finished_sending``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvtier_protocol.keys import block_keys, event_hash

from kvtier.client import Client, ClientOptions
from kvtier.connector import KVConnectorCore

from kvtier_vllm.compat import block_stored_event
from kvtier_vllm.config import KVTierConfig, geometry_of, namespace_for
from kvtier_vllm.metadata import KVTierMetadata, KVTierWorkerMeta, LoadSpec, SaveSpec

log = logging.getLogger("kvtier.vllm")


@dataclass(slots=True)
class Tracked:
    """A running request's save state.

    Attributes:
        request: vLLM's live ``Request`` (its ``block_hashes`` and ``all_token_ids`` grow).
        block_ids: its vLLM block ids (first KV-cache group), in token order.
        saved: blocks ``[0, saved)`` are computed and saved, being saved, or were there already.
        next_seq: the number of its next save.
        reports: save number -> workers that reported it ended; gone once all have.
        stored: save number -> workers that reported every block stored.
        units: save number -> ``(unit hashes, parent unit hash, token ids)`` for KV events.
    """

    request: Any
    block_ids: list[int]
    saved: int
    next_seq: int = 0
    reports: dict[int, int] = field(default_factory=dict)
    stored: dict[int, int] = field(default_factory=dict)
    units: dict[int, tuple[list[bytes], bytes | None, list[int]]] = field(default_factory=dict)


class SchedulerSide:
    """Lookups, load and save planning, and save completion of one vLLM engine.

    Args:
        vllm_config: vLLM's config (model, parallel sizes, hash algorithm).
        kv_cache_config: the scheduler's ``KVCacheConfig``.
        config: the connector's settings.
    """

    def __init__(self, vllm_config: Any, kv_cache_config: Any, config: KVTierConfig) -> None:
        self.config = config
        self.geometry = geometry = geometry_of(kv_cache_config)
        self.block_size = geometry.block_size
        self.units_per_block = geometry.block_size // geometry.hash_block_size
        self.num_workers = int(vllm_config.parallel_config.tensor_parallel_size)
        ranks = 1 if geometry.mla else self.num_workers
        options = ClientOptions(token=config.daemon_token(), timeout_s=config.timeout_s,
                                connect_timeout_s=min(config.timeout_s, 2.0), client_name="kvtier.vllm.scheduler")
        self.client = Client(config.daemon_address(), options)
        layout = "mla-latent" if geometry.mla else "vllm-nhc"
        # One namespace per TP rank: a hit needs every rank's shard of the block.
        self.cores = [KVConnectorCore(namespace_for(vllm_config, geometry, config, tp_rank=r), client=self.client,
                                      page_layout=layout, timeout_s=config.timeout_s, accept_lossy=config.accept_lossy)
                      for r in range(ranks)]
        self._requests: dict[str, Any] = {}
        self._matched: dict[str, int] = {}  # req id -> first block of its last positive lookup
        self._loads: list[LoadSpec] = []
        self._tracked: dict[str, Tracked] = {}
        self._holding: dict[str, Tracked] = {}  # finished, blocks kept until every worker saved
        self._held: list[str] = []  # newly held, for the next step's metadata
        self._events: list[Any] = []

    # -- lookups and loads ----------------------------------------------------------------------

    def block_keys(self, request: Any) -> list[bytes]:
        """The chain key of each full block of ``request``: the hash of its last hash unit."""
        return block_keys(list(request.block_hashes), self.units_per_block)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` loadable from the daemon (whole blocks, never the last
        token), and whether the load is asynchronous. Asks the daemon only; changes nothing there."""
        self._requests[request.request_id] = request
        start = num_computed_tokens // self.block_size
        # The last token must be computed by the engine to sample from it.
        keys = self.block_keys(request)[:(request.num_tokens - 1) // self.block_size]
        if len(keys) <= start:
            return 0, False
        hits = len(keys) - start
        for core in self.cores:
            hits = min(hits, core.lookup(keys[start:start + hits]))
            if hits == 0:
                return 0, False
        self._matched[request.request_id] = start
        return (start + hits) * self.block_size - num_computed_tokens, self.config.load_mode == "async"

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Plan the load of the ``num_external_tokens`` a lookup promised into the allocated blocks."""
        self._requests[request.request_id] = request
        start = self._matched.pop(request.request_id, None)
        if num_external_tokens <= 0 or start is None:
            return
        n = num_external_tokens // self.block_size
        block_ids = list(blocks.get_block_ids()[0])
        keys = self.block_keys(request)[start:start + n]
        self._loads.append(LoadSpec(request.request_id, keys, block_ids[start:start + n],
                                    self.config.load_mode == "async"))

    # -- saves --------------------------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> KVTierMetadata:
        """This step's loads, the saves of blocks its forward completes, and newly held requests."""
        meta = KVTierMetadata(loads=self._loads, held=self._held)
        self._loads, self._held = [], []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is None:
                continue
            tracked = Tracked(request, list(new.block_ids[0]), new.num_computed_tokens // self.block_size)
            self._tracked[new.req_id] = tracked
            self._plan_save(tracked, new.num_computed_tokens + scheduled.get(new.req_id, 0), meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:  # preempted and back: vLLM sends its whole block list
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])
            self._plan_save(tracked, cached.num_computed_tokens[i] + scheduled.get(req_id, 0), meta)
        return meta

    def _plan_save(self, tracked: Tracked, computed: int, meta: KVTierMetadata) -> None:
        request = tracked.request
        if not self.config.save_decode:
            computed = min(computed, request.num_prompt_tokens)
        keys = self.block_keys(request)
        end = min(computed // self.block_size, len(keys), len(tracked.block_ids))
        first = tracked.saved
        if end <= first:
            return
        bs, per = self.block_size, self.units_per_block
        tokens = list(request.all_token_ids[first * bs:end * bs])
        seq = tracked.next_seq
        meta.saves.append(SaveSpec(request.request_id, seq, keys[first:end], tracked.block_ids[first:end], tokens,
                                   keys[first - 1] if first else None))
        tracked.next_seq, tracked.saved, tracked.reports[seq] = seq + 1, end, 0
        if self.config.kv_events:
            units = list(request.block_hashes[first * per:end * per])
            tracked.units[seq] = (units, request.block_hashes[first * per - 1] if first else None, tokens)

    # -- completion ---------------------------------------------------------------------------

    def request_finished(self, request: Any, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks (True) while a save of this request has not ended on every worker."""
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._matched.pop(req_id, None)
        tracked = self._tracked.pop(req_id, None)
        if tracked is None or not tracked.reports:
            return False, None
        self._holding[req_id] = tracked
        self._held.append(req_id)
        return True, None

    def update_connector_output(self, output: Any) -> None:
        """Count the workers' save reports; release held requests vLLM reports in ``finished_sending``."""
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVTierWorkerMeta):
            for req_id, seqs in meta.stored.items():
                tracked = self._tracked.get(req_id) or self._holding.get(req_id)
                for seq in seqs if tracked is not None else ():
                    tracked.stored[seq] = tracked.stored.get(seq, 0) + 1
            for req_id, seqs in meta.done.items():
                tracked = self._tracked.get(req_id) or self._holding.get(req_id)
                for seq in seqs if tracked is not None else ():
                    self._count_report(tracked, seq)
        for req_id in getattr(output, "finished_sending", None) or ():
            self._holding.pop(req_id, None)

    def _count_report(self, tracked: Tracked, seq: int) -> None:
        if seq not in tracked.reports:
            return
        tracked.reports[seq] += 1
        if tracked.reports[seq] < self.num_workers:
            return
        del tracked.reports[seq]
        units = tracked.units.pop(seq, None)
        if units is not None and tracked.stored.pop(seq, 0) >= self.num_workers:
            hashes, parent, tokens = units
            self._events.append(block_stored_event(
                block_hashes=[event_hash(h) for h in hashes], parent_block_hash=None if parent is None
                else event_hash(parent), token_ids=tokens, block_size=self.geometry.hash_block_size,
                lora_id=None, medium="CPU", lora_name=None))

    def take_events(self) -> list[Any]:
        """``BlockStored`` events of saves every worker completed since the last call (``kv_events``)."""
        events, self._events = self._events, []
        return events

    def has_pending_saves(self) -> bool:
        """Whether a finished request still waits for its saves."""
        return bool(self._holding)

    def close(self) -> None:
        """Close the daemon connection."""
        for core in self.cores:
            core.close()
        self.client.close()

