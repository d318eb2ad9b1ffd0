"""Save over shared memory into granted slots: copy at once, then one ``place`` (SPEC.md §7.4).

:func:`shm_save_flow` is the save of a unix-socket connection. When the session's
:class:`~kvtier.client.grants.GrantPool` holds enough slots of the records' size, the save copies
into them without waiting for anything and names the keys in ``place``; else it reserves and
commits (kvtier.client.pipeline). Either way it asks for the slots the *next* save of that size
will use (``grant``), so that from the second save of a stream on, the only round trip left is
the place, and with ``ClientOptions.write_behind`` not even that::

    reserve/commit save:  reserve ── copy ── commit         (+ grant sent behind the reserve)
    granted save:         grant ─┬─ copy into pool slots ── place
                                 └─ (the daemon grants the next save's slots while the client copies)

Results are those of the reserve path, with one difference: a granted save learns that a key was
already stored only from the place answer, after copying its payload; a write-behind save does
not wait for that answer, and reports such keys "stored" (they are: by an earlier save).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier_protocol.errors import CapacityError, InvalidRequest, KVTierError

from kvtier.client.calls import Await, Call, Flow, Ticket, expect_len
from kvtier.client.grants import Granted, GrantPool
from kvtier.client.pipeline import MIN_INFLIGHT, reserve_commit_flow, save_batches
from kvtier.client.records import Record
from kvtier.client.session import Session


def shm_save_flow(s: Session, ns_id: bytes, records: list[Record], extras: dict[str, list | None],
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
    refill: tuple[Ticket, float] | None = None
    if ask > 0:  # sent now (deferred behind a reserve): the daemon grants while the client copies
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
    places = yield from _place_flow(s, ns_id, records, extras, taken)
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
    return results


def _uniform_size(records: Sequence[Record]) -> int:
    """The payload size every record shares, or 0."""
    if not records:
        return 0
    size = records[0].payload.nbytes
    return size if all(rec.payload.nbytes == size for rec in records) else 0


def _place_flow(s: Session, ns_id: bytes, records: list[Record], extras: dict[str, list | None],
                taken: list[Granted]) -> Flow[list[tuple[Ticket, int, int]]]:
    """Place the records copied into ``taken``, in batches within the daemon's limits, one place
    per grant a batch spans. Returns each place's ticket and the records it names,
    ``records[start:end]`` (write-behind: none, the connection keeps them)."""
    behind = s.write_behind
    # Write-behind: sent at once, so the daemon places while the caller prepares its next save
    # (held back, it would wait for that save's grant); else written as the save awaits it.
    out: list[tuple[Ticket, int, int]] = []
    for lo, hi in save_batches(s, records):
        start = lo
        while start < hi:  # the run of this batch that one grant holds
            end = start + 1
            while end < hi and taken[end].lease == taken[start].lease:
                end += 1
            keys: dict[str, Any] = {
                "lease": taken[start].lease, "ns_id": ns_id, "hashes": [rec.key for rec in records[start:end]],
                "positions": [g.position for g in taken[start:end]],
                "headers": [rec.header for rec in records[start:end]]}
            for name, values in extras.items():
                if values is not None:
                    keys[name] = values[start:end]
            ticket = yield Call("place", keys, commits=True, wait=False, defer=not behind, behind=behind)
            if not behind:
                out.append((ticket, start, end))
            start = end
    return out


def _copy_into(s: Session, records: list[Record], taken: list[Granted]) -> Flow[None]:
    """Copy every payload into its granted slot, in one call. If that fails, the grants of
    ``taken`` are released (their slots may hold partial copies) and the error raised."""
    shm, pool = s.shm, s.grants
    assert shm is not None and pool is not None, "granted slots need the mapped segments"
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
