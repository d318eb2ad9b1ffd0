"""Value checkers for the fields of data-plane messages (SPEC.md §7.3). Torch-free.

Each checker takes a value decoded from an untrusted msgpack header and the receiver's
:class:`~kvtier_protocol.frame_codec.Limits`, and returns the value in its typed form (arrays
become tuples) or raises :class:`InvalidRequest` / :class:`LimitExceeded`. Booleans are not
integers here, although Python says they are: msgpack keeps the two apart and so do we.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from kvtier_protocol.errors import InvalidRequest, LimitExceeded
from kvtier_protocol.frame_codec import U64_MAX, Limits

NS_ID_LEN = 16
MIN_HASH_LEN, MAX_HASH_LEN = 8, 64
MAX_TEXT_LEN = 1024
MAX_STATS_DEPTH = 4
PRIORITY_MIN, PRIORITY_MAX = -128, 127
DEFAULT_LEASE_MS = 30_000
TIER_NAMES = ("gpu", "host", "disk", "remote")
EXISTS = "exists"
PUT_RESULTS = ("stored", "exists", "full")
_TIER_SET = frozenset(TIER_NAMES)
_BYTES, _STR = frozenset((bytes,)), frozenset((str,))

SlotRef: TypeAlias = tuple[int, int, int]
"""``(segment, offset, length)``: a byte range of one shared host segment."""

Checker: TypeAlias = Callable[[str, Any, Limits], Any]


@dataclass(frozen=True, slots=True)
class Segment:
    """A shared host-memory segment handed to the client (its fd travels with SCM_RIGHTS)."""

    name: str
    size: int


def uint(name: str, value: Any, limits: Limits, lo: int = 0, hi: int = U64_MAX) -> int:
    if type(value) is not int:
        raise InvalidRequest(f"{name} must be an unsigned integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must lie in [{lo}, {hi}], got {value}")
    return value


def text(name: str, value: Any, limits: Limits) -> str:
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string, got {type(value).__name__}")
    if len(value) > MAX_TEXT_LEN:
        raise LimitExceeded(f"{name} is {len(value)} characters, limit {MAX_TEXT_LEN}")
    return value


def array(name: str, value: Any, limits: Limits) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):  # tuples: headers built in-process, not decoded
        raise InvalidRequest(f"{name} must be an array, got {type(value).__name__}")
    if len(value) > limits.max_batch:
        raise LimitExceeded(f"{name} has {len(value)} entries, limit {limits.max_batch}")
    return value


def binary(name: str, value: Any, lo: int, hi: int) -> bytes:
    if not isinstance(value, bytes):
        raise InvalidRequest(f"{name} must be bin, got {type(value).__name__}")
    if not lo <= len(value) <= hi:
        raise InvalidRequest(f"{name} must be {lo}..{hi} bytes, got {len(value)}")
    return value


def ns_id(name: str, value: Any, limits: Limits) -> bytes:
    return binary(name, value, NS_ID_LEN, NS_ID_LEN)


def hashes(name: str, value: Any, limits: Limits) -> tuple[bytes, ...]:
    value = array(name, value, limits)
    # Fast path (a lookup carries hundreds of hashes): one C-level pass over types and lengths;
    # anything unusual takes the per-item checks, which name the offending entry.
    if set(map(type, value)) <= _BYTES:
        lens = set(map(len, value))
        if not lens or (min(lens) >= MIN_HASH_LEN and max(lens) <= MAX_HASH_LEN):
            return tuple(value)
    return tuple(binary(name, h, MIN_HASH_LEN, MAX_HASH_LEN) for h in value)


def sizes(name: str, value: Any, limits: Limits) -> tuple[int, ...]:
    return tuple(record_len(name, v, limits) for v in array(name, value, limits))


def record_len(name: str, value: Any, limits: Limits) -> int:
    n = uint(name, value, limits, 1)
    if n > limits.max_payload_len:
        raise LimitExceeded(f"{name}: {n} bytes above limit {limits.max_payload_len}")
    return n


def lens(name: str, value: Any, limits: Limits) -> tuple[int | None, ...]:
    return tuple(None if v is None else record_len(name, v, limits)
                 for v in array(name, value, limits))


def lease_ms(name: str, value: Any, limits: Limits) -> int:
    n = uint(name, value, limits, 1)
    if n > limits.max_lease_ms:
        raise LimitExceeded(f"{name} {n} above limit {limits.max_lease_ms}")
    return n


def priority(name: str, value: Any, limits: Limits) -> int:
    if type(value) is not int or not PRIORITY_MIN <= value <= PRIORITY_MAX:
        raise InvalidRequest(f"{name} must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return value


def version(name: str, value: Any, limits: Limits) -> int:
    return uint(name, value, limits, 1, 0xFFFF)


def headers(name: str, value: Any, limits: Limits) -> tuple[bytes | None, ...]:
    value = array(name, value, limits)
    if set(map(type, value)) <= _BYTES:  # fast path, as in hashes: all present, all bin
        lens = set(map(len, value))
        if not lens or (min(lens) >= 1 and max(lens) <= limits.max_header_len):
            return tuple(value)
    return tuple(None if h is None else binary(name, h, 1, limits.max_header_len) for h in value)


def _slot(name: str, value: Any, limits: Limits) -> SlotRef | str | None:
    if value is None or value == EXISTS:
        return value
    if not isinstance(value, (list, tuple)) or len(value) != 3:
        raise InvalidRequest(f"{name}: a slot is [segment, offset, length], 'exists' or nil")
    segment, offset, length = (uint(name, v, limits) for v in value)
    if not 1 <= length <= limits.max_payload_len:
        raise InvalidRequest(f"{name}: slot length {length} out of range")
    return (segment, offset, length)


def slots(name: str, value: Any, limits: Limits) -> tuple[SlotRef | str | None, ...]:
    value = array(name, value, limits)
    # Fast path (every reserve and acquire answer carries one slot per block): a slot that is
    # three ints within range passes with a few C-level checks; anything else, the per-item checks.
    max_len, out = limits.max_payload_len, []
    for v in value:
        if type(v) is list and len(v) == 3:
            segment, offset, length = v
            if (type(segment) is int and type(offset) is int and type(length) is int
                    and 0 <= segment <= U64_MAX and 0 <= offset <= U64_MAX and 1 <= length <= max_len):
                out.append((segment, offset, length))
                continue
        out.append(_slot(name, v, limits))
    return tuple(out)


def tiers(name: str, value: Any, limits: Limits) -> tuple[str, ...]:
    value = array(name, value, limits)
    if set(map(type, value)) <= _STR and set(value) <= _TIER_SET:  # fast path, as in hashes
        return tuple(value)
    out = tuple(text(name, v, limits) for v in value)
    for t in out:
        if t not in TIER_NAMES:
            raise InvalidRequest(f"{name}: unknown tier {t!r}; tiers are {TIER_NAMES}")
    return out


def put_results(name: str, value: Any, limits: Limits) -> tuple[str, ...]:
    out = tuple(text(name, v, limits) for v in array(name, value, limits))
    for r in out:
        if r not in PUT_RESULTS:
            raise InvalidRequest(f"{name}: unknown result {r!r}; results are {PUT_RESULTS}")
    return out


def segments(name: str, value: Any, limits: Limits) -> tuple[Segment, ...]:
    out = []
    for entry in array(name, value, limits):
        if not isinstance(entry, dict):
            raise InvalidRequest(f"{name}: a segment is a map {{name, size}}")
        if "name" not in entry or "size" not in entry:
            raise InvalidRequest(f"{name}: a segment needs 'name' and 'size'")
        out.append(Segment(text(name, entry["name"], limits),
                           uint(name, entry["size"], limits, 1)))
    return tuple(out)


def limits_map(name: str, value: Any, limits: Limits) -> Limits:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be a map")
    kwargs = {}
    for key in Limits.__slots__:
        if key not in value:
            raise InvalidRequest(f"{name} lacks {key!r}")
        kwargs[key] = uint(f"{name}.{key}", value[key], limits, 1)
    if kwargs["max_header_len"] > 0xFFFF_FFFF:
        raise InvalidRequest(f"{name}.max_header_len must fit in u32")
    return Limits(**kwargs)


def stats_map(name: str, value: Any, limits: Limits, depth: int = 0) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidRequest(f"{name} must be a map")
    if depth >= MAX_STATS_DEPTH:
        raise LimitExceeded(f"{name} nests deeper than {MAX_STATS_DEPTH} maps")
    for key, item in value.items():
        if not isinstance(key, str):
            raise InvalidRequest(f"{name}: keys must be strings")
        if isinstance(item, dict):
            stats_map(f"{name}.{key}", item, limits, depth + 1)
        elif item is not None and not isinstance(item, (bool, int, float, str)):
            raise InvalidRequest(f"{name}.{key}: values are scalars or maps")
    return value


def unsigned(name: str, value: Any, limits: Limits) -> int:
    return uint(name, value, limits)


def flags(name: str, value: Any, limits: Limits) -> tuple[bool, ...]:
    """An array of booleans (msgpack true/false; integers are not booleans here)."""
    out = tuple(array(name, value, limits))
    for v in out:
        if not isinstance(v, bool):
            raise InvalidRequest(f"{name}: entries are true or false")
    return out


def positions(name: str, value: Any, limits: Limits) -> tuple[int, ...]:
    """Indices into a grant's slots (each below ``max_batch``, the most slots one grant has)."""
    return tuple(uint(name, v, limits, 0, limits.max_batch - 1) for v in array(name, value, limits))


CHECKERS: dict[str, Checker] = {
    "version": version, "client": text, "tenant": text, "token": text, "server": text,
    "limits": limits_map, "segments": segments, "fds": unsigned,
    "ns_id": ns_id, "hashes": hashes, "sizes": sizes, "lens": lens, "headers": headers,
    "lease": unsigned, "lease_ms": lease_ms, "priority": priority,
    "num_hits": unsigned, "tiers": tiers, "slots": slots, "results": put_results,
    "committed": unsigned, "deleted": unsigned, "stats": stats_map, "verified": flags,
    "positions": positions,
    # place's refill (SPEC 7.4 place): the keys of a grant, answered as a grant's are
    "grant_sizes": sizes, "grant_lease_ms": lease_ms, "grant_priority": priority,
    "grant_lease": unsigned, "grant_slots": slots,
}
"""Checker of every header field, by name: a name means the same thing in every message."""


def to_wire(value: Any) -> Any:
    """The msgpack form of a typed field value (Limits and Segment become maps)."""
    if isinstance(value, Limits):
        return value.to_wire()
    if isinstance(value, tuple) and value and isinstance(value[0], Segment):
        return [{"name": s.name, "size": s.size} for s in value]
    return value
