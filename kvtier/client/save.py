"""Every way a save goes, in one place: its checks, then one of three flows (SPEC.md §7.4).

:func:`prepare_save` checks a save's arguments (and splits its records) once, before anything is
sent; :func:`save_flow` then picks the flow, which the driver runs (kvtier.client.steps)::

    save_flow ─┬─ TCP:                 put_flow            put(records inline)
               └─ unix socket: granted_save_flow ─┬─ the pool holds the slots:
                                                  │    [grant(refill)] ── copy into granted slots ── place
                                                  └─ else: reserve_commit_flow
                                                       reserve ── copy into the slots ── commit

**Granted slots.** A save over shared memory that had to ask for its slots (``reserve``) waits
for them, copies, then commits: two round trips. With a pool of slots granted ahead of time
(``grant``: slots of a given size with no key yet; the pool is kvtier.client.grants), a save
copies at once into slots it holds and names their keys in one ``place``; and it sends the
``grant`` that refills the pool for the *next* save of that size first, so that the daemon
makes it while the client copies. From the second save of a stream on the only round trip left
is the place, and with write-behind not even that::

    reserve/commit save:  reserve ── copy ── commit         (+ grant sent behind the reserve)
    granted save:         grant ─┬─ copy into pool slots ── place
                                 └─ (the daemon grants the next save's slots while the client copies)

Results are those of the reserve path, with one difference: a granted save learns that a key was
already stored only from the place answer, after copying its payload; a write-behind save does
not wait for that answer, and reports such keys "stored" (they are: by an earlier save).

**Pipelines.** With ``ClientOptions.pipeline_bytes`` > 0, a reserve/commit save is cut into
sub-batches of about that much payload, and the requests of one sub-batch travel while the
client copies another, so the copies run back to back::

    reserve 0 ─┐
    reserve 1 ─┼─ copy 0 ─ commit 0 ─┐            (commits are not waited for:
    reserve 2 ─┴────────── copy 1 ─ commit 1 ─ ... all their answers are collected
                                                   before the save returns)

With ``pipeline_bytes`` 0 the same flow sends one request batch at a time and waits for each
answer, except releases.

**Write-behind** (``ClientOptions.write_behind``): a save's commits (or places) are sent
``behind`` and never awaited by the save, which returns once the last payload is in shared
memory. The connection claims their answers before the client's next request that reads
(kvtier.client.steps.BLIND_OPS), so a client always reads its own writes, and holds the last
commit back until the next request (or ``kvtier.client.behind.FLUSH_AFTER_S``): the next save's
reserve is then written first, in the same write, and the daemon grants its slots before it makes
the previous blocks visible, while the client copies::

    save k:    reserve k ── copy k ── commit k (held back)
    save k+1:  [reserve k+1, commit k] ── copy k+1 ── commit k+1 (held back) ...

Results, their order and errors are those of one request at a time: the daemon answers requests
in any order, but a flow claims every answer it needs by ticket, and no request it sends depends
on another still in flight (a commit follows the answer to its reserve). A failure leaves nothing
half done that the daemon does not undo itself: a reservation never committed is released by the
driver (forgotten tickets) or, at the latest, when its lease expires or the connection ends.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from kvtier_protocol.errors import CapacityError, InvalidKey, InvalidRequest, KVTierError, LimitExceeded
from kvtier_protocol.frames import EXISTS
from kvtier_protocol.messages import check_token_info
from kvtier_protocol.wire_checks import PRIORITY_MAX, PRIORITY_MIN

from kvtier.client.errors import ConnectionLost
from kvtier.client.grants import Granted, GrantPool
from kvtier.client.records import Block, Record, check_ns_id, prepare_records
from kvtier.client.session import MIN_INFLIGHT, Session
from kvtier.client.steps import Await, Call, Flow, FlowFactory, Ticket, expect_len

COMMITS_IN_FLIGHT = 4
"""Commits a pipelined save leaves unanswered before it waits for the oldest (bounds requests in
flight)."""

Extras = dict[str, "list | None"]
"""Per-record lists a save passes on with its keys (``tokens``, ``unit_hashes``), or None."""


# -- the arguments ------------------------------------------------------------------------------


def prepare_save(ns_id: bytes, blocks: Sequence[Block], *, tokens: Sequence[Any] | None = None,
                 unit_hashes: Sequence[Any] | None = None, priority: int = 0) -> FlowFactory:
    """Check a save's arguments and split its records (nothing is sent); returns what starts its
    flow on a session.

    Raises:
        InvalidKey, InvalidRequest, HeaderError: malformed keys, records, token info or priority.
    """
    ns_id = check_ns_id(ns_id)
    records = prepare_records(ns_id, blocks)
    token_lists = _per_block("tokens", tokens, len(records), _token)
    unit_lists = _per_block("unit_hashes", unit_hashes, len(records), _unit_hash)
    _check_token_info(records, token_lists, unit_lists)
    if type(priority) is not int or not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        raise InvalidRequest(f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]")
    return lambda s: save_flow(s, ns_id, records, token_lists, unit_lists, priority)


def _per_block(name: str, values: Sequence[Any] | None, n: int, item: Callable[[Any], Any]) -> list | None:
    if values is None:
        return None
    if len(values) != n:
        raise InvalidRequest(f"{name} has {len(values)} entries for {n} blocks")
    return [None if v is None else [item(x) for x in v] for v in values]


def _token(value: Any) -> int:
    try:
        token = operator.index(value)  # numpy and torch integers too, never floats
    except TypeError:
        token = -1
    if isinstance(value, bool) or token < 0:
        raise InvalidRequest(f"token ids are non-negative integers, got {value!r}")
    return token


def _unit_hash(value: Any) -> bytes:
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise InvalidKey(f"unit hashes are bytes, got {type(value).__name__}")
    return bytes(value)


def _check_token_info(records: list[Record], tokens: list | None, units: list | None) -> None:
    """The rules of SPEC.md §7.4.1, checked before anything is sent."""
    for name, lists in (("tokens", tokens), ("unit_hashes", units)):
        if lists is not None and any(v is not None and not v for v in lists):
            raise InvalidRequest(f"save: a {name} entry is nil or a non-empty array")
    check_token_info("save", len(records), None if tokens is None else tuple(tokens),
                     None if units is None else tuple(units))
    for rec, unit_list in zip(records, units or ()):
        if unit_list is not None and unit_list[-1] != rec.key:
            raise InvalidRequest(f"save: the last unit hash of block {rec.key.hex()} is not its chain hash")


# -- which flow ---------------------------------------------------------------------------------


def save_flow(s: Session, ns_id: bytes, records: list[Record], tokens: list | None,
              unit_hashes: list | None, priority: int) -> Flow[list[str]]:
    """Save records: over shared memory into granted slots or reserved ones
    (:func:`granted_save_flow`), else inline (:func:`put_flow`). Per key: "stored", "exists" or
    "full"."""
    for rec in records:
        if rec.record.nbytes > s.limits.max_payload_len:
            raise LimitExceeded(f"record of {rec.record.nbytes} bytes above the daemon's limit "
                                f"{s.limits.max_payload_len}")
    extras: Extras = {"tokens": tokens, "unit_hashes": unit_hashes}
    if s.shm is not None:
        return (yield from granted_save_flow(s, ns_id, records, extras, priority))
    return (yield from put_flow(s, ns_id, records, extras, priority))


# -- TCP: records inline ------------------------------------------------------------------------


def put_flow(s: Session, ns_id: bytes, records: list[Record], extras: Extras, priority: int) -> Flow[list[str]]:
    """Save records inline, one ``put`` per batch within ``max_batch`` and ``max_payload_len``."""
    results: list[str] = []
    for lo, hi in _put_batches(s, records):
        chunk = records[lo:hi]
        keys = {"ns_id": ns_id, "hashes": [rec.key for rec in chunk],
                "lens": [rec.record.nbytes for rec in chunk], "priority": priority,
                **_extras_of(extras, lo, hi)}
        r = yield Call("put", keys, payload=[rec.record for rec in chunk], commits=True)
        expect_len("put", r.results, len(chunk))
        results.extend(r.results)
    return results


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


def _extras_of(extras: Extras, lo: int, hi: int) -> dict[str, Any]:
    """The extras of ``records[lo:hi]``, as request keys (absent ones left out)."""
    return {name: values[lo:hi] for name, values in extras.items() if values is not None}


# -- unix socket: granted slots -----------------------------------------------------------------


def granted_save_flow(s: Session, ns_id: bytes, records: list[Record], extras: Extras,
                      priority: int) -> Flow[list[str]]:
    """Save over shared memory: into granted slots when the pool has them, else reserve/commit;
    and refill the pool for the next save. Per key: "stored", "exists" or "full"."""
    pool = s.grants
    size = _uniform_size(records)
    if (pool is None or not pool.fits(size, len(records), priority) or len(records) > s.limits.max_batch
            or s.limits.max_inflight < MIN_INFLIGHT):  # a refill travels with the save's requests
        return (yield from reserve_commit_flow(s, ns_id, records, extras, priority))
    for lease in pool.take_stale():  # lapsed grants: give their slots back
        yield Call("release", {"lease": lease}, best_effort=True, wait=False, defer=True)
    taken = pool.take(size, priority, len(records))
    ask = len(records) - pool.held(size, priority)
    # A daemon that takes the refill with the place (SPEC 7.4 place grant_sizes) gets one request
    # per save; its slots come with the place's answer, before the next save needs them. (Not
    # write-behind: its places are answered later, the next save would find the pool empty.)
    merged = taken is not None and ask > 0 and s.place_grant and not s.write_behind
    refill: tuple[Ticket, float] | None = None
    if ask > 0 and not merged:  # sent now (deferred behind a reserve): the daemon grants while the client copies
        ticket = yield Call("grant", {"sizes": [size] * ask, "lease_ms": s.lease_ms, "priority": priority},
                            wait=False, defer=taken is None)
        refill = (ticket, pool.now())
    if taken is None:
        results = yield from reserve_commit_flow(s, ns_id, records, extras, priority)
        if refill is not None:
            yield from _shelve(s, pool, refill, size, priority, ask)
        return results
    yield from _copy_into(s, records, taken)
    if refill is not None:  # answered while the client copied; claimed before the place is sent,
        yield from _shelve(s, pool, refill, size, priority, ask)  # so a lost refill is still retried
    grant = {"grant_sizes": [size] * ask, "grant_lease_ms": s.lease_ms, "grant_priority": priority} if merged else None
    asked_at = pool.now()
    places = yield from _place_flow(s, ns_id, records, extras, taken, grant)
    if s.write_behind:  # the connection claims the places' answers later (kvtier.client.behind)
        return ["stored"] * len(records)
    results = []
    for ticket, start, end in places:
        try:
            r = yield Await(ticket)
        except KVTierError:
            # A refused place leaves its slots granted: give the grant back with the next save's
            # requests rather than hold it until it expires. (A write-behind place refused later
            # is recorded by the connection; its grant expires or ends with the connection.)
            pool.drop({g.lease for g in taken[start:end]})
            raise
        expect_len("place", r.results, end - start)
        results.extend(r.results)
        if r.grant_lease:  # the refill, with the last place
            expect_len("place grant_slots", r.grant_slots or (), ask)
            pool.add(size, priority, r.grant_lease, r.grant_slots or (), s.lease_ms, asked_at)
    return results


def _uniform_size(records: Sequence[Record]) -> int:
    """The payload size every record shares, or 0."""
    if not records:
        return 0
    size = records[0].payload.nbytes
    return size if all(rec.payload.nbytes == size for rec in records) else 0


def _copy_into(s: Session, records: list[Record], taken: list[Granted]) -> Flow[None]:
    """Copy every payload into its granted slot, in one call. If that fails, the grants of
    ``taken`` are released (their slots may hold partial copies) and the error raised."""
    shm, pool = s.shm, s.grants
    assert shm is not None and pool is not None, "granted slots need the mapped segments"
    if s.peer_gone is not None and s.peer_gone():
        # The slots were granted by a daemon that is gone; its successor may own them now.
        pool.drop({g.lease for g in taken})
        raise ConnectionLost("the daemon hung up; its granted slots are not written")
    try:
        shm.write_many([g.slot for g in taken], [rec.payload for rec in records])
    except KVTierError:
        pool.drop({g.lease for g in taken})
        for lease in pool.take_stale():
            yield Call("release", {"lease": lease}, best_effort=True, wait=False, defer=True)
        raise


def _shelve(s: Session, pool: GrantPool, refill: tuple[Ticket, float], size: int, priority: int,
            ask: int) -> Flow[None]:
    """Claim a refill's answer into the pool. A daemon that does not grant (an older one, or a
    size it can never hold) turns the pool off; other failures propagate like any answer's."""
    ticket, asked_at = refill
    try:
        r = yield Await(ticket)
    except (InvalidRequest, CapacityError):
        pool.enabled = False
        return
    expect_len("grant", r.slots, ask)
    pool.add(size, priority, r.lease, r.slots, s.lease_ms, asked_at)


def _place_flow(s: Session, ns_id: bytes, records: list[Record], extras: Extras,
                taken: list[Granted], grant: dict[str, Any] | None = None) -> Flow[list[tuple[Ticket, int, int]]]:
    """Place the records copied into ``taken``, in batches within the daemon's limits, one place
    per grant a batch spans; ``grant``: the refill's keys, sent with the last place. Returns each
    place's ticket and the records it names, ``records[start:end]`` (write-behind: none, the
    connection keeps them)."""
    behind = s.write_behind
    runs: list[tuple[int, int]] = []
    for lo, hi in save_batches(s, records):
        start = lo
        while start < hi:  # the run of this batch that one grant holds
            end = start + 1
            while end < hi and taken[end].lease == taken[start].lease:
                end += 1
            runs.append((start, end))
            start = end
    # Write-behind: sent at once, so the daemon places while the caller prepares its next save
    # (held back, it would wait for that save's grant); else written as the save awaits it.
    out: list[tuple[Ticket, int, int]] = []
    for k, (start, end) in enumerate(runs):
        keys: dict[str, Any] = {
            "lease": taken[start].lease, "ns_id": ns_id, "hashes": [rec.key for rec in records[start:end]],
            "positions": [g.position for g in taken[start:end]],
            "headers": [rec.header for rec in records[start:end]], **_extras_of(extras, start, end)}
        if grant is not None and k == len(runs) - 1:
            keys.update(grant)
        ticket = yield Call("place", keys, commits=True, wait=False, defer=not behind, behind=behind)
        if not behind:
            out.append((ticket, start, end))
    return out


# -- unix socket: reserve, copy, commit ---------------------------------------------------------


def reserve_commit_flow(s: Session, ns_id: bytes, records: list[Record], extras: Extras,
                        priority: int) -> Flow[list[str]]:
    """Save over shared memory: reserve → copy into the slots → commit, per sub-batch, pipelined.
    Per key: "stored", "exists" or "full"."""
    shm = s.shm
    assert shm is not None, "reserve/commit needs the mapped segments"
    batches = save_batches(s, records)
    if not batches:
        return []
    piped = s.piped
    behind = s.write_behind
    window = min(COMMITS_IN_FLIGHT, s.limits.max_inflight - 3) if piped else 0
    results: list[str] = []
    commits: list[Ticket] = []
    ahead: Ticket = yield _reserve(s, ns_id, records[slice(*batches[0])], priority)
    for k, (lo, hi) in enumerate(batches):
        chunk = records[lo:hi]
        r = yield Await(ahead)
        if piped and k + 1 < len(batches):  # the daemon reserves the next while we copy this one
            ahead = yield _reserve(s, ns_id, records[slice(*batches[k + 1])], priority)
        headers: list[bytes | None] = []
        outcome: list[str] = []
        try:
            expect_len("reserve", r.slots, len(chunk))
            slots, payloads = [], []
            for rec, slot in zip(chunk, r.slots):
                if slot is None or slot == EXISTS:
                    headers.append(None)
                    outcome.append("full" if slot is None else "exists")
                else:
                    slots.append(slot)
                    payloads.append(rec.payload)
                    headers.append(rec.header)
                    outcome.append("stored")
            shm.write_many(slots, payloads)  # one call: no Python between the copies
        except KVTierError:
            if r.lease:
                yield Call("release", {"lease": r.lease}, best_effort=True, wait=False, defer=True)
            raise
        if any(h is not None for h in headers):
            keys: dict[str, Any] = {"lease": r.lease, "headers": headers}
            for name, values in extras.items():
                if values is not None:
                    keys[name] = [v if h is not None else None for v, h in zip(values[lo:hi], headers)]
            ticket = yield Call("commit", keys, commits=True, wait=False, defer=True, behind=behind)
            if not behind:
                commits.append(ticket)
            if len(commits) > window:
                yield Await(commits.pop(0))
        elif r.lease:
            yield Call("release", {"lease": r.lease}, best_effort=True, wait=False, defer=True)
        results.extend(outcome)
        if not piped and k + 1 < len(batches):
            ahead = yield _reserve(s, ns_id, records[slice(*batches[k + 1])], priority)
    for ticket in commits:  # every commit's answer: a refused one raises its typed error
        yield Await(ticket)
    return results  # write-behind: the connection claims the commits' answers later


def _reserve(s: Session, ns_id: bytes, chunk: Sequence[Record], priority: int) -> Call:
    return Call("reserve", {"ns_id": ns_id, "hashes": [rec.key for rec in chunk],
                            "sizes": [rec.payload.nbytes for rec in chunk],
                            "lease_ms": s.lease_ms, "priority": priority}, wait=False)


def save_batches(s: Session, records: Sequence[Record]) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of records per reserve/commit (or place): within ``max_batch``,
    half of ``max_header_len`` of commit headers, and ``s.pipeline_bytes`` of payload when
    pipelined (at least one record each). Pipelined, the first and the last range are split once
    more, a quarter of their records off their outer end: only the reserve of the first and the
    commit of the last are not overlapped by a copy, so they are kept small."""
    out: list[tuple[int, int]] = []
    start, head, body = 0, 0, 0
    budget = s.limits.max_header_len // 2
    piped = s.piped
    piece = s.pipeline_bytes if piped else 1 << 62
    for i, rec in enumerate(records):
        size = len(rec.header) + 64
        if i > start and (i - start == s.limits.max_batch or head + size > budget
                          or body + rec.payload.nbytes > piece):
            out.append((start, i))
            start, head, body = i, 0, 0
        head += size
        body += rec.payload.nbytes
    if start < len(records):
        out.append((start, len(records)))
    if len(out) > 1 and piped:
        lo, hi = out[0]
        if hi - lo > 1:
            cut = lo + max(1, (hi - lo) // 4)
            out[0:1] = [(lo, cut), (cut, hi)]
        lo, hi = out[-1]
        if hi - lo > 1:
            cut = hi - max(1, (hi - lo) // 4)
            out[-1:] = [(lo, cut), (cut, hi)]
    return out
