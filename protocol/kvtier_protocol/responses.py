"""Typed responses of the data plane, one per operation (SPEC.md §7.3); see messages.py.

A successful response header is ``op``, ``id``, ``ok: true``, then the fields below in order.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvtier_protocol.errors import FrameError, InvalidRequest
from kvtier_protocol.frame_codec import Limits, Payload
from kvtier_protocol.messages import OPS, Message, payload_len, same_len, split_records
from kvtier_protocol.wire_checks import EXISTS, Segment, SlotRef

PLACE_GRANT = "place_grant"
"""A hello ``features`` name: the server takes ``place`` with ``grant_sizes`` (the refill of a
client's granted slots, SPEC.md 7.4), so a stream of saves costs one request each, not two."""
QUIET_RELEASE = "quiet_release"
"""A hello ``features`` name: the server takes ``release`` with ``quiet`` true and answers it
with nothing (SPEC.md 7.4), so a client that never waits for a release neither reads its answer
nor makes the server write one."""


@dataclass(frozen=True, slots=True)
class HelloResponse(Message):
    """Server version, limits, and the host segments (fds follow by SCM_RIGHTS on unix)."""

    OP: ClassVar[str] = "hello"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    version: int
    server: str
    limits: Limits
    segments: tuple[Segment, ...]  # index in this list = the segment number in slots
    fds: int  # descriptors attached to this frame: len(segments) on unix sockets, 0 on TCP
    # What the server does beyond this version's baseline (SPEC 7.4 hello), e.g. QUIET_RELEASE;
    # a client ignores names it does not know. None: nothing (servers before the key).
    features: tuple[str, ...] | None = None

    def _check(self, limits: Limits) -> None:
        if self.fds not in (0, len(self.segments)):
            raise InvalidRequest("hello: fds must be 0 or the number of segments")


@dataclass(frozen=True, slots=True)
class LookupResponse(Message):
    """Length of the stored prefix and the tier of each hit."""

    OP: ClassVar[str] = "lookup"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    num_hits: int  # consecutive keys stored, from the first
    tiers: tuple[str, ...]  # tier of each hit ("gpu", "host", "disk", "remote")

    def _check(self, limits: Limits) -> None:
        if self.num_hits != len(self.tiers):
            raise InvalidRequest("lookup: num_hits must equal the number of tiers")


@dataclass(frozen=True, slots=True)
class ReserveResponse(Message):
    """The lease and, per key, a slot to write, "exists", or nil when there is no room."""

    OP: ClassVar[str] = "reserve"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    lease: int  # 0 when nothing was reserved
    slots: tuple[SlotRef | str | None, ...]  # per key: slot, "exists", or nil (no room)


@dataclass(frozen=True, slots=True)
class CommitResponse(Message):
    """How many blocks the commit made visible."""

    OP: ClassVar[str] = "commit"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    committed: int  # blocks made visible


@dataclass(frozen=True, slots=True)
class AcquireResponse(Message):
    """The lease pinning the found blocks, with their slots and block headers."""

    OP: ClassVar[str] = "acquire"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    lease: int  # 0 when nothing was acquired
    slots: tuple[SlotRef | None, ...]  # per key: slot holding the payload, or nil (missing)
    headers: tuple[bytes | None, ...]  # per key: the encoded block header, or nil (missing)
    # per key: the daemon checked this slot's payload against the header's checksum after it was
    # written (SPEC §7.4, acquire); absent means no block was checked
    verified: tuple[bool, ...] | None = None

    def _check(self, limits: Limits) -> None:
        same_len(self.OP, slots=self.slots, headers=self.headers)
        for slot, header in zip(self.slots, self.headers):
            if slot == EXISTS or (slot is None) != (header is None):
                raise InvalidRequest("acquire: slot and header must both be set or both nil")
        if self.verified is not None:
            same_len(self.OP, slots=self.slots, verified=self.verified)
            if any(v and s is None for v, s in zip(self.verified, self.slots)):
                raise InvalidRequest("acquire: verified is false where slots is nil")


@dataclass(frozen=True, slots=True)
class ReleaseResponse(Message):
    """The lease has ended."""

    OP: ClassVar[str] = "release"
    IS_RESPONSE: ClassVar[bool] = True
    id: int


@dataclass(frozen=True, slots=True)
class PutResponse(Message):
    """Per key: "stored", "exists" or "full"."""

    OP: ClassVar[str] = "put"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    results: tuple[str, ...]  # per key: "stored", "exists" or "full"


@dataclass(frozen=True, slots=True)
class GetResponse(Message):
    """Records of the found keys back to back in the payload; nil lens for missing keys."""

    OP: ClassVar[str] = "get"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    lens: tuple[int | None, ...]
    # Optional (SPEC 7.4 get): per key, the codec of the stored copy this record was decoded from
    # at the request's ``decode`` (``"raw"``: it was only compressed, exact; any other: lossy in
    # value), nil where the record is sent as stored or missing. Absent: no record was decoded.
    decoded: tuple[str | None, ...] | None = None
    payload: Payload = field(default=b"", kw_only=True)

    def frame_payload(self) -> Payload | None:
        return self.payload

    def records(self) -> list[memoryview | None]:
        """One record view per requested key, None for a missing key."""
        return split_records(self.payload, self.lens)

    def _check(self, limits: Limits) -> None:
        total = sum(n or 0 for n in self.lens)
        if total != payload_len(self.payload):
            raise FrameError(f"get: lens sum to {total}, payload is {payload_len(self.payload)}")
        if self.decoded is not None:
            same_len(self.OP, lens=self.lens, decoded=self.decoded)
            if any(d is not None and n is None for d, n in zip(self.decoded, self.lens)):
                raise InvalidRequest("get: decoded is nil where lens is nil")


@dataclass(frozen=True, slots=True)
class DeleteResponse(Message):
    """How many blocks existed and were dropped."""

    OP: ClassVar[str] = "delete"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    deleted: int


@dataclass(frozen=True, slots=True)
class ClearResponse(Message):
    """How many blocks of the namespace were dropped."""

    OP: ClassVar[str] = "clear"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    deleted: int


@dataclass(frozen=True, slots=True)
class StatsResponse(Message):
    """Informative counters and gauges of the daemon."""

    OP: ClassVar[str] = "stats"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    stats: dict[str, Any]  # informative counters; names are not part of the contract


@dataclass(frozen=True, slots=True)
class PingResponse(Message):
    """The answer to a ping."""

    OP: ClassVar[str] = "ping"
    IS_RESPONSE: ClassVar[bool] = True
    id: int


@dataclass(frozen=True, slots=True)
class GrantResponse(Message):
    """The grant and, per size asked, a slot to write, or nil when there is no room."""

    OP: ClassVar[str] = "grant"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    lease: int  # 0 when no slot was granted
    slots: tuple[SlotRef | str | None, ...]  # per size: slot, or nil (no room; every later one too)

    def _check(self, limits: Limits) -> None:
        if any(s == EXISTS for s in self.slots):
            raise InvalidRequest("grant: slots are slots or nil")


@dataclass(frozen=True, slots=True)
class PlaceResponse(Message):
    """Per key: "stored" (visible now), "exists" (already stored: its slot was freed) or "full"
    (not stored: refused by the daemon's verification or write-through)."""

    OP: ClassVar[str] = "place"
    IS_RESPONSE: ClassVar[bool] = True
    id: int
    results: tuple[str, ...]
    # The refill's grant (a place with grant_sizes): as a grant response's lease and slots
    # (lease 0, slots absent: no slot could be given, or the refill was refused).
    grant_lease: int | None = None
    grant_slots: tuple[SlotRef | str | None, ...] | None = None

    def _check(self, limits: Limits) -> None:
        if self.grant_slots is not None and any(s == EXISTS for s in self.grant_slots):
            raise InvalidRequest("place: grant_slots are slots or nil")
        if self.grant_slots is not None and not self.grant_lease:
            raise InvalidRequest("place: grant_slots come with a grant_lease")


Response = (HelloResponse | LookupResponse | ReserveResponse | CommitResponse | AcquireResponse
            | ReleaseResponse | PutResponse | GetResponse | DeleteResponse | ClearResponse
            | StatsResponse | PingResponse | GrantResponse | PlaceResponse)
RESPONSES: dict[str, type[Message]] = {c.OP: c for c in Response.__args__}  # type: ignore
assert tuple(RESPONSES) == OPS, "every op has a request and a response, in the same order"
