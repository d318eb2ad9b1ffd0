"""Store events to vLLM 0.33 KV events, at hash-unit granularity (SPEC.md §9.5).

The store reports one :class:`~kvtier.daemon.store.stats.StoreEvent` per block and tier. A router such
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
:meth:`EventTranslator.translate_runs` joins consecutive per-block events into vLLM-style runs
(:class:`Run`, token ids and hashes still arrays), each of which gives its vLLM wire form
(:meth:`Run.wire`, what :meth:`EventTranslator.translate_wire` returns) or kvtier's packed form
(:meth:`Run.packed`, SPEC.md §9.8); :meth:`EventTranslator.translate` gives the per-block objects (SSE).
"""

from __future__ import annotations

import logging
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.events import (BlockRemoved, BlockStored, event_to_wire, pack_token_ids, removed_wire,
                                    stored_wire)
from kvtier_protocol.keys import chain_hashes, event_hash
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.store.stats import EventKind, StoreEvent
from kvtier.daemon.store.types import BlockKey, Tier

log = logging.getLogger(__name__)

GROUP_IDX = 0  # kvtier stores one KV-cache group per namespace
MAX_RUN_TOKENS = 1 << 16  # a merged event stays far below the receivers' 2**20-entry array limit
MAX_RUN_HASHES = 1 << 14
_MEDIUM = {t: t.medium for t in Tier}  # one dict lookup per event instead of two properties
_FULL, _PLACEHOLDER, _REMOVED = 0, 1, 2  # what translate_runs makes of a store event
_STORED = EventKind.STORED
_LITTLE = sys.byteorder == "little"


@dataclass(frozen=True, slots=True)
class BlockTokens:
    """What the data plane knows about a block it just stored, for KV events.

    Attributes:
        chain_hash: the block's key (digest of its last hash unit).
        parent_hash: the previous block's chain hash, None for the first block of a prefix.
            Informational: the committed header's parent (``StoreEvent.parent_hash``) is what
            events publish.
        tokens: the block's token ids (``block_tokens`` of them): an ``array('I')`` (or ``'Q'``)
            as a request decodes them (:func:`kvtier_protocol.messages.token_lists`), copied in C
            without a Python int per id; a tuple of ints is taken too.
        unit_hashes: the digest of each hash unit of the block, first unit first; the last one
            equals ``chain_hash``. Empty: one unit per block, or recomputed from the tokens.
    """

    chain_hash: bytes
    parent_hash: bytes | None
    tokens: tuple[int, ...] | array
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


@lru_cache(maxsize=64)
def _tails(digest_len: int, count: int) -> struct.Struct:
    """Unpacks the last 8 bytes of each of ``count`` joined digests as big-endian u64s."""
    return struct.Struct(">" + f"{digest_len - 8}xQ" * count)


def _units_u64(units: Sequence[bytes]) -> array | None:
    """The u64 event form of unit digests (the last 8 bytes of each, big-endian); None: one is
    not a digest (bytes, >= 8 long; digests of one length may also be other bytes-like objects).

    Equal-length digests, the usual case, take C-level passes only: one join, one length check,
    and for whole-word lengths one array whose every last word is byte-swapped, so no Python
    int is made per digest (16 digests a block at 256-token blocks of 16-token units).
    """
    k = len(units)
    if k:
        try:
            joined = b"".join(units)
            n = len(units[0])
            equal = len(joined) == n * k and min(map(len, units)) == n
        except TypeError:  # not bytes: the per-digest pass below says None
            equal = False
        if equal and n >= 8:
            if n % 8:
                return array("Q", _tails(n, k).unpack(joined))
            words = array("Q")
            words.frombytes(joined)
            tails = words[n // 8 - 1::n // 8]
            if _LITTLE:
                tails.byteswap()
            return tails
    out = array("Q")
    for u in units:
        if not isinstance(u, bytes) or len(u) < 8:
            return None
        out.append(int.from_bytes(u[-8:], "big"))
    return out


@dataclass(slots=True)
class Run:
    """Consecutive per-block events joined as vLLM emits them (one wire event), before encoding.

    Attributes:
        what: 0 full BlockStored, 1 placeholder BlockStored, 2 BlockRemoved.
        hashes: u64 event hashes, prefix order (joined in C, made ints once, by the wire form).
        parent: u64 of the first block's parent (full stores only).
        tokens: the blocks' token ids joined (full stores only; 'I', or 'Q' when one exceeds
            32 bits), an array owned by the run.
        block_size: tokens per hash (full stores), else 0.
        medium: the tier's event medium.
        kind: ``kv_cache_spec_kind`` of stores, None for removals.
    """

    what: int
    hashes: array
    parent: int | None
    tokens: array | None
    block_size: int
    medium: str | None
    kind: str | None

    def wire(self, legacy: bool = False) -> dict[str, object] | list[object]:
        """The vLLM wire form (map, or legacy array): token ids as a msgpack array of ints."""
        hashes = self.hashes.tolist()
        if self.what == _REMOVED:
            return removed_wire(hashes, self.medium, GROUP_IDX, legacy)
        tokens = self.tokens.tolist() if self.tokens is not None else []
        return stored_wire(hashes, self.parent, tokens, self.block_size, self.medium, GROUP_IDX, self.kind,
                           legacy)

    def packed(self) -> dict[str, object] | list[object]:
        """kvtier's packed form (SPEC.md §9.8): the map form with token ids as one bin of
        little-endian u32s, copied from the run's array without a Python int per id."""
        hashes = self.hashes.tolist()
        if self.what == _REMOVED:
            return removed_wire(hashes, self.medium, GROUP_IDX)
        tokens: list[int] | bytes = b""
        if self.tokens is not None:
            raw = pack_token_ids(self.tokens)
            tokens = raw if raw is not None else self.tokens.tolist()  # an id above 32 bits: an array
        return stored_wire(hashes, self.parent, tokens, self.block_size, self.medium, GROUP_IDX, self.kind)


def _translated(ev: StoreEvent, what: int, hashes: Sequence[int], parent: int | None, tokens: array | None,
                block_size: int, kind: str | None) -> Translated:
    if what == _REMOVED:
        return Translated(ev, BlockRemoved(tuple(hashes), ev.medium, GROUP_IDX))
    return Translated(ev, BlockStored(tuple(hashes), parent, tuple(tokens) if tokens is not None else (),
                                      block_size, medium=ev.medium, group_idx=GROUP_IDX,
                                      kv_cache_spec_kind=kind))


_Shape = tuple[Namespace | None, str, int, int, int]
"""What translation reads of a namespace: (namespace, kv_cache_spec_kind, block_tokens, hash units
per block, hash_tokens); -1 where nothing fits (unknown namespace)."""


def _shape(ns: Namespace | None) -> _Shape:
    if ns is None:
        return None, "full_attention", -1, -1, 0
    kind = "mla_attention" if ns.attention == "mla" else "full_attention"
    bt, ht = ns.block_tokens, ns.hash_tokens
    return ns, kind, bt, bt // ht if ht and bt % ht == 0 else -1, ht


def _parent_u64(ev: StoreEvent) -> int | None:
    """The event form of the committed parent of a full store (None for a prefix's first block)."""
    p = ev.parent_hash
    if p is None:
        return None
    return int.from_bytes(p[-8:], "big") if type(p) is bytes and len(p) >= 8 else event_hash(p)


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
        cache = self._cache
        held = self._tokens
        for b in blocks:
            try:  # the common case first: ids below 2**32
                tokens: array | None = array("I", b.tokens)
            except (OverflowError, TypeError):
                tokens = _tokens_array(b.tokens)
            chain_hash, units = b.chain_hash, b.unit_hashes
            u64 = None
            # Block by block, not one join for the whole batch: the digests are read while they
            # are in the cache (a batch's are megabytes; the join was slower on the bench).
            if units and (units[-1] != chain_hash or (tokens and len(tokens) % len(units))
                          or (u64 := _units_u64(units)) is None):
                tokens = None  # refused below
            if not tokens or not isinstance(chain_hash, bytes) or len(chain_hash) < 8:
                self.invalid_notes += 1
                continue
            key = ns_id + chain_hash  # make_key, inline: this loop runs ~10^5 times a second
            old = cache.pop(key, None)
            if old is not None:
                held -= len(old.tokens)
            cache[key] = _TokenInfo(tokens, u64, old.tiers if old is not None else 0)
            held += len(tokens)
        self._tokens = held
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
        """Per-block vLLM events for ``events``, in order; updates the token cache (the wire
        form of the same events is :meth:`translate_wire`, which this runs)."""
        per_block: list[Translated] = []
        self.translate_wire(events, namespaces, per_block=per_block)
        return per_block

    def translate_wire(self, events: Sequence[StoreEvent], namespaces: Mapping[bytes, Namespace],
                       legacy: bool = False, *, per_block: list[Translated] | None = None
                       ) -> list[dict[str, object] | list[object]]:
        """The msgpack-ready vLLM events (:func:`~kvtier_protocol.events.event_to_wire` form)
        of ``events``: :meth:`translate_runs`, each run in its wire form. Updates the token cache.

        Args:
            per_block: when given, also gets one :class:`Translated` per store event (SSE).
        """
        return [r.wire(legacy) for r in self.translate_runs(events, namespaces, per_block=per_block)]

    def translate_runs(self, events: Sequence[StoreEvent], namespaces: Mapping[bytes, Namespace], *,
                       per_block: list[Translated] | None = None) -> list[Run]:
        """``events`` with consecutive blocks joined into runs as vLLM emits them: stores of one
        chain in one medium, placeholders of one medium, removals of one medium. Updates the
        token cache; each run gives its wire form (:meth:`Run.wire`, :meth:`Run.packed`).

        One pass without an object per block (the daemon's publish path, ~10^5 store events a
        second): token arrays are joined in C, and no Python int is made per token id here.

        Args:
            per_block: when given, also gets one :class:`Translated` per store event (SSE).
        """
        out: list[Run] = []
        cache = self._cache
        cached, to_end = cache.get, cache.move_to_end
        shapes: dict[bytes, _Shape] = {}  # each namespace's, read once per call
        run: Run | None = None
        r_what = -1  # no run open
        r_medium = r_kind = r_ns = r_last = None
        r_bs = r_nh = r_nt = 0
        for ev in events:
            # What the event publishes (and the token cache updated): what, hashes, tokens,
            # block_size, kind; parent only where a run starts (or per block, for SSE).
            ns_id, chain_hash = ev.ns_id, ev.chain_hash
            key = ns_id + chain_hash  # make_key, inline: this loop runs ~10^5 times a second
            info = cached(key)
            tokens = None
            block_size = 0
            if ev.kind is _STORED:
                shape = shapes.get(ns_id)
                if shape is None:
                    shape = shapes[ns_id] = _shape(namespaces.get(ns_id))
                ns, kind, fit_tokens, fit_units, hash_tokens = shape
                what = _PLACEHOLDER
                if info is not None:
                    to_end(key)
                    info.tiers |= 1 << ev.tier
                    units = info.units
                    if units is not None and len(info.tokens) == fit_tokens and len(units) == fit_units:
                        block_size = hash_tokens  # what _resolve returns for a note that fits
                    else:
                        block_size = self._resolve(ev, key, info, ns)
                    if block_size:
                        assert info.units is not None, "_resolve fills the unit hashes"
                        what, hashes, tokens = _FULL, info.units, info.tokens
                if not block_size:
                    hashes = (event_hash(chain_hash),)
            else:
                what, kind = _REMOVED, None
                if info is None:
                    hashes = (event_hash(chain_hash),)
                else:
                    hashes = info.units if info.units is not None else (event_hash(chain_hash),)
                    bit = 1 << ev.tier
                    # A block we saw stored somewhere and that just left its last such tier is
                    # gone; one that predates its note (a restart) ages out of the LRU instead.
                    if info.tiers & bit:
                        info.tiers &= ~bit
                        if not info.tiers:
                            del cache[key]  # _drop, inline
                            self._tokens -= len(info.tokens)
            if per_block is not None:
                per_block.append(_translated(ev, what, hashes, _parent_u64(ev) if tokens is not None else None,
                                             tokens, block_size, kind))
            medium = _MEDIUM[ev.tier]
            nh = len(hashes)
            # Does the event extend the open run? One BlockStored covers one chain: a full store
            # must continue the run's prefix (checked on the digests, not on the u64s, which may
            # collide); placeholders and removals only list hashes.
            if (what == r_what and medium == r_medium and ns_id == r_ns and r_nh + nh <= MAX_RUN_HASHES
                    and (what == _REMOVED or (kind == r_kind and (what == _PLACEHOLDER or (
                        block_size == r_bs and ev.parent_hash == r_last
                        and r_nt + len(tokens) <= MAX_RUN_TOKENS))))):  # type: ignore[arg-type]
                assert run is not None, "an open run"
                run.hashes.extend(hashes)
                if tokens is not None:
                    assert run.tokens is not None, "full stores join full stores"
                    if tokens.typecode != run.tokens.typecode:  # an id above 32 bits: the run goes 'Q'
                        run.tokens = array("Q", run.tokens)
                        tokens = array("Q", tokens)
                    run.tokens.extend(tokens)
                    r_nt += len(tokens)
                r_nh += nh
            else:
                r_what, r_medium, r_ns, r_kind, r_bs = what, medium, ns_id, kind, block_size
                # copies ([:] of an array): the run's arrays grow, the cached ones must not
                run = Run(what, hashes[:] if type(hashes) is array else array("Q", hashes),
                          _parent_u64(ev) if tokens is not None else None,
                          tokens[:] if tokens is not None else None, block_size, medium, kind)
                out.append(run)
                r_nh, r_nt = nh, len(tokens) if tokens is not None else 0
            r_last = chain_hash
        return out

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
