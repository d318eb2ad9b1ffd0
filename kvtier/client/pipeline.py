"""Save and load over shared memory as pipelines of sub-batches (unix socket).

One save or load call is cut into sub-batches of about ``ClientOptions.pipeline_bytes`` of payload
(when > 0; see :data:`~kvtier.client.options.PIPELINE_BYTES` for why it is off by default), and the
requests of one sub-batch travel while the client copies another, so the copies run back to back
instead of alternating with round trips and the daemon's bookkeeping::

    save:  reserve 0 ─┐
           reserve 1 ─┼─ copy 0 ─ commit 0 ─┐            (commits are not waited for:
           reserve 2 ─┴────────── copy 1 ─ commit 1 ─ ... all their answers are collected
                                                          before the call returns)
    load:  acquire 0 ─┐
           acquire 1 ─┴─ copy 0 ─ release 0 ─┐           (releases are never waited for:
           acquire 2 ───────────── copy 1 ─ release 1 ... a lost one expires on its own)

**Write-behind** (``ClientOptions.write_behind``): a save's commits are sent ``behind`` and never
awaited by the save, which returns once the last payload is in shared memory. The connection
claims their answers before the client's next request that reads (kvtier.client.calls.BLIND_OPS),
so a client always reads its own writes, and holds the last commit back until the next request
(or ``FLUSH_AFTER_S``): the next save's reserve is then written first, in the same write, and the
daemon grants its slots before it makes the previous blocks visible, while the client copies::

    save k:    reserve k ── copy k ── commit k (held back)
    save k+1:  [reserve k+1, commit k] ── copy k+1 ── commit k+1 (held back) ...

Results, their order and errors are those of the one-request-at-a-time flow: the daemon answers
requests in any order, but the flow claims every answer it needs by ticket (kvtier.client.calls),
and no request it sends depends on another still in flight (a commit or release follows the
answer to its reserve or acquire). With ``pipeline_bytes`` 0 the same flows send one request batch
at a time and wait for each answer, except releases. A failure leaves nothing half done that the daemon does not
undo itself: a reservation never committed or an acquire never released is released by the driver
(forgotten tickets) or, at the latest, when its lease expires or the connection ends.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvtier_protocol.errors import KVTierError
from kvtier_protocol.frames import EXISTS

from kvtier.client.calls import Await, Call, Flow, Ticket, expect_len
from kvtier.client.records import Record
from kvtier.client.session import Session

T = TypeVar("T")

FIRST_KEYS = 4
"""Keys of a load's first acquire when the block sizes are not known in advance (``load``; a
``load_into`` sizes it from its buffers): later acquires are sized from the slots seen."""
COMMITS_IN_FLIGHT = 4
"""Commits a save leaves unanswered before it waits for the oldest (bounds requests in flight)."""
MIN_INFLIGHT = 4
"""Below this ``max_inflight`` the flows wait for every answer (no room for a pipeline)."""

ACQUIRE_HEADER_BUDGET = 4096
"""Bytes of an acquire response's header map budgeted per key (one block header each), so that a
batch never exceeds the daemon's ``max_header_len``."""


def _piped(s: Session) -> bool:
    return s.pipeline_bytes > 0 and s.limits.max_inflight >= MIN_INFLIGHT


def save_batches(s: Session, records: Sequence[Record]) -> list[tuple[int, int]]:
    """``(start, end)`` ranges of records per reserve/commit: within ``max_batch``, half of
    ``max_header_len`` of commit headers, and ``s.pipeline_bytes`` of payload when pipelined (at
    least one record each). Pipelined, the first and the last range are split once more, a
    quarter of their records off their outer end: only the reserve of the first and the commit of
    the last are not overlapped by a copy, so they are kept small."""
    out: list[tuple[int, int]] = []
    start, head, body = 0, 0, 0
    budget = s.limits.max_header_len // 2
    piece = s.pipeline_bytes if _piped(s) else 1 << 62
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
    if len(out) > 1 and _piped(s):
        lo, hi = out[0]
        if hi - lo > 1:
            cut = lo + max(1, (hi - lo) // 4)
            out[0:1] = [(lo, cut), (cut, hi)]
        lo, hi = out[-1]
        if hi - lo > 1:
            cut = hi - max(1, (hi - lo) // 4)
            out[-1:] = [(lo, cut), (cut, hi)]
    return out


def _reserve(s: Session, ns_id: bytes, chunk: Sequence[Record], priority: int) -> Call:
    return Call("reserve", {"ns_id": ns_id, "hashes": [rec.key for rec in chunk],
                            "sizes": [rec.payload.nbytes for rec in chunk],
                            "lease_ms": s.lease_ms, "priority": priority}, wait=False)


def reserve_commit_flow(s: Session, ns_id: bytes, records: list[Record], extras: dict[str, list | None],
                        priority: int) -> Flow[list[str]]:
    """Save over shared memory: reserve → copy into the slots → commit, per sub-batch, pipelined.
    Per key: "stored", "exists" or "full". ``extras``: per-record lists (tokens, unit_hashes)."""
    shm = s.shm
    assert shm is not None, "reserve/commit needs the mapped segments"
    batches = save_batches(s, records)
    if not batches:
        return []
    piped = _piped(s)
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


def _acquire(s: Session, ns_id: bytes, chunk: Sequence[bytes]) -> Call:
    return Call("acquire", {"ns_id": ns_id, "hashes": list(chunk), "lease_ms": s.lease_ms}, wait=False)


def _next_count(s: Session, limit: int, r: Any) -> int:
    """Keys of the next acquire: ``s.pipeline_bytes`` at the mean slot size of the last answer."""
    lengths = [slot[2] for slot in r.slots if slot is not None]
    if not lengths or not _piped(s):
        return limit
    return max(1, min(limit, s.pipeline_bytes * len(lengths) // max(1, sum(lengths))))


def _first_count(s: Session, limit: int, sizes: Sequence[int] | None) -> int:
    """Keys of the first acquire: a quarter of ``s.pipeline_bytes`` (its round trip and the
    daemon's work on it are the part of a load no copy overlaps), by ``sizes`` if known."""
    if not _piped(s):
        return limit
    if sizes is None:
        return min(limit, FIRST_KEYS)
    used, n = 0, 0
    for size in sizes[:limit]:
        if n and used + size > s.pipeline_bytes // 4:
            break
        used, n = used + size, n + 1
    return max(1, n)


def acquire_release_flow(s: Session, ns_id: bytes, hashes: list[bytes], take: Any,
                         sizes: Sequence[int] | None = None,
                         settle: Callable[[], None] | None = None) -> Flow[list[T]]:
    """acquire → ``take(i, key, slot, header, checked)`` per leased block (None ends the prefix:
    a miss) → ``settle()`` → release, per sub-batch; the next acquire travels while this one is
    copied. ``sizes``: the most bytes each block can have (sizes the first acquire), if known.
    ``settle``: finishes what the takes of a sub-batch left to do while its lease holds (copies
    they deferred, to make them in one call); it runs after the takes of every sub-batch, also
    when one of them ended the prefix or raised."""
    limit = max(1, min(s.limits.max_batch, s.limits.max_header_len // ACQUIRE_HEADER_BUDGET))
    piped = _piped(s)
    out: list[T] = []
    if not hashes:
        return out
    pos, count = 0, _first_count(s, limit, sizes)
    ahead: Ticket | None = yield _acquire(s, ns_id, hashes[:count])
    while ahead is not None:
        chunk = hashes[pos:pos + count]
        r = yield Await(ahead)
        ahead = None
        error: KVTierError | None = None
        found: list[T] = []
        try:
            expect_len("acquire", r.slots, len(chunk))
            nxt = pos + count
            if nxt < len(hashes) and all(slot is not None for slot in r.slots):
                count = _next_count(s, limit, r)
                if piped:  # the daemon leases the next sub-batch while this one is copied
                    ahead = yield _acquire(s, ns_id, hashes[nxt:nxt + count])
            checked = r.verified if s.trust_checked and r.verified is not None else (False,) * len(chunk)
            for i, (key, slot, header, ok) in enumerate(zip(chunk, r.slots, r.headers, checked), pos):
                item = None if slot is None else take(i, key, slot, header, ok)
                if item is None:
                    break
                found.append(item)
        except KVTierError as exc:
            error = exc
        if settle is not None:  # the blocks taken so far, also before a miss or an error
            try:
                settle()
            except KVTierError as exc:
                error = error or exc
        if r.lease:  # always release, also after an error; a lost release expires on its own
            yield Call("release", {"lease": r.lease}, best_effort=True, wait=False, defer=True)
        if error is not None:
            raise error  # an acquire still in flight is forgotten (released) by the driver
        out.extend(found)
        if len(found) < len(chunk):
            break  # a miss: an acquire still in flight is forgotten (released) by the driver
        pos += len(chunk)
        if ahead is None and not piped and pos < len(hashes):
            ahead = yield _acquire(s, ns_id, hashes[pos:pos + count])
    return out
