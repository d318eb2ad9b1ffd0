"""The client's operations as I/O-free flows, driven by the blocking and the asyncio client alike.

A flow is a generator: it yields :class:`~kvtier.client.calls.Call` objects (one request each;
one sent with ``wait=False`` is answered with a ticket, its response claimed later with
:class:`~kvtier.client.calls.Await`), receives the typed response
(``kvtier_protocol.frames.parse_response``) or has the call's error thrown in, and returns the
operation's result. The drivers own sockets, ids, deadlines and retries; the flows own what the
requests say, batching within the daemon's limits, the shared-memory copies and the checks on
what comes back. A flow has no ``yield`` in a ``finally`` block, so a driver may close it at any
point::

    save, unix socket:  copy payloads into granted slots -> place(headers) + grant    (granted.py)
                        or reserve(sizes) -> copy payloads into slots -> commit(headers) (pipelined,
    load, unix socket:  acquire -> copy records out, verify* -> release                 pipeline.py)
    save, TCP:          put(records inline)
    load, TCP:          get -> verify

    * payloads the daemon reports it checked are not hashed again (``ClientOptions.verify``)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

from kvtier_protocol.errors import FrameError, LimitExceeded
from kvtier_protocol.frames import SlotRef

from kvtier.client.calls import Await, Call, Flow, Ticket, expect_len
from kvtier.client.granted import shm_save_flow
from kvtier.client.pipeline import acquire_release_flow
from kvtier.client.records import Record, verified_record
from kvtier.client.session import Session

T = TypeVar("T")

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


def _put_batches(s: Session, records: list[Record]) -> Iterator[tuple[int, int]]:
    """``(start, end)`` ranges of records per put: within max_batch and max_payload_len."""
    budget = s.limits.max_payload_len
    start, used = 0, 0
    for i, rec in enumerate(records):
        size = rec.record.nbytes
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
    """Save records: over shared memory, copy into granted slots then place, or reserve/copy/
    commit (kvtier.client.granted); else put. Per key: "stored", "exists" or "full"."""
    for rec in records:
        if rec.record.nbytes > s.limits.max_payload_len:
            raise LimitExceeded(f"record of {rec.record.nbytes} bytes above the daemon's limit "
                                f"{s.limits.max_payload_len}")
    if s.shm is not None:
        extras = {"tokens": tokens, "unit_hashes": unit_hashes}
        return (yield from shm_save_flow(s, ns_id, records, extras, priority))
    results: list[str] = []
    for lo, hi in _put_batches(s, records):
        chunk = records[lo:hi]
        keys = {"ns_id": ns_id, "hashes": [rec.key for rec in chunk],
                "lens": [rec.record.nbytes for rec in chunk], "priority": priority,
                **_extras(tokens, unit_hashes, lo, hi)}
        r = yield Call("put", keys, payload=[rec.record for rec in chunk], commits=True)
        expect_len("put", r.results, len(chunk))
        results.extend(r.results)
    return results


def load_flow(s: Session, ns_id: bytes, hashes: list[bytes]) -> Flow[list[bytes]]:
    """Load the stored prefix of ``hashes`` as whole, verified records."""
    shm = s.shm
    if shm is None:
        return (yield from fetch_flow(s, ns_id, hashes,
                                      lambda i, key, record: verified_record(ns_id, key, record)))
    return (yield from acquire_flow(s, ns_id, hashes, lambda i, key, slot, header, checked: verified_record(
        ns_id, key, shm.read_record(header, slot), payload_checked=checked)))


def acquire_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeSlot[T],
                 sizes: Sequence[int] | None = None, settle: Callable[[], None] | None = None) -> Flow[list[T]]:
    """acquire → ``take(i, key, slot, header, checked)`` per leased block (i: index in ``hashes``; None
    ends the prefix: a miss) → ``settle()`` (copies the takes deferred, see
    ``kvtier.client.pipeline.acquire_release_flow``) → release (also after an error), pipelined in
    sub-batches (``sizes``: the most bytes each block can have, if known). Unix socket only."""
    return (yield from acquire_release_flow(s, ns_id, hashes, take, sizes, settle))


def fetch_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: TakeRecord[T]) -> Flow[list[T]]:
    """get (records inline) → ``take(i, key, record)`` per returned record (None: corrupt, the
    prefix ends there). TCP."""
    out: list[T] = []
    pos = 0
    while pos < len(hashes):
        chunk = hashes[pos:pos + s.limits.max_batch]
        r = yield Call("get", {"ns_id": ns_id, "hashes": chunk})
        expect_len("get", r.lens, len(chunk))
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



__all__ = ["NO_HITS", "Await", "Call", "Flow", "LookupResult", "TakeRecord", "TakeSlot", "Ticket",
           "acquire_flow", "delete_flow", "fetch_flow", "load_flow", "lookup_flow", "save_flow"]
