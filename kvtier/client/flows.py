"""The client's operations as I/O-free flows, driven by the blocking and the asyncio client alike.

A flow is a generator: it yields :class:`Call` objects (one request each), receives the typed
response (``kvtier_protocol.frames.parse_response``) or has the call's error thrown in, and
returns the operation's result. The drivers own sockets, ids, deadlines and retries; the flows
own what the requests say, batching within the daemon's limits, the shared-memory copies and the
checks on what comes back. A flow has no ``yield`` in a ``finally`` block, so a driver may close
it at any point::

    save, unix socket:  reserve(sizes) -> copy payloads into slots -> commit(headers)
    save, TCP:          put(records inline)
    load, unix socket:  acquire -> copy records out, verify* -> release (also after an error)
    load, TCP:          get -> verify

    * payloads the daemon reports it checked are not hashed again (``ClientOptions.verify``)
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias, TypeVar

from kvtier_protocol.errors import FrameError, KVTierError, LimitExceeded
from kvtier_protocol.frames import EXISTS, Payload, SlotRef

from kvtier.client.records import Record, verified_record
from kvtier.client.session import Session

T = TypeVar("T")

ACQUIRE_HEADER_BUDGET = 4096
"""Bytes of an acquire response's header map budgeted per key (one block header each), so that a
batch never exceeds the daemon's ``max_header_len``."""


@dataclass(frozen=True, slots=True)
class Call:
    """One request of a flow.

    Attributes:
        op: the operation.
        keys: the op-specific header keys, in wire order (the driver adds ``op`` and ``id``).
        payload: the frame payload (put only).
        best_effort: a failure is not raised into the flow, which receives None instead
            (releases: the daemon reclaims the lease anyway when it expires).
        commits: the request makes blocks visible; a save is not retried once it was sent.
    """

    op: str
    keys: dict[str, Any] = field(default_factory=dict)
    payload: Payload | None = None
    best_effort: bool = False
    commits: bool = False


Flow: TypeAlias = Generator[Call, Any, T]
TakeSlot: TypeAlias = Callable[[int, bytes, SlotRef, bytes, bool], "T | None"]
"""What a load does with one leased block: ``(index, key, slot, header, checked) -> item | None``;
``checked``: the daemon checked the slot's payload and the session trusts that (no hashing needed)."""
TakeRecord: TypeAlias = Callable[[int, bytes, memoryview], "T | None"]
"""What a load does with one record received inline: ``(index, key, record) -> item | None``."""


@dataclass(frozen=True, slots=True)
class LookupResult:
    """How much of a prefix the daemon holds.

    Attributes:
        num_hits: keys stored, counted from the first up to the first miss.
        tiers: the fastest tier holding each hit (``"gpu"``, ``"host"``, ``"disk"``, ``"remote"``).
    """

    num_hits: int
    tiers: tuple[str, ...] = ()


NO_HITS = LookupResult(0, ())
"""The shared result of a lookup that found nothing (or degraded)."""


def _batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _expect_len(op: str, got: Sequence[Any], want: int) -> None:
    if len(got) != want:
        raise FrameError(f"{op} response has {len(got)} entries for {want} keys")


def lookup_flow(s: Session, ns_id: bytes, hashes: list[bytes]) -> Flow[LookupResult]:
    """Lookup in batches of ``max_batch``, stopping at the first batch with a miss."""
    tiers: list[str] = []
    for chunk in _batches(hashes, s.limits.max_batch):
        r = yield Call("lookup", {"ns_id": ns_id, "hashes": list(chunk)})
        if r.num_hits > len(chunk):
            raise FrameError(f"lookup answered {r.num_hits} hits for {len(chunk)} keys")
        tiers.extend(r.tiers)
        if r.num_hits < len(chunk):
            break
    return LookupResult(len(tiers), tuple(tiers)) if tiers else NO_HITS


def _save_batches(s: Session, records: list[Record], inline: bool) -> Iterator[tuple[int, int]]:
    """``(start, end)`` ranges of records per request: within max_batch, and within
    max_payload_len (put payload) or half of max_header_len (commit headers)."""
    budget = s.limits.max_payload_len if inline else s.limits.max_header_len // 2
    start, used = 0, 0
    for i, rec in enumerate(records):
        size = rec.record.nbytes if inline else len(rec.header) + 64
        if i > start and (i - start == s.limits.max_batch or used + size > budget):
            yield start, i
            start, used = i, 0
        used += size
    if start < len(records):
        yield start, len(records)


def _extras(tokens: list | None, unit_hashes: list | None, lo: int, hi: int) -> dict[str, Any]:
    keys: dict[str, Any] = {}
    if tokens is not None:
        keys["tokens"] = tokens[lo:hi]
    if unit_hashes is not None:
        keys["unit_hashes"] = unit_hashes[lo:hi]
    return keys


def save_flow(s: Session, ns_id: bytes, records: list[Record], tokens: list | None,
              unit_hashes: list | None, priority: int) -> Flow[list[str]]:
    """Save records: reserve/copy/commit over shared memory, else put. Per key: "stored",
    "exists" or "full"."""
    for rec in records:
        if rec.record.nbytes > s.limits.max_payload_len:
            raise LimitExceeded(f"record of {rec.record.nbytes} bytes above the daemon's limit "
                                f"{s.limits.max_payload_len}")
    results: list[str] = []
    for lo, hi in _save_batches(s, records, inline=s.shm is None):
        chunk = records[lo:hi]
        hashes = [rec.key for rec in chunk]
        if s.shm is None:
            keys = {"ns_id": ns_id, "hashes": hashes, "lens": [rec.record.nbytes for rec in chunk],
                    "priority": priority, **_extras(tokens, unit_hashes, lo, hi)}
            r = yield Call("put", keys, payload=[rec.record for rec in chunk], commits=True)
            _expect_len("put", r.results, len(chunk))
            results.extend(r.results)
            continue
        r = yield Call("reserve", {"ns_id": ns_id, "hashes": hashes,
                                   "sizes": [rec.payload.nbytes for rec in chunk],
                                   "lease_ms": s.lease_ms, "priority": priority})
        _expect_len("reserve", r.slots, len(chunk))
        headers: list[bytes | None] = []
        outcome: list[str] = []
        try:
            for rec, slot in zip(chunk, r.slots):
                if slot is None or slot == EXISTS:
                    headers.append(None)
                    outcome.append("full" if slot is None else "exists")
                else:
                    s.shm.write(slot, rec.payload)
                    headers.append(rec.header)
                    outcome.append("stored")
        except KVTierError:
            if r.lease:
                yield Call("release", {"lease": r.lease}, best_effort=True)
            raise
        if any(h is not None for h in headers):
            keys = {"lease": r.lease, "headers": headers}
            for name, lists in _extras(tokens, unit_hashes, lo, hi).items():
                keys[name] = [v if h is not None else None for v, h in zip(lists, headers)]
            yield Call("commit", keys, commits=True)
        elif r.lease:
            yield Call("release", {"lease": r.lease}, best_effort=True)
        results.extend(outcome)
    return results


def load_flow(s: Session, ns_id: bytes, hashes: list[bytes]) -> Flow[list[bytes]]:
    """Load the stored prefix of ``hashes`` as whole, verified records."""
    shm = s.shm
    if shm is None:
        return (yield from fetch_flow(s, ns_id, hashes,
                                      lambda i, key, record: verified_record(ns_id, key, record)))
    return (yield from acquire_flow(s, ns_id, hashes, lambda i, key, slot, header, checked: verified_record(
        ns_id, key, shm.read_record(header, slot), payload_checked=checked)))


def acquire_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeSlot[T]) -> Flow[list[T]]:
    """acquire → ``take(i, key, slot, header, checked)`` per leased block (i: index in ``hashes``; None
    ends the prefix: a miss) → release (also after an error). Unix socket only."""
    out: list[T] = []
    size = max(1, min(s.limits.max_batch, s.limits.max_header_len // ACQUIRE_HEADER_BUDGET))
    for pos in range(0, len(hashes), size):
        chunk = hashes[pos:pos + size]
        r = yield Call("acquire", {"ns_id": ns_id, "hashes": list(chunk), "lease_ms": s.lease_ms})
        error: KVTierError | None = None
        found: list[T] = []
        try:
            _expect_len("acquire", r.slots, len(chunk))
            checked = r.verified if s.trust_checked and r.verified is not None else (False,) * len(chunk)
            for i, (key, slot, header, ok) in enumerate(zip(chunk, r.slots, r.headers, checked), pos):
                item = None if slot is None else take(i, key, slot, header, ok)
                if item is None:
                    break
                found.append(item)
        except KVTierError as exc:
            error = exc
        if r.lease:  # always release, also after an error; a lost release expires on its own
            yield Call("release", {"lease": r.lease}, best_effort=True)
        if error is not None:
            raise error
        out.extend(found)
        if len(found) < len(chunk):
            break
    return out


def fetch_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeRecord[T]) -> Flow[list[T]]:
    """get (records inline) → ``take(i, key, record)`` per returned record (None: corrupt, the
    prefix ends there). TCP."""
    out: list[T] = []
    pos = 0
    while pos < len(hashes):
        chunk = hashes[pos:pos + s.limits.max_batch]
        r = yield Call("get", {"ns_id": ns_id, "hashes": chunk})
        _expect_len("get", r.lens, len(chunk))
        found, corrupt = 0, False
        for i, (key, record) in enumerate(zip(chunk, r.records()), pos):
            if record is None:
                break
            item = take(i, key, record)
            if item is None:
                corrupt = True
                break
            out.append(item)
            found += 1
        pos += found
        if found == len(chunk):
            continue
        # The daemon answers nil for records that no longer fit its max_payload_len: a nil right
        # after a nearly full payload may be that cap, not a miss, so ask again from there.
        sent = sum(n or 0 for n in r.lens)
        if corrupt or found == 0 or sent + max(n or 0 for n in r.lens) <= s.limits.max_payload_len:
            break
    return out


def delete_flow(s: Session, ns_id: bytes, hashes: list[bytes]) -> Flow[int]:
    """Drop keys from every tier; returns how many existed."""
    deleted = 0
    for chunk in _batches(hashes, s.limits.max_batch):
        r = yield Call("delete", {"ns_id": ns_id, "hashes": list(chunk)})
        deleted += r.deleted
    return deleted

