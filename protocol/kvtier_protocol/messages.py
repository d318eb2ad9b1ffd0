"""Typed requests of the data plane and the base of every message (SPEC.md §7.3).

Every message is a frozen dataclass whose fields, after ``id``, are the op-specific header keys
in wire order; a field with a default is optional on the wire (omitted when None). ``payload``,
where present, is the frame payload, never a header key. Checkers for each key live in
:mod:`kvtier_protocol.wire_checks` (those of the optional ``tokens`` / ``unit_hashes`` keys of commit
and put are defined here and registered there); cross-field rules in each class's ``_check``.
Torch-free.
"""

from __future__ import annotations

import functools
import sys
from array import array as IntArray
from dataclasses import MISSING, Field, dataclass, field, fields
from collections.abc import Sequence
from typing import Any, ClassVar

from kvtier_protocol.errors import FrameError, InvalidRequest, LimitExceeded
from kvtier_protocol.frame_codec import Limits, Payload
from kvtier_protocol.wire_checks import (CHECKERS, DEFAULT_LEASE_MS, MAX_HASH_LEN, MIN_HASH_LEN,
                                         array, binary, text, to_wire, uint)

TokenIds = tuple[Sequence[int] | None, ...]
"""``tokens`` of a request: per key, nil or its ids — as decoded, an ``array.array`` (:func:`token_lists`);
as a client builds a request, any sequence of ints."""
MAX_TOKEN_ID = (1 << 63) - 1
"""Largest token id ``tokens`` accepts (engines keep token ids in int32/int64)."""
MAX_KEY_TOKENS = 65536
"""Most entries of one key's ``tokens`` or ``unit_hashes`` (a namespace's largest block_tokens,
SPEC §2.1; kept here so the frame layer does not import the namespace module)."""


class Message:
    """Base of every request and response: header encoding and decoding by field name."""

    __slots__ = ()
    OP: ClassVar[str]
    IS_RESPONSE: ClassVar[bool] = False
    id: int

    def to_header(self) -> dict[str, Any]:
        """The header map: ``op``, ``id``, ``ok`` (responses), then the fields in wire order."""
        header: dict[str, Any] = {"op": self.OP, "id": self.id}
        if self.IS_RESPONSE:
            header["ok"] = True
        for f in wire_fields(type(self)):
            value = getattr(self, f.name)
            if value is not None:
                # decoded token ids are arrays (token_lists), which msgpack does not take
                header[f.name] = _ids_to_wire(value) if f.name == "tokens" else to_wire(value)
        return header

    def frame_payload(self) -> Payload | None:
        """The frame payload: ``payload`` for put requests and get responses, else None."""
        return None

    @classmethod
    def from_header(cls, header: dict[str, Any], payload: memoryview | None,
                    limits: Limits) -> Message:
        """Build from a decoded header whose ``id`` the frame decoder already checked.

        Raises:
            InvalidRequest: a required key is missing or nil, or a value is wrong.
            LimitExceeded: an array or length is above ``limits``.
            FrameError: the frame carries a payload the op does not take, or lacks one it needs.
        """
        kwargs: dict[str, Any] = {"id": header["id"]}
        for f in wire_fields(cls):
            value = header.get(f.name)
            if value is None:
                if f.default is MISSING:
                    raise InvalidRequest(f"{cls.OP}: missing required key {f.name!r}")
                continue
            kwargs[f.name] = CHECKERS[f.name](f.name, value, limits)
        if "payload" in cls.__dataclass_fields__:  # type: ignore[attr-defined]
            if payload is None:
                raise FrameError(f"{cls.OP} needs a payload")
            kwargs["payload"] = payload
        elif payload is not None:
            raise FrameError(f"{cls.OP} takes no payload")
        message = cls(**kwargs)
        message._check(limits)
        return message

    def _check(self, limits: Limits) -> None:
        """Cross-field rules; raises InvalidRequest or FrameError."""


@functools.cache
def wire_fields(cls: type) -> tuple[Field, ...]:
    """The dataclass fields that are header keys, in wire order."""
    return tuple(f for f in fields(cls) if f.name not in ("id", "payload"))


def same_len(op: str, **arrays: tuple[Any, ...]) -> None:
    """Raise InvalidRequest unless the per-key arrays of ``op`` have one length."""
    counts = {name: len(a) for name, a in arrays.items()}
    if len(set(counts.values())) > 1:
        raise InvalidRequest(f"{op}: arrays must have equal lengths, got {counts}")


def payload_len(payload: Payload) -> int:
    """Bytes in a payload given as one buffer or as a sequence of buffers."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return memoryview(payload).nbytes
    return sum(memoryview(p).nbytes for p in payload)


def split_records(payload: Payload, lengths: tuple[int | None, ...]) -> list[memoryview | None]:
    """Cut a put/get payload into its block records; None where ``lengths`` has nil."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        parts = iter(payload)
        return [None if n is None else memoryview(next(parts)) for n in lengths]
    view, pos, out = memoryview(payload), 0, []
    for n in lengths:
        out.append(None if n is None else view[pos:pos + n])
        pos += n or 0
    return out


def _per_key(name: str, value: Any, limits: Limits, convert: Any) -> tuple[Any, ...]:
    """An array of one entry per key, each nil or a non-empty array, given to ``convert``
    (which checks its values and returns what the message keeps)."""
    out = []
    for entry in array(name, value, limits):
        if entry is None:
            out.append(None)
            continue
        if not isinstance(entry, (list, tuple)) or not entry:
            raise InvalidRequest(f"{name}: each entry is nil or a non-empty array")
        if len(entry) > MAX_KEY_TOKENS:
            raise LimitExceeded(f"{name}: {len(entry)} entries for one key, limit {MAX_KEY_TOKENS}")
        out.append(convert(entry))
    return tuple(out)


def token_lists(name: str, value: Any, limits: Limits) -> tuple[IntArray | None, ...]:
    """``tokens``: per key, nil or the block's token ids (uint below 2**63), as an ``array`` of
    type ``"I"`` (ids below 2**32, the common case) or ``"Q"``.

    An array, not a tuple of ints: the ids are checked and packed in C (``array.array`` refuses
    what is not an integer in range), so a 256-token block costs ~5 µs here instead of 40-80 µs of
    a Python call per id, and the event hub takes the array as it is.
    """
    return _per_key(name, value, limits, lambda entry: _token_ids(name, entry))


def _ids_to_wire(tokens: TokenIds) -> list[Any]:
    return [ids.tolist() if isinstance(ids, IntArray) else ids for ids in tokens]


def _token_ids(name: str, entry: list[Any] | tuple[Any, ...]) -> IntArray:
    """One key's token ids, checked as :func:`~kvtier_protocol.wire_checks.uint` checks one."""
    try:
        try:
            ids = IntArray("I", entry)
        except OverflowError:  # an id of 32 bits or more, or a negative one ('Q' refuses it too)
            ids = IntArray("Q", entry)
    except OverflowError:
        raise InvalidRequest(f"{name} must lie in [0, {MAX_TOKEN_ID}]") from None
    except TypeError:
        raise InvalidRequest(f"{name} must be unsigned integers") from None
    if ids.typecode == "Q" and max(ids) > MAX_TOKEN_ID:
        raise InvalidRequest(f"{name} must lie in [0, {MAX_TOKEN_ID}], got {max(ids)}")
    # msgpack's true and false arrive as bools, which array takes as 1 and 0. Only a block holding
    # a 0 or a 1 (its bytes searched in C; a match across two ids only costs the exact look) has
    # its elements' types looked at.
    raw = ids.tobytes()
    zero, one = _ZERO_ONE[ids.itemsize]
    if zero in raw or one in raw:
        for v in entry:
            if type(v) is not int:
                raise InvalidRequest(f"{name} must be unsigned integers, got {type(v).__name__}")
    return ids


_ZERO_ONE = {n: (bytes(n), (1).to_bytes(n, sys.byteorder)) for n in (2, 4, 8)}
"""Per item size of an id array, the bytes of a 0 and of a 1 as the array holds them."""


def unit_hash_lists(name: str, value: Any,
                    limits: Limits) -> tuple[tuple[bytes, ...] | None, ...]:
    """``unit_hashes``: per key, nil or the block's hash-unit digests, first unit first."""
    return _per_key(name, value, limits,
                    lambda entry: tuple(binary(name, h, MIN_HASH_LEN, MAX_HASH_LEN) for h in entry))


def boolean(name: str, value: Any, limits: Limits) -> bool:
    """A msgpack true or false (an integer is not a boolean here)."""
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} is true or false, got {type(value).__name__}")
    return value


def decoded_codecs(name: str, value: Any, limits: Limits) -> tuple[str | None, ...]:
    """Per key of a get response, the codec of the stored copy the daemon decoded (a text of at
    most MAX_TEXT_LEN characters: codecs newer than this reader are kept as names), or nil."""
    return tuple(None if v is None else text(name, v, limits) for v in array(name, value, limits))


# Registered with the other checkers so that a key name keeps one meaning in every message.
def text_list(name: str, value: Any, limits: Limits) -> tuple[str, ...]:
    """An array of texts (a hello response's ``features``)."""
    return tuple(text(name, v, limits) for v in array(name, value, limits))


CHECKERS.update(tokens=token_lists, unit_hashes=unit_hash_lists, accept_lossy=boolean, decode=boolean,
                decoded=decoded_codecs, quiet=boolean, features=text_list)


def check_token_info(op: str, num_keys: int, tokens: TokenIds | None,
                     unit_hashes: tuple[tuple[bytes, ...] | None, ...] | None) -> None:
    """Cross-field rules of the optional ``tokens`` / ``unit_hashes`` keys of commit and put.

    Raises:
        InvalidRequest: not one entry per key; unit hashes for a key without tokens; token
            count not a multiple of the unit count.
    """
    for name, arr in (("tokens", tokens), ("unit_hashes", unit_hashes)):
        if arr is not None and len(arr) != num_keys:
            raise InvalidRequest(f"{op}: {name} has {len(arr)} entries for {num_keys} keys")
    if unit_hashes is None:
        return
    for i, units in enumerate(unit_hashes):
        if units is None:
            continue
        toks = tokens[i] if tokens is not None else None
        if toks is None:
            raise InvalidRequest(f"{op}: unit_hashes[{i}] is given without tokens[{i}]")
        if len(toks) % len(units):
            raise InvalidRequest(f"{op}: {len(toks)} tokens do not split into "
                                 f"{len(units)} equal hash units (key {i})")


# --- requests ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HelloRequest(Message):
    """First request on a connection: version, identity, credentials."""

    OP: ClassVar[str] = "hello"
    id: int
    version: int  # protocol version the client speaks
    client: str  # free-form client name, for logs
    tenant: str | None = None  # tenant whose segments the client wants (None: the default pool)
    token: str | None = field(default=None, repr=False)  # shared secret; kept out of logs


@dataclass(frozen=True, slots=True)
class LookupRequest(Message):
    """How many of ``hashes``, from the first, are stored, and in which tier."""

    OP: ClassVar[str] = "lookup"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    # Optional (SPEC 7.4, issue 25): false counts exact copies only (codec raw); a lossy stored
    # copy is then a miss. Absent: the daemon's default for the store (true unless configured).
    accept_lossy: bool | None = None


@dataclass(frozen=True, slots=True)
class ReserveRequest(Message):
    """Reserve host slots for new blocks (put over shared memory, step 1)."""

    OP: ClassVar[str] = "reserve"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    sizes: tuple[int, ...]  # payload length per key (the header travels in commit)
    lease_ms: int = DEFAULT_LEASE_MS
    priority: int = 0  # higher is kept longer

    def _check(self, limits: Limits) -> None:
        same_len(self.OP, hashes=self.hashes, sizes=self.sizes)


@dataclass(frozen=True, slots=True)
class CommitRequest(Message):
    """Publish reserved slots the client has filled (put over shared memory, step 2)."""

    OP: ClassVar[str] = "commit"
    id: int
    lease: int
    headers: tuple[bytes | None, ...]  # encoded block header per reserved key; nil: not written
    # Optional, for KV events only (llm-d recomputes keys from token ids): per key, the block's
    # token ids and its hash-unit digests (the last one equals the key); nil where unknown.
    tokens: TokenIds | None = None
    unit_hashes: tuple[tuple[bytes, ...] | None, ...] | None = None

    def _check(self, limits: Limits) -> None:
        check_token_info(self.OP, len(self.headers), self.tokens, self.unit_hashes)


@dataclass(frozen=True, slots=True)
class AcquireRequest(Message):
    """Pin stored blocks in host slots for reading (get over shared memory)."""

    OP: ClassVar[str] = "acquire"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    lease_ms: int = DEFAULT_LEASE_MS
    accept_lossy: bool | None = None  # as in LookupRequest


@dataclass(frozen=True, slots=True)
class ReleaseRequest(Message):
    """End a lease taken by reserve (without commit) or acquire."""

    OP: ClassVar[str] = "release"
    id: int
    lease: int
    # True: answered with nothing, success or error (SPEC 7.4 release) — only to a daemon whose
    # hello announced ``quiet_release`` (:data:`kvtier_protocol.responses.QUIET_RELEASE`).
    quiet: bool | None = None


@dataclass(frozen=True, slots=True)
class PutRequest(Message):
    """Store blocks sent inline (TCP path): the payload is the records back to back."""

    OP: ClassVar[str] = "put"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    lens: tuple[int | None, ...]  # record length per key; never nil in a put
    priority: int = 0
    # Optional, for KV events only: as in CommitRequest.
    tokens: TokenIds | None = None
    unit_hashes: tuple[tuple[bytes, ...] | None, ...] | None = None
    payload: Payload = field(default=b"", kw_only=True)

    def frame_payload(self) -> Payload | None:
        return self.payload

    def records(self) -> list[memoryview | None]:
        """The payload cut into one block record per key."""
        return split_records(self.payload, self.lens)

    def _check(self, limits: Limits) -> None:
        same_len(self.OP, hashes=self.hashes, lens=self.lens)
        if any(n is None for n in self.lens):
            raise InvalidRequest("put: lens must not contain nil")
        total = sum(n or 0 for n in self.lens)
        if total != payload_len(self.payload):
            raise FrameError(f"put: lens sum to {total}, payload is {payload_len(self.payload)}")
        check_token_info(self.OP, len(self.hashes), self.tokens, self.unit_hashes)
        for i, units in enumerate(self.unit_hashes or ()):
            if units is not None and units[-1] != self.hashes[i]:
                raise InvalidRequest(f"put: the last of unit_hashes[{i}] is not the key")


@dataclass(frozen=True, slots=True)
class GetRequest(Message):
    """Fetch blocks inline (TCP path)."""

    OP: ClassVar[str] = "get"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    accept_lossy: bool | None = None  # as in LookupRequest
    # Optional (SPEC 7.4 get, issue 25): true asks the daemon to return each lossy or compressed
    # stored record decoded into a raw record of its dtype (the response's ``decoded`` says which).
    # Absent (None) is false: the records as stored, the frame every daemon before the key reads.
    decode: bool | None = None


@dataclass(frozen=True, slots=True)
class DeleteRequest(Message):
    """Drop blocks from every tier."""

    OP: ClassVar[str] = "delete"
    id: int
    ns_id: bytes
    hashes: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class ClearRequest(Message):
    """Drop every block of one namespace from every tier."""

    OP: ClassVar[str] = "clear"
    id: int
    ns_id: bytes


@dataclass(frozen=True, slots=True)
class StatsRequest(Message):
    """Counters and gauges of the daemon."""

    OP: ClassVar[str] = "stats"
    id: int


@dataclass(frozen=True, slots=True)
class PingRequest(Message):
    """Liveness and round-trip probe."""

    OP: ClassVar[str] = "ping"
    id: int


@dataclass(frozen=True, slots=True)
class GrantRequest(Message):
    """Reserve host slots before their keys are known (put over shared memory in one round trip:
    the client copies into granted slots at once and names the keys in ``place``)."""

    OP: ClassVar[str] = "grant"
    id: int
    sizes: tuple[int, ...]  # payload length of each slot
    lease_ms: int = DEFAULT_LEASE_MS
    priority: int = 0  # eviction class of the blocks placed into these slots


@dataclass(frozen=True, slots=True)
class PlaceRequest(Message):
    """Publish blocks written into granted slots: key ``hashes[i]`` is in slot ``positions[i]``
    of grant ``lease`` (an index into the grant's ``sizes``)."""

    OP: ClassVar[str] = "place"
    id: int
    lease: int
    ns_id: bytes
    hashes: tuple[bytes, ...]
    positions: tuple[int, ...]
    headers: tuple[bytes | None, ...]  # encoded block header per key (never nil in a place)
    tokens: TokenIds | None = None  # as in commit (SPEC 7.4.1)
    unit_hashes: tuple[tuple[bytes, ...] | None, ...] | None = None
    # The refill: after the place, grant slots of these sizes as a ``grant`` of them would (its
    # lease and slots come in the response), so that a stream of saves makes one request each.
    # Only to a daemon whose hello announced PLACE_GRANT.
    grant_sizes: tuple[int, ...] | None = None
    grant_lease_ms: int | None = None  # as grant's lease_ms (absent: its default)
    grant_priority: int | None = None  # as grant's priority (absent: 0)

    def _check(self, limits: Limits) -> None:
        if self.grant_sizes is None and (self.grant_lease_ms is not None or self.grant_priority is not None):
            raise InvalidRequest("place: grant_lease_ms and grant_priority need grant_sizes")
        same_len(self.OP, hashes=self.hashes, positions=self.positions, headers=self.headers)
        if any(h is None for h in self.headers):
            raise InvalidRequest("place: every key has a header")
        check_token_info(self.OP, len(self.headers), self.tokens, self.unit_hashes)


Request = (HelloRequest | LookupRequest | ReserveRequest | CommitRequest | AcquireRequest
           | ReleaseRequest | PutRequest | GetRequest | DeleteRequest | ClearRequest
           | StatsRequest | PingRequest | GrantRequest | PlaceRequest)
REQUESTS: dict[str, type[Message]] = {c.OP: c for c in Request.__args__}  # type: ignore
OPS = tuple(REQUESTS)
"""Every operation, in SPEC order."""
