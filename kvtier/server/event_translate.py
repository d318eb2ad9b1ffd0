"""Store events to vLLM 0.33 KV events, at hash-unit granularity (SPEC.md §9.5).

The store reports one :class:`~kvtier.store.stats.StoreEvent` per block and tier. A router such
as llm-d indexes a block only from a ``BlockStored`` that carries the block's tokens, the hash of
every hash unit in it and the parent's hash; it recomputes its own keys from ``token_ids``. The
store does not know tokens (a header carries hashes only), so the data plane hands them over
with :meth:`EventTranslator.note_blocks` after a commit or put, and this module keeps them in a
bounded LRU until the block has left every tier it was announced in.

One store event becomes one per-block event (:class:`Translated`):

- ``STORED`` with token info: ``BlockStored(block_hashes=[u64 of each unit digest],
  parent_block_hash=u64 of the parent chain hash (None for a prefix's first block),
  token_ids=the block's tokens, block_size=hash_tokens, medium, group_idx=0,
  kv_cache_spec_kind="full_attention" | "mla_attention")``.
- ``STORED`` without token info: a placeholder (``token_ids=[]``, ``block_size=0``, parent
  None, hashes ``[u64 of chain_hash]``), which llm-d treats as a tier-location update of hashes
  it already indexed from the engine's own events.
- ``REMOVED``: ``BlockRemoved`` with the same hashes the store event announced and ``group_idx=0``.

``group_idx=0`` with a ``kv_cache_spec_kind`` follows SPEC.md §9.5 and its ``map_tiers`` vector
(vLLM's OffloadingConnector does the same); llm-d accepts it because ``len(token_ids) ==
len(block_hashes) * block_size`` holds for full events and placeholders alike.
:func:`merge` then joins consecutive per-block events into vLLM-style runs for the wire.
"""

from __future__ import annotations

import logging
from array import array
from collections import OrderedDict
from itertools import chain
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.events import BlockRemoved, BlockStored, Event, event_to_wire
from kvtier_protocol.keys import chain_hashes, event_hash
from kvtier_protocol.namespace import Namespace

from kvtier.store.stats import EventKind, StoreEvent
from kvtier.store.types import BlockKey, make_key

log = logging.getLogger(__name__)

GROUP_IDX = 0  # kvtier stores one KV-cache group per namespace
MAX_RUN_TOKENS = 1 << 16  # a merged event stays far below the receivers' 2**20-entry array limit
MAX_RUN_HASHES = 1 << 14


@dataclass(frozen=True, slots=True)
class BlockTokens:
    """What the data plane knows about a block it just stored, for KV events.

    Attributes:
        chain_hash: the block's key (digest of its last hash unit).
        parent_hash: the previous block's chain hash, None for the first block of a prefix.
            Informational: the committed header's parent (``StoreEvent.parent_hash``) is what
            events publish.
        tokens: the block's token ids (``block_tokens`` of them).
        unit_hashes: the digest of each hash unit of the block, first unit first; the last one
            equals ``chain_hash``. Empty: one unit per block, or recomputed from the tokens.
    """

    chain_hash: bytes
    parent_hash: bytes | None
    tokens: tuple[int, ...]
    unit_hashes: tuple[bytes, ...] = ()


@dataclass(slots=True)
class _TokenInfo:
    """Cached token info of one block."""

    tokens: array  # token ids, compact ('I', or 'Q' when an id exceeds 32 bits)
    units: array | None  # u64 event form of each unit digest; None: not given yet
    tiers: int = 0  # bit per Tier announced STORED and not yet REMOVED


@dataclass(frozen=True, slots=True)
class Translated:
    """One store event as a vLLM event, with what SSE subscribers see besides it."""

    source: StoreEvent
    event: BlockStored | BlockRemoved

    @property
    def full(self) -> bool:
        """A BlockStored carrying tokens (not a placeholder)."""
        return isinstance(self.event, BlockStored) and bool(self.event.token_ids)

    def as_dict(self, seq: int | None, ts: float) -> dict[str, object]:
        """The JSON-able form of ``/v1/events``: the vLLM map form plus where the block lives."""
        src = self.source
        out = event_to_wire(self.event)
        assert isinstance(out, dict), "the map form is a dict"
        out.update(ns=src.ns_id.hex(), chain_hash=src.chain_hash.hex(),
                   parent_hash=src.parent_hash.hex() if src.parent_hash is not None else None,
                   tier=src.tier.name.lower(), num_tokens=src.num_tokens, seq=seq, ts=ts)
        return out


def _tokens_array(tokens: Sequence[int]) -> array | None:
    for code in ("I", "Q"):
        try:
            return array(code, tokens)
        except OverflowError:
            continue  # an id above 32 bits (or negative: 'Q' refuses it too)
        except TypeError:
            return None
    return None


class EventTranslator:
    """Turns store events into per-block vLLM events, keeping token info in a bounded LRU.

    Args:
        max_blocks: token-info entries kept (least recently stored or noted dropped first).
        max_tokens: token ids kept over all entries (bounds memory: 4 bytes each, typically).
    """

    def __init__(self, max_blocks: int = 1_000_000, max_tokens: int = 1 << 26) -> None:
        self._max_blocks = max_blocks
        self._max_tokens = max_tokens
        self._cache: OrderedDict[BlockKey, _TokenInfo] = OrderedDict()
        self._tokens = 0  # token ids held by the cache
        self.invalid_notes = 0  # note_blocks entries refused (malformed or inconsistent)

    def __len__(self) -> int:
        return len(self._cache)

    def note_blocks(self, ns_id: bytes, blocks: Iterable[BlockTokens]) -> None:
        """Remember the tokens (and unit digests) of blocks, for their next events.

        Malformed entries are counted in :attr:`invalid_notes` and skipped: events about those
        blocks become placeholders, the store itself is unaffected.
        """
        for b in blocks:
            tokens = _tokens_array(b.tokens) if b.tokens else None
            units = b.unit_hashes
            if (tokens is None or not isinstance(b.chain_hash, bytes) or len(b.chain_hash) < 8
                    or (units and (units[-1] != b.chain_hash or len(tokens) % len(units)))
                    or any(not isinstance(u, bytes) or len(u) < 8 for u in units)):
                self.invalid_notes += 1
                continue
            key = make_key(ns_id, b.chain_hash)
            old = self._cache.pop(key, None)
            if old is not None:
                self._tokens -= len(old.tokens)
            # Lengths were checked above: the u64 form inline, without event_hash's own checks.
            info = _TokenInfo(tokens, array("Q", [int.from_bytes(u[-8:], "big") for u in units]) if units else None,
                              old.tiers if old is not None else 0)
            self._cache[key] = info
            self._tokens += len(tokens)
        self._shrink()

    def _shrink(self) -> None:
        while self._cache and (len(self._cache) > self._max_blocks or self._tokens > self._max_tokens):
            _, info = self._cache.popitem(last=False)
            self._tokens -= len(info.tokens)

    def _drop(self, key: BlockKey) -> None:
        info = self._cache.pop(key, None)
        if info is not None:
            self._tokens -= len(info.tokens)

    def translate(self, events: Sequence[StoreEvent],
                  namespaces: Mapping[bytes, Namespace]) -> list[Translated]:
        """Per-block vLLM events for ``events``, in order; updates the token cache."""
        out: list[Translated] = []
        for ev in events:
            key = make_key(ev.ns_id, ev.chain_hash)
            info = self._cache.get(key)
            if ev.kind is EventKind.STORED:
                out.append(Translated(ev, self._stored(ev, key, info, namespaces.get(ev.ns_id))))
            else:
                out.append(Translated(ev, BlockRemoved(self._hashes(ev, info), ev.medium, GROUP_IDX)))
                if info is not None:
                    bit = 1 << ev.tier
                    # A block we saw stored somewhere and that just left its last such tier is
                    # gone; one that predates its note (a restart) ages out of the LRU instead.
                    if info.tiers & bit:
                        info.tiers &= ~bit
                        if not info.tiers:
                            self._drop(key)
        return out

    @staticmethod
    def _hashes(ev: StoreEvent, info: _TokenInfo | None) -> tuple[int, ...]:
        if info is not None and info.units is not None:
            return tuple(info.units)
        return (event_hash(ev.chain_hash),)

    def _stored(self, ev: StoreEvent, key: BlockKey, info: _TokenInfo | None,
                ns: Namespace | None) -> BlockStored:
        kind = "mla_attention" if ns is not None and ns.attention == "mla" else "full_attention"
        if info is not None:
            self._cache.move_to_end(key)
            info.tiers |= 1 << ev.tier
            block_size = self._resolve(ev, key, info, ns)
            if block_size:
                assert info.units is not None, "_resolve fills the unit hashes"
                parent = event_hash(ev.parent_hash) if ev.parent_hash is not None else None
                return BlockStored(tuple(info.units), parent, tuple(info.tokens), block_size,
                                   medium=ev.medium, group_idx=GROUP_IDX, kv_cache_spec_kind=kind)
        return BlockStored((event_hash(ev.chain_hash),), None, (), 0, medium=ev.medium,
                           group_idx=GROUP_IDX, kv_cache_spec_kind=kind)

    def _resolve(self, ev: StoreEvent, key: BlockKey, info: _TokenInfo, ns: Namespace | None) -> int:
        """Fill ``info.units`` and return the block size in tokens per hash; 0: unusable (the
        info is dropped and the block is published as a placeholder)."""
        n = len(info.tokens)
        if ns is None:  # unknown geometry: trust the note (one unit per block without digests)
            if info.units is None:
                info.units = array("Q", [event_hash(ev.chain_hash)])
            return n // len(info.units)
        upb = ns.units_per_block
        if n != ns.block_tokens or (info.units is not None and len(info.units) != upb):
            log.debug("token info of %s does not fit its namespace; publishing a placeholder", key.hex())
            self._drop(key)
            return 0
        if info.units is None:
            if upb == 1:
                info.units = array("Q", [event_hash(ev.chain_hash)])
            else:
                units = self._recompute(ev, info, ns)
                if units is None:
                    self._drop(key)
                    return 0
                info.units = units
        return ns.hash_tokens

    @staticmethod
    def _recompute(ev: StoreEvent, info: _TokenInfo, ns: Namespace) -> array | None:
        """Unit digests from the tokens, kept only when the last one is the block's key (extra
        keys the namespace does not know, such as LoRA or multimodal, make it differ)."""
        start = 0 if ev.parent_hash is None else ns.block_tokens  # any block boundary > 0
        try:
            units = chain_hashes(list(info.tokens), ns.hash_tokens, scheme=ns.hash_scheme,
                                 extras=ns.extra_keys(), parent=ev.parent_hash, start=start)
        except KVTierError:
            return None
        if not units or units[-1] != ev.chain_hash:
            return None
        return array("Q", (event_hash(u) for u in units))


def _joins(prev: Translated, cur: Translated, tokens: int, hashes: int) -> bool:
    """Whether ``cur`` extends the run ending in ``prev`` into one wire event."""
    a, b = prev.event, cur.event
    if (type(a) is not type(b) or a.medium != b.medium or prev.source.ns_id != cur.source.ns_id
            or hashes + len(b.block_hashes) > MAX_RUN_HASHES):
        return False
    if isinstance(a, BlockRemoved):
        return True
    assert isinstance(b, BlockStored)
    if prev.full != cur.full or a.kv_cache_spec_kind != b.kv_cache_spec_kind:
        return False
    if not cur.full:
        return True  # placeholders only list hashes
    # One BlockStored covers one chain: cur must continue prev's prefix (checked on the digests,
    # not on the u64s, which may collide).
    return (a.block_size == b.block_size and cur.source.parent_hash == prev.source.chain_hash
            and tokens + len(b.token_ids) <= MAX_RUN_TOKENS)


def merge(translated: Sequence[Translated]) -> list[Event]:
    """Join consecutive per-block events into runs, as vLLM emits them (fewer, larger events):
    stores of one chain in one medium, placeholders of one medium, removals of one medium."""
    runs: list[list[Translated]] = []
    tokens = hashes = 0
    for t in translated:
        if runs and _joins(runs[-1][-1], t, tokens, hashes):
            runs[-1].append(t)
        else:
            runs.append([t])
            tokens = hashes = 0
        hashes += len(t.event.block_hashes)
        tokens += len(t.event.token_ids) if isinstance(t.event, BlockStored) else 0
    return [_combine(run) for run in runs]


def _combine(run: list[Translated]) -> Event:
    first = run[0].event
    if len(run) == 1:
        return first
    hashes = tuple(chain.from_iterable(t.event.block_hashes for t in run))  # C-level concatenation
    if isinstance(first, BlockRemoved):
        return BlockRemoved(hashes, first.medium, first.group_idx)
    tokens = tuple(chain.from_iterable(t.event.token_ids for t in run))  # type: ignore[union-attr]
    return BlockStored(hashes, first.parent_block_hash, tokens, first.block_size,
                       medium=first.medium, group_idx=first.group_idx,
                       kv_cache_spec_kind=first.kv_cache_spec_kind)
