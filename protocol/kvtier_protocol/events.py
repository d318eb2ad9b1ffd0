"""KV events, byte-compatible with vLLM 0.33's ``vllm.distributed.kv_events`` (SPEC.md §9).

A batch is the msgpack array ``[ts float64, [event, ...], data_parallel_rank]``; the rank is left
out when None (vLLM declares the batch ``array_like, omit_defaults``; its publisher always fills
the rank in, so live vLLM batches have three elements). Each event is a map whose first key is
``"type"`` (the class name), then the required keys, always present and nil allowed, then the
optional keys, omitted when None, all in vLLM's field order. The legacy encoding (vLLM before
June 2026, llm-d-kv-cache before v0.9) is an array ``["BlockStored", field, ...]`` in the same
order with trailing None optional fields dropped. :func:`decode_batch` accepts both, and
SGLang's batches too (keys it does not know are ignored). The ZMQ framing lives in
:mod:`kvtier_protocol.event_transport` and is re-exported here. Torch-free.

The **packed form** (SPEC.md §9.8, kvtier's own, opt-in) is the map form with ``token_ids`` and
``lookahead_token_ids`` as a msgpack bin of little-endian u32s: no Python int per token id on
either side. vLLM and llm-d cannot read it, so a publisher sends it only where a subscriber asked
for it (its own endpoint), and :func:`decode_batch` accepts it only with ``packed=True``, giving
those fields as an ``array('I')``.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeAlias

import msgpack

from kvtier_protocol.errors import EventError, LimitExceeded
from kvtier_protocol.event_transport import (REPLAY_END_SEQ, LiveMessage, live_message,
                                             make_topic, parse_live_message, parse_replay_reply,
                                             parse_replay_request, parse_topic, replay_end,
                                             replay_reply, replay_request)
from kvtier_protocol.frame_codec import unique_map

__all__ = [
    "DEFAULT_EVENT_LIMITS", "EVENT_TYPES", "MEDIUM_BY_TIER", "MEDIUM_CPU", "MEDIUM_GPU",
    "MEDIUM_REMOTE", "MEDIUM_STORAGE", "REPLAY_END_SEQ", "AllBlocksCleared", "BlockRemoved",
    "BlockStored", "Event", "EventBatch", "EventHash", "EventLimits", "LiveMessage",
    "TokenIds", "decode_batch", "decode_event", "encode_batch", "encode_wire_batch", "event_to_wire",
    "live_message", "make_topic", "pack_token_ids", "parse_live_message", "parse_replay_reply",
    "parse_replay_request", "parse_topic", "removed_wire", "replay_end", "replay_reply",
    "replay_request", "stored_wire", "unpack_token_ids",
]

MEDIUM_GPU, MEDIUM_CPU, MEDIUM_STORAGE, MEDIUM_REMOTE = "GPU", "CPU", "STORAGE", "REMOTE"
MEDIUM_BY_TIER = {"gpu": MEDIUM_GPU, "host": MEDIUM_CPU, "disk": MEDIUM_STORAGE,
                  "remote": MEDIUM_REMOTE}
"""Event medium of each kvtier tier: vLLM's names, plus REMOTE for the remote tier."""

EventHash: TypeAlias = int | bytes
"""A block hash as events carry it: u64 (vLLM's last-8-bytes form; SGLang sends signed i64)
or the raw digest."""

TokenIds: TypeAlias = "tuple[int, ...] | array"
"""Token ids of a decoded event: a tuple from the vLLM forms, an ``array('I')`` from a packed
bin (:func:`unpack_token_ids`). Both are sequences of int; compare them as lists."""

_HASH_MIN, _HASH_MAX = -(1 << 63), (1 << 64) - 1
_U32 = "I"  # array typecode of the packed form's elements (4 bytes on every CPython platform)
assert array(_U32).itemsize == 4, "array('I') is 4 bytes wide"
_SWAP = sys.byteorder != "little"  # the packed form is little-endian
_MAX_HASH_BYTES = 64
_MAX_EXTRA_DEPTH = 8


@dataclass(frozen=True, slots=True)
class EventLimits:
    """Receiver limits of :func:`decode_batch`, checked before decoding (bytes) or while."""

    max_batch_bytes: int = 64 << 20
    max_events: int = 65_536
    max_list_len: int = 1 << 20  # hashes, token ids or extra keys in one event


DEFAULT_EVENT_LIMITS = EventLimits()


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks became available in ``medium``, in prefix order; ``parent_block_hash`` precedes
    the first. ``lora_id`` is deprecated in vLLM and kept for compatibility."""

    REQUIRED: ClassVar[int] = 7  # leading fields always encoded
    NEEDED: ClassVar[tuple[str, ...]] = ("block_hashes", "token_ids", "block_size")

    block_hashes: tuple[EventHash, ...]
    parent_block_hash: EventHash | None
    token_ids: TokenIds
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None  # one entry per block
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # "LOCAL" / "REMOTE" relative to the publisher
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: TokenIds | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks left ``medium``."""

    REQUIRED: ClassVar[int] = 2
    NEEDED: ClassVar[tuple[str, ...]] = ("block_hashes",)

    block_hashes: tuple[EventHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block of the publisher is gone."""

    REQUIRED: ClassVar[int] = 0
    NEEDED: ClassVar[tuple[str, ...]] = ()


Event: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared
EVENT_TYPES: dict[str, type] = {c.__name__: c for c in (BlockStored, BlockRemoved,
                                                         AllBlocksCleared)}


@dataclass(frozen=True, slots=True)
class EventBatch:
    """Events of one engine step (or one daemon flush), with the wall-clock time in seconds."""

    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None = None


# --- encoding ----------------------------------------------------------------------------------


def _wire(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_wire(v) for v in value]
    return value


_FLAT = frozenset({"block_hashes", "token_ids", "lookahead_token_ids"})
"""Fields that are flat tuples of scalars: one C-level ``list()`` instead of a call per element
(a BlockStored of 256-token blocks carries thousands of token ids)."""
_TOKEN_FIELDS = frozenset({"token_ids", "lookahead_token_ids"})
"""The fields that the packed form (SPEC.md §9.8) writes as a bin of little-endian u32s."""


def pack_token_ids(ids: Sequence[int]) -> bytes | None:
    """Token ids as the packed form's bin: little-endian u32s, 4 bytes each (SPEC.md §9.8).

    Returns:
        None when an id is not in [0, 2**32) (or not an int): the event then keeps the array
        form, which a packed decoder accepts too.
    """
    if isinstance(ids, array) and ids.typecode == _U32:
        packed = ids
    else:
        try:
            packed = array(_U32, ids)
        except (OverflowError, TypeError):
            return None
    if _SWAP:
        packed = array(_U32, packed)
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(name: str, value: bytes, limits: EventLimits) -> array:
    """The ``array('I')`` of a packed bin (SPEC.md §9.8).

    Raises:
        EventError: a length that is not a multiple of 4. LimitExceeded: more ids than
            ``limits.max_list_len``.
    """
    if len(value) % 4:
        raise EventError(f"{name}: packed token ids are 4 bytes each, got {len(value)} bytes")
    if len(value) // 4 > limits.max_list_len:
        raise LimitExceeded(f"{name} has {len(value) // 4} entries, limit {limits.max_list_len}")
    out = array(_U32)
    out.frombytes(value)
    if _SWAP:
        out.byteswap()
    return out


def _ids_wire(value: Sequence[int], packed: bool) -> list[int] | bytes:
    if packed and (raw := pack_token_ids(value)) is not None:
        return raw
    return list(value)


def event_to_wire(event: Event, legacy: bool = False, packed: bool = False) -> dict[str, Any] | list[Any]:
    """The msgpack-ready form of one event: a ``"type"``-tagged map, or the legacy array;
    ``packed``: the map with token ids as bins (SPEC.md §9.8)."""
    if type(event).__name__ not in EVENT_TYPES:
        raise EventError(f"not a KV event: {type(event).__name__}")
    if legacy and packed:
        raise EventError("the packed form is a map form; it has no legacy array variant")
    values = [(f.name, getattr(event, f.name)) for f in fields(event)]
    if legacy:
        out: list[Any] = [type(event).__name__,
                          *(list(v) if n in _FLAT and v is not None else _wire(v) for n, v in values)]
        while len(out) > 1 + event.REQUIRED and out[-1] is None:
            out.pop()  # msgspec array_like + omit_defaults drops trailing defaults only
        return out
    tagged: dict[str, Any] = {"type": type(event).__name__}
    for i, (name, value) in enumerate(values):
        if i < event.REQUIRED or value is not None:
            if value is None or name not in _FLAT:
                tagged[name] = _wire(value)
            elif name in _TOKEN_FIELDS:
                tagged[name] = _ids_wire(value, packed)
            else:
                tagged[name] = list(value)
    return tagged


def stored_wire(block_hashes: list[EventHash], parent_block_hash: EventHash | None, token_ids: list[int] | bytes,
                block_size: int, medium: str | None, group_idx: int | None, kv_cache_spec_kind: str | None,
                legacy: bool = False) -> dict[str, Any] | list[Any]:
    """``event_to_wire(BlockStored(...))`` of a publisher's BlockStored (the fields a publisher
    fills; the others None) built directly from lists, without an event object: the daemon's
    publish path makes one per run of blocks, ~10^5 per second. ``token_ids`` as bytes (from
    :func:`pack_token_ids`) gives the packed form's event (SPEC.md §9.8; map form only)."""
    assert not (legacy and isinstance(token_ids, bytes)), "the packed form is a map form"
    if legacy:
        out: list[Any] = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, None,
                          medium, None, None, group_idx, kv_cache_spec_kind]
        while len(out) > 1 + BlockStored.REQUIRED and out[-1] is None:
            out.pop()
        return out
    tagged: dict[str, Any] = {"type": "BlockStored", "block_hashes": block_hashes,
                              "parent_block_hash": parent_block_hash, "token_ids": token_ids,
                              "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": None}
    if group_idx is not None:
        tagged["group_idx"] = group_idx
    if kv_cache_spec_kind is not None:
        tagged["kv_cache_spec_kind"] = kv_cache_spec_kind
    return tagged


def removed_wire(block_hashes: list[EventHash], medium: str | None, group_idx: int | None,
                 legacy: bool = False) -> dict[str, Any] | list[Any]:
    """``event_to_wire(BlockRemoved(block_hashes, medium, group_idx))`` without the object."""
    if legacy:
        return ["BlockRemoved", block_hashes, medium] + ([group_idx] if group_idx is not None else [])
    if group_idx is None:
        return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium, "group_idx": group_idx}


def encode_wire_batch(ts: float, events: list[Any], data_parallel_rank: int | None = None) -> bytes:
    """Encode a batch whose events are already in wire form (:func:`event_to_wire`,
    :func:`stored_wire`, :func:`removed_wire`): the same bytes as :func:`encode_batch`."""
    wire: list[Any] = [float(ts), events]
    if data_parallel_rank is not None:
        wire.append(data_parallel_rank)
    return msgpack.packb(wire, use_bin_type=True)


def encode_batch(batch: EventBatch, legacy: bool = False, packed: bool = False) -> bytes:
    """Encode a batch exactly as vLLM 0.33's msgspec encoder does (``legacy``: array events),
    or in kvtier's packed form (``packed``, SPEC.md §9.8: token ids as bins)."""
    return encode_wire_batch(batch.ts, [event_to_wire(e, legacy, packed) for e in batch.events],
                             batch.data_parallel_rank)


# --- decoding ----------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"msgpack extension type {code} is not used by KV events")


def _list(name: str, value: Any, limits: EventLimits) -> list[Any]:
    if not isinstance(value, list):
        raise EventError(f"{name} must be an array")
    if len(value) > limits.max_list_len:
        raise LimitExceeded(f"{name} has {len(value)} entries, limit {limits.max_list_len}")
    return value


def _hash(name: str, value: Any) -> EventHash:
    if type(value) is int and _HASH_MIN <= value <= _HASH_MAX:
        return value
    if isinstance(value, bytes) and 1 <= len(value) <= _MAX_HASH_BYTES:
        return value
    raise EventError(f"{name}: a block hash is an integer or 1..{_MAX_HASH_BYTES} bytes")


def _int(name: str, value: Any) -> int:
    if type(value) is not int:
        raise EventError(f"{name} must be an integer")
    return value


def _str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise EventError(f"{name} must be a string")
    return value


def _frozen(name: str, value: Any, depth: int = 0) -> Any:
    """Arrays to tuples, recursively; extra keys hold only arrays and scalars."""
    if isinstance(value, list):
        if depth >= _MAX_EXTRA_DEPTH:
            raise EventError(f"{name} nests deeper than {_MAX_EXTRA_DEPTH}")
        return tuple(_frozen(name, v, depth + 1) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    raise EventError(f"{name}: extra keys hold arrays and scalars, got {type(value).__name__}")


def _extra_keys(name: str, value: Any, limits: EventLimits) -> tuple[Any, ...]:
    out = []
    for entry in _list(name, value, limits):
        if entry is not None and not isinstance(entry, list):
            raise EventError(f"{name}: one array or nil per block")
        out.append(_frozen(name, entry))
    return tuple(out)


_BOOLS = frozenset((True, False))
_FEW_ZERO_ONE = 64  # elements equal to 0 or 1 looked at one by one; more: one pass over every type


def _no_bools(items: list[Any]) -> bool:
    """Whether no element of ``items`` (ints and bools only) is a bool, in C-level passes.

    Bools equal 0 and 1, so a list without a 0 or a 1 has none (one set probe per element).
    A list with a few (a prefix's first block holds its BOS token, which is 1 for many models)
    has only those looked at, found by ``list.index``; one full of them gets the exact test,
    the set of element types.
    """
    if _BOOLS.isdisjoint(items):
        return True
    index, seen = items.index, 0
    for value in (0, 1):
        at = -1
        while True:
            try:
                at = index(value, at + 1)
            except ValueError:
                break
            if type(items[at]) is not int:
                return False
            seen += 1
            if seen > _FEW_ZERO_ONE:
                return set(map(type, items)) <= {int}
    return True


def _all_ints(items: list[Any]) -> bool:
    """Whether every element is an ``int`` and none a bool, in C-level passes (batches carry
    ~10^6 token ids a second; a Python call per element would be the decoder's main cost).

    ``sum`` raises TypeError on anything that is not a number and returns a float when a float
    is present, so an int result leaves ints and bools (all msgpack can decode to a number);
    :func:`_no_bools` then turns the bools away.
    """
    try:
        if type(sum(items)) is not int:
            return False
    except (TypeError, OverflowError):  # OverflowError: a float after a sum beyond float range
        return False
    return _no_bools(items)


def _ints(name: str, value: Any, limits: EventLimits) -> tuple[int, ...]:
    """An array of integers as a tuple (per-element checks only to name a bad element)."""
    items = _list(name, value, limits)
    if _all_ints(items):
        return tuple(items)
    return tuple(_int(name, t) for t in items)  # names the offending element


def _u64s(items: list[Any]) -> bool:
    """Whether every element is an int in [0, 2**64), in C: ``array('Q')`` refuses anything
    else but bools, which the set test turns away (u64 sums leave the fast path of ``sum``)."""
    try:
        array("Q", items)
    except (TypeError, OverflowError):
        return False
    return _no_bools(items)


def _hashes(name: str, value: Any, limits: EventLimits) -> tuple[EventHash, ...]:
    """Block hashes as a tuple: the all-u64 case (kvtier, vLLM) and the all-i64 case (SGLang)
    in C-level passes (types, range)."""
    items = _list(name, value, limits)
    if _u64s(items) or (_all_ints(items) and (not items or (min(items) >= _HASH_MIN and max(items) <= _HASH_MAX))):
        return tuple(items)
    return tuple(_hash(name, h) for h in items)


_FIELD_CHECKS: dict[str, Any] = {
    "block_hashes": _hashes,
    "parent_block_hash": lambda n, v, lim: _hash(n, v),
    "token_ids": lambda n, v, lim: _ints(n, v, lim),
    "lookahead_token_ids": lambda n, v, lim: _ints(n, v, lim),
    "block_size": lambda n, v, lim: _int(n, v),
    "lora_id": lambda n, v, lim: _int(n, v),
    "group_idx": lambda n, v, lim: _int(n, v),
    "kv_cache_spec_sliding_window": lambda n, v, lim: _int(n, v),
    "extra_keys": _extra_keys,
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {c: tuple(f.name for f in fields(c)) for c in EVENT_TYPES.values()}
"""Each event class's fields in order (``dataclasses.fields`` builds a tuple per call)."""


def _str_check(name: str, value: Any, limits: EventLimits) -> str:
    return _str(name, value)


def _build(cls: type, named: dict[str, Any], limits: EventLimits, packed: bool) -> Event:
    kwargs = {}
    for name in _FIELD_NAMES[cls]:
        value = named.get(name)
        if value is None:
            if name in cls.NEEDED:  # type: ignore[attr-defined]
                raise EventError(f"{cls.__name__} lacks {name!r}")
            kwargs[name] = None
            continue
        if packed and type(value) is bytes and name in _TOKEN_FIELDS:
            kwargs[name] = unpack_token_ids(f"{cls.__name__}.{name}", value, limits)
            continue
        check = _FIELD_CHECKS.get(name, _str_check)
        kwargs[name] = check(f"{cls.__name__}.{name}", value, limits)
    return cls(**kwargs)


def decode_event(wire: Any, limits: EventLimits = DEFAULT_EVENT_LIMITS, packed: bool = False) -> Event:
    """Decode one event from its map or legacy array form (keys or trailing fields it does not
    know are ignored); ``packed``: token ids may also be packed bins (SPEC.md §9.8)."""
    if isinstance(wire, dict):
        tag, named = wire.get("type"), wire
    elif isinstance(wire, list) and wire:
        tag = wire[0]
        cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
        names = _FIELD_NAMES[cls] if cls is not None else ()
        named = dict(zip(names, wire[1:]))
    else:
        raise EventError("an event is a map or a non-empty array")
    cls = EVENT_TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise EventError(f"unknown event type {tag!r}")
    return _build(cls, named, limits, packed)


def decode_batch(buf: bytes | bytearray | memoryview,
                 limits: EventLimits = DEFAULT_EVENT_LIMITS, *, packed: bool = False) -> EventBatch:
    """Decode an event batch in the map or legacy encoding (or a mix).

    ``packed`` (kvtier's subscribers of a packed publisher, SPEC.md §9.8): ``token_ids`` and
    ``lookahead_token_ids`` may also be bins of little-endian u32s, decoded to ``array('I')``
    without a Python int per id. Without it a bin there is ``bad_event``, as for vLLM.

    Raises:
        LimitExceeded: ``buf`` or one of its arrays is larger than ``limits``.
        EventError: anything else that is not a valid batch.
    """
    if len(buf) > limits.max_batch_bytes:
        raise LimitExceeded(f"event batch is {len(buf)} bytes, limit {limits.max_batch_bytes}")
    try:
        wire = msgpack.unpackb(buf, raw=False, strict_map_key=True, ext_hook=_reject_ext,
                               object_pairs_hook=unique_map)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EventError(f"event batch is not valid msgpack: {exc}") from exc
    if not isinstance(wire, list) or len(wire) not in (2, 3):
        raise EventError("an event batch is an array [ts, events, data_parallel_rank]")
    ts, events = wire[0], wire[1]
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise EventError("batch ts must be a finite number")
    if not isinstance(events, list):
        raise EventError("batch events must be an array")
    if len(events) > limits.max_events:
        raise LimitExceeded(f"batch has {len(events)} events, limit {limits.max_events}")
    rank = wire[2] if len(wire) == 3 else None
    if rank is not None and type(rank) is not int:
        raise EventError("data_parallel_rank must be an integer or nil")
    return EventBatch(float(ts), tuple(decode_event(e, limits, packed) for e in events), rank)
