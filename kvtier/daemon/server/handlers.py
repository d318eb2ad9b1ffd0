"""The data-plane operations (SPEC.md §7.4) mapped onto the :class:`~kvtier.daemon.store.TieredStore` API.

One :class:`RequestHandler` serves every connection; what belongs to one connection (its leases,
whether it received segments, the scope its hello chose: the default store or one tenant's)
lives in its :class:`Session`. Every operation runs against the session's store only. Transport concerns (frames, hello,
descriptor passing, in-flight limits) are :mod:`kvtier.daemon.server.connection`'s.

::

    reserve ─► Session.leases[id] = PutLease ─► commit ─► store.commit ─► note token info
    grant   ─► Session.leases[id] = GrantLease ─► place (any slots, any number of times) ─►
               store.place ─► note token info
    put     ─► check records ─► reserve ─► copy payloads into host slots ─► commit   (all or nothing)
    get     ─► acquire ─► header + slot view of each block, sent as they are ─► release once sent
            (decode: true: lossy/compressed ones decoded into raw records on a worker thread,
             kvtier.daemon.server.get_decode; the others sent as they are)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import (ChecksumMismatch, InvalidRequest, KVTierError, LeaseError,
                                    StorageError)
from kvtier_protocol.header import decode_header
from kvtier_protocol.namespace import Namespace

from kvtier_protocol.buffers import PayloadBuffers
from kvtier.daemon.server import get_decode
from kvtier.daemon.server.events import BlockTokens
from kvtier.daemon.server.inline import check_records, copy_checked, record_views, run_sized
from kvtier.daemon.server.remote_views import remote_view
from kvtier.daemon.store.results import PlaceStatus, PutStatus
from kvtier.daemon.store.types import Slot

if TYPE_CHECKING:
    from kvtier.daemon.server.context import DaemonContext, Scope
    from kvtier.daemon.store.results import Acquired
    from kvtier.daemon.store.store import TieredStore

log = logging.getLogger(__name__)
T = TypeVar("T")
Handler = Callable[[Any, "Session"], Awaitable[fr.Message]]
"""One operation: ``(request, session) -> response`` (a bound method of :class:`RequestHandler`)."""


@dataclass(frozen=True, slots=True)
class PutLease:
    """What a connection remembers of one of its reservations, to check the commit against."""

    ns_id: bytes
    hashes: tuple[bytes, ...]
    reserved: tuple[bool, ...]  # per key: whether the reservation gave it a slot


@dataclass(slots=True)
class GrantLease:
    """What a connection remembers of one of its grants: the positions not placed yet (the grant
    ends, and is forgotten, when none is left)."""

    open: set[int]


@dataclass(slots=True)
class Session:
    """Per-connection state the operations read and change.

    Attributes:
        tcp: the connection is TCP (payloads inline, mutating calls need the token).
        hello_done: a hello succeeded; other requests are served from then on.
        has_segments: the hello response carried the host segments (shared-memory ops allowed).
        authenticated: the hello presented the daemon's token (or none is configured).
        leases: the leases this connection holds: a PutLease for a reservation, a GrantLease for
            a grant, None for an acquire. Every one still here when the connection ends is released.
        scope: the store (and event hub) this connection's requests go to, chosen at hello from
            its token; None: the default store.
    """

    tcp: bool
    hello_done: bool = False
    has_segments: bool = False
    authenticated: bool = False
    leases: dict[int, PutLease | GrantLease | None] = field(default_factory=dict)
    scope: Scope | None = None
    after_send: dict[int, Callable[[], object]] = field(default_factory=dict)
    """Per response (its ``id()``) what to do once its bytes have left: a get's payload is sent
    from the leased slots, so its lease is released then (kvtier.daemon.server.connection)."""


class RequestHandler:
    """Executes validated requests (everything but hello) against the session's store."""

    def __init__(self, ctx: DaemonContext, limits: fr.Limits, buffers: PayloadBuffers) -> None:
        self.ctx = ctx
        self.limits = limits
        self.buffers = buffers  # where get responses' records are copied (reused, buffers.py)
        # Gets with decode: true whose decoded records may be in memory at once (get_decode.py).
        self._decodes = asyncio.Semaphore(get_decode.CONCURRENT_DECODES)
        # The dispatch, spelled out: every operation of SPEC §7.4 but hello (the connection's own,
        # it chooses the session's scope) to the method that serves it.
        self._handlers: Mapping[str, Handler] = MappingProxyType({
            fr.LookupRequest.OP: self._lookup,
            fr.ReserveRequest.OP: self._reserve,
            fr.CommitRequest.OP: self._commit,
            fr.GrantRequest.OP: self._grant,
            fr.PlaceRequest.OP: self._place,
            fr.AcquireRequest.OP: self._acquire,
            fr.ReleaseRequest.OP: self._release,
            fr.PutRequest.OP: self._put,
            fr.GetRequest.OP: self._get,
            fr.DeleteRequest.OP: self._delete,
            fr.ClearRequest.OP: self._clear,
            fr.StatsRequest.OP: self._stats,
            fr.PingRequest.OP: self._ping,
        })

    @property
    def handlers(self) -> Mapping[str, Handler]:
        """The operation each request's ``OP`` is served by (read-only; hello is not here)."""
        return self._handlers

    def scope(self, session: Session) -> Scope:
        """The scope a session's requests go to (the default one until its hello chose another)."""
        return session.scope if session.scope is not None else self.ctx.scope()

    def runs_inline(self, req: fr.Request, session: Session) -> bool:
        """Whether a connection may start ``req``'s handler inside its read loop, before reading
        the next frame (kvtier.daemon.server.connection): the operations that are store calls
        (they mostly finish without waiting for anything, and one that does wait goes on in a task
        of its own). Not the ones that may reach the remote tier: its client may tie a timeout to
        the task running when it starts, which would be the connection's reader."""
        op = req.OP
        if op in _INLINE_OPS:
            return True
        return op in _INLINE_UNLESS_REMOTE and not self.scope(session).store.remote.enabled

    async def handle(self, req: fr.Request, session: Session) -> fr.Message:
        """Run one request and return its typed response.

        Raises:
            KVTierError: the typed error to answer with.
        """
        if req.OP in _SHM_OPS and not session.has_segments:
            raise InvalidRequest(f"{req.OP} needs the shared-memory segments of a unix socket "
                                 "connection; use put/get")
        handler = self._handlers.get(req.OP)
        if handler is None:  # the frame decoder refuses unknown ops first; hello is the connection's
            raise InvalidRequest(f"unknown op {req.OP!r}; ops are {', '.join(self._handlers)}")
        return await handler(req, session)

    # --- shared memory path --------------------------------------------------------------------

    async def _lookup(self, req: fr.LookupRequest, session: Session) -> fr.Message:
        store = self.scope(session).store
        if store.remote.enabled:  # the rest of the prefix from the cluster, within the lookup budget
            num_hits, names = await store.lookup_remote(req.ns_id, req.hashes, accept_lossy=req.accept_lossy)
        else:
            num_hits, names = store.lookup_names(req.ns_id, req.hashes, accept_lossy=req.accept_lossy)
        ns = _namespace(store, req.ns_id)
        if ns is not None:  # unknown namespace: tokens per block unknown, nothing counted
            misses = len(req.hashes) - num_hits
            self.ctx.metrics.add_lookup_tokens(num_hits * ns.block_tokens, misses * ns.block_tokens)
        return fr.LookupResponse(req.id, num_hits, tuple(names))

    async def _reserve(self, req: fr.ReserveRequest, session: Session) -> fr.Message:
        store = self.scope(session).store
        res = await store.reserve(req.ns_id, req.hashes, req.sizes, lease_s=req.lease_ms / 1000,
                                  priority=_priority(store, req.priority))
        if res.lease_id:
            reserved = tuple(s is PutStatus.RESERVED for s in res.status)
            session.leases[res.lease_id] = PutLease(req.ns_id, req.hashes, reserved)
        slots = tuple(_slot_ref(slot) if status is PutStatus.RESERVED else _NOT_RESERVED[status]
                      for slot, status in zip(res.slots, res.status))
        return fr.ReserveResponse(req.id, res.lease_id, slots)

    async def _commit(self, req: fr.CommitRequest, session: Session) -> fr.Message:
        info = _held(session, req.lease, PutLease, "reservation")
        scope = self.scope(session)
        try:
            self._check_commit(req, info)
            tokens = self._publishing(scope, info.ns_id, info.hashes, req.headers, req.tokens, req.unit_hashes)
            ok = await _commit_all(scope.store, req.lease, req.headers, info.ns_id, info.hashes)
        except BaseException:
            scope.store.release(req.lease)  # SPEC §7.4: a failed commit ends the lease
            raise
        finally:
            del session.leases[req.lease]
        _note_tokens(scope, info.ns_id, tokens, ok)
        return fr.CommitResponse(req.id, sum(ok))

    async def _grant(self, req: fr.GrantRequest, session: Session) -> fr.Message:
        lease, slots = await _granted(self.scope(session).store, session, req.sizes, req.lease_ms, req.priority)
        return fr.GrantResponse(req.id, lease, slots)

    async def _place(self, req: fr.PlaceRequest, session: Session) -> fr.Message:
        info = _held(session, req.lease, GrantLease, "grant")
        scope = self.scope(session)
        headers: Sequence[bytes] = req.headers  # type: ignore[assignment]  # PlaceRequest: never nil
        tokens = self._publishing(scope, req.ns_id, req.hashes, headers, req.tokens, req.unit_hashes)
        tokens_given = req.tokens is not None  # else every entry of ``tokens`` is None
        store = scope.store
        verified = store.config.verify_on_commit or store.config.write_through  # else no key fails
        before = store.counters.checksum_failures if verified else 0
        # A refused place raises here, having changed nothing: its positions stay granted.
        done = await store.place(req.lease, req.ns_id, req.hashes, req.positions, headers)
        info.open.difference_update(req.positions)  # placed, or freed for keys already stored
        if not info.open:
            del session.leases[req.lease]
        if done.count(_PLACED) == len(done):  # the common place: every key new and stored
            if tokens_given:
                _note_tokens(scope, req.ns_id, tokens, [True] * len(done))
            results: tuple[str, ...] = ("stored",) * len(done)
        else:
            ok = [d is PlaceStatus.PLACED for d in done]
            failed = sum(d is PlaceStatus.FAILED for d in done)
            if failed:  # all or nothing, like commit
                await _undo(store, req.ns_id, req.hashes, ok, failed, before)
            _note_tokens(scope, req.ns_id, tokens, ok)
            results = tuple("stored" if good else "exists" for good in ok)
        if req.grant_sizes is None:
            return fr.PlaceResponse(req.id, results)
        lease, slots = await self._refill(req, session, store)
        return fr.PlaceResponse(req.id, results, lease, slots)

    async def _refill(self, req: fr.PlaceRequest, session: Session,
                      store: TieredStore) -> tuple[int, tuple[fr.SlotRef | None, ...] | None]:
        """The grant a place asks for after it (SPEC 7.4 place ``grant_sizes``): as :meth:`_grant`
        makes it. The place has taken effect by now, so a refill the store refuses (no size it
        could ever hold) is answered as no grant, lease 0, never as the place's error."""
        lease_ms = fr.DEFAULT_LEASE_MS if req.grant_lease_ms is None else req.grant_lease_ms
        sizes = req.grant_sizes or ()
        try:
            lease, slots = await _granted(store, session, sizes, lease_ms, req.grant_priority or 0)
        except KVTierError as exc:
            log.debug("place %d: refill of %d slots refused: %s", req.id, len(sizes), exc.message)
            return 0, None
        return (lease, slots) if lease else (0, None)

    async def _acquire(self, req: fr.AcquireRequest, session: Session) -> fr.Message:
        got = await self.scope(session).store.acquire(req.ns_id, req.hashes, lease_s=req.lease_ms / 1000,
                                                      accept_lossy=req.accept_lossy)
        if got.lease_id:
            session.leases[got.lease_id] = None
        missing = len(req.hashes) - len(got.blocks)
        slots = tuple([b.slot for b in got.blocks]) + (None,) * missing  # Slots are SlotRef tuples
        headers = tuple(b.header for b in got.blocks) + (None,) * missing
        checked = tuple(b.checked for b in got.blocks) + (False,) * missing
        return fr.AcquireResponse(req.id, got.lease_id, slots, headers, checked if any(checked) else None)

    async def _release(self, req: fr.ReleaseRequest, session: Session) -> fr.Message:
        if req.lease:
            if req.lease not in session.leases:
                raise LeaseError(f"no lease {req.lease} on this connection")
            del session.leases[req.lease]
            if not self.scope(session).store.release(req.lease):
                raise LeaseError(f"lease {req.lease} has expired")
        return fr.ReleaseResponse(req.id)

    # --- inline path ---------------------------------------------------------------------------

    async def _put(self, req: fr.PutRequest, session: Session) -> fr.Message:
        records = req.records()
        headers, payloads, checksums = check_records(req.ns_id, req.hashes, records)
        tokens = self._token_info(req.hashes, headers, req.tokens, req.unit_hashes)
        scope = self.scope(session)
        store = scope.store
        _maybe_register(store, req.ns_id, headers)
        res = await store.reserve(req.ns_id, req.hashes, [len(p) for p in payloads],
                                  priority=_priority(store, req.priority))
        reserved = [s is PutStatus.RESERVED for s in res.status]
        ok: list[bool] = [False] * len(reserved)
        if res.lease_id:
            session.leases[res.lease_id] = PutLease(req.ns_id, req.hashes, tuple(reserved))
        try:
            # Every record is verified (SPEC 7.4 put); a reserved one as it is copied into its slot.
            todo = [(store.host.view(slot) if r else None, payload, checksum)
                    for slot, payload, checksum, r in zip(res.slots, payloads, checksums, reserved)]
            bad = await run_sized(sum(p.nbytes for _, p, _ in todo), copy_checked, todo)
            if bad:  # the client's error (its records), as before copying: not a store failure
                raise ChecksumMismatch(f"put: {len(bad)} payloads do not match their header checksums; "
                                       "nothing was stored")
            if res.lease_id:
                ok = await _commit_all(store, res.lease_id, [h if r else None for h, r in zip(headers, reserved)],
                                       req.ns_id, req.hashes, checked=True)
        except BaseException:
            if res.lease_id:
                store.release(res.lease_id)
            raise
        finally:
            session.leases.pop(res.lease_id, None)
        if res.lease_id:
            _note_tokens(scope, req.ns_id, tokens, ok)
        results = tuple("stored" if done else _PUT_RESULT[status] for done, status in zip(ok, res.status))
        return fr.PutResponse(req.id, results)

    async def _get(self, req: fr.GetRequest, session: Session) -> fr.Message:
        if req.decode:
            return await self._get_decoded(req, session)
        store = self.scope(session).store
        got = await store.acquire(req.ns_id, req.hashes, accept_lossy=req.accept_lossy)
        try:
            budget = self.limits.max_payload_len
            todo: list[tuple[bytes, memoryview]] = []
            for block in got.blocks:
                size = len(block.header) + block.slot.length
                if size > budget:
                    break  # SPEC §7.4: records that no longer fit are answered nil, as if missing
                budget -= size
                todo.append((block.header, store.host.view(block.slot)))
            lens = tuple(len(h) + v.nbytes for h, v in todo) + (None,) * (len(req.hashes) - len(todo))
            response = fr.GetResponse(req.id, lens, payload=record_views(todo))
        except BaseException:
            if got.lease_id:
                store.release(got.lease_id)
            raise
        if got.lease_id:  # the payload is sent from the slots: the lease holds until it has left
            session.after_send[id(response)] = partial(store.release, got.lease_id)
        return response

    async def _get_decoded(self, req: fr.GetRequest, session: Session) -> fr.Message:
        """A get with ``decode: true`` (SPEC §7.4.3): lossy or compressed records decoded into raw
        ones on a worker thread (kvtier.daemon.server.get_decode), the others sent from their
        slots; the response's ``decoded`` names the stored codec of each decoded record.

        Decoded records are new memory, up to ``max_payload_len`` per response: at most
        ``get_decode.CONCURRENT_DECODES`` such responses exist at once, from before their acquire
        (no lease is held while a get waits its turn) until their bytes have left."""
        store = self.scope(session).store
        await self._decodes.acquire()
        done: list[Callable[[], object]] = [self._decodes.release]
        try:
            got = await store.acquire(req.ns_id, req.hashes, accept_lossy=req.accept_lossy)
            if got.lease_id:
                done.append(partial(store.release, got.lease_id))
            budget = self.limits.max_payload_len
            planned = get_decode.plan([(b.header, store.host.view(b.slot)) for b in got.blocks], budget)
            if any(p.codec is not None for p in planned):
                decoded = await asyncio.to_thread(get_decode.decode_planned, planned, budget)
            else:
                decoded = []
            payload, lens, codecs = get_decode.finish(planned, decoded, budget)
            missing = (None,) * (len(req.hashes) - len(lens))
            response = fr.GetResponse(req.id, (*lens, *missing), payload=payload,
                                      decoded=(*codecs, *missing) if any(c is not None for c in codecs) else None)
        except BaseException:
            _run_all(done)
            raise
        # Records sent as stored go from their slots, decoded ones from memory: the lease and the
        # turn are held until the bytes have left.
        session.after_send[id(response)] = partial(_run_all, done)
        return response

    # --- both paths ----------------------------------------------------------------------------

    async def _delete(self, req: fr.DeleteRequest, session: Session) -> fr.Message:
        return fr.DeleteResponse(req.id, await self.scope(session).store.delete(req.ns_id, req.hashes))

    async def _clear(self, req: fr.ClearRequest, session: Session) -> fr.Message:
        return fr.ClearResponse(req.id, await self.scope(session).store.clear(req.ns_id))

    async def _stats(self, req: fr.StatsRequest, session: Session) -> fr.Message:
        return fr.StatsResponse(req.id, stats_map(self.ctx, self.scope(session).store))

    async def _ping(self, req: fr.PingRequest, session: Session) -> fr.Message:
        return fr.PingResponse(req.id)

    # --- helpers -------------------------------------------------------------------------------

    @staticmethod
    def _check_commit(req: fr.CommitRequest, info: PutLease) -> None:
        if len(req.headers) != len(info.hashes):
            raise InvalidRequest(f"commit: {len(req.headers)} headers for a reservation of "
                                 f"{len(info.hashes)} keys")
        for i, (buf, reserved) in enumerate(zip(req.headers, info.reserved)):
            if buf is not None and not reserved:
                raise InvalidRequest(f"commit: headers[{i}] names a key the reservation gave no slot")

    def _publishing(self, scope: Scope, ns_id: bytes, hashes: Sequence[bytes], headers: Sequence[bytes | None],
                    tokens: Sequence[Sequence[int] | None] | None,
                    unit_hashes: Sequence[tuple[bytes, ...] | None] | None) -> list[BlockTokens | None]:
        """Before blocks are made visible: their token info for the events (checked: raises
        InvalidRequest), and their namespace registered from the headers if it is new."""
        info = self._token_info(hashes, headers, tokens, unit_hashes)
        _maybe_register(scope.store, ns_id, headers)
        return info

    @staticmethod
    def _token_info(hashes: Sequence[bytes], headers: Sequence[bytes | None],
                    tokens: Sequence[Sequence[int] | None] | None,
                    unit_hashes: Sequence[tuple[bytes, ...] | None] | None) -> list[BlockTokens | None]:
        """Per key, the token info to hand the event hub (None where the request carries none)."""
        out: list[BlockTokens | None] = [None] * len(hashes)
        if tokens is None:
            return out
        for i, (key, buf, toks) in enumerate(zip(hashes, headers, tokens)):
            units = unit_hashes[i] if unit_hashes is not None else None
            if units is not None and units[-1] != key:
                raise InvalidRequest(f"the last of unit_hashes[{i}] is not the key it describes")
            if toks is None or buf is None:
                continue
            parent = decode_header(buf)[0].parent_hash
            out[i] = BlockTokens(key, parent, toks, units or ())
        return out


def _held(session: Session, lease: int, kind: type[T], what: str) -> T:
    """The connection's record of ``lease``, which must be a ``kind``; LeaseError otherwise."""
    info = session.leases.get(lease)
    if not isinstance(info, kind):
        raise LeaseError(f"no {what} {lease} on this connection")
    return info


async def _granted(store: TieredStore, session: Session, sizes: Sequence[int], lease_ms: int,
                   wire_priority: int) -> tuple[int, tuple[fr.SlotRef | None, ...]]:
    """Grant slots of ``sizes`` on ``session`` (a ``grant``, or a place's refill): the lease (0:
    no slot given) and, per size, its slot or None. Raises what the store raises."""
    res = await store.grant(sizes, lease_s=lease_ms / 1000, priority=_priority(store, wire_priority))
    if res.lease_id:  # the granted slots are a prefix of the sizes: FULL from the first without room
        session.leases[res.lease_id] = GrantLease(set(range(res.num_reserved)))
    # A Slot is the (segment, offset, length) tuple of the wire's SlotRef: sent as it is.
    return res.lease_id, tuple(res.slots)


def _priority(store: TieredStore, wire_priority: int) -> int:
    # The wire allows -128..127; the store has priority_classes classes from 0.
    return max(0, min(wire_priority, store.config.priority_classes - 1))


def _namespace(store: TieredStore, ns_id: bytes) -> Namespace | None:
    return store.namespace(ns_id)


def _note_tokens(scope: Scope, ns_id: bytes, tokens: list[BlockTokens | None], ok: list[bool]) -> None:
    # Called right after the commit returned and before any other await: the store queued
    # the blocks' events during the commit, and the event pump (another task) can only run
    # at our next await, so it finds this token info when it publishes those events.
    blocks = [t for t, done in zip(tokens, ok) if t is not None and done]
    if blocks:
        scope.events.note_blocks(ns_id, blocks)


_NS_FIELDS_KEY = b"ns_fields"
"""The bytes of a header map's ``ns_fields`` key, in whichever msgpack string form it is written:
a header with the key contains them (one that contains them may still lack it, and is decoded)."""


def _maybe_register(store: TieredStore, ns_id: bytes, headers: Sequence[bytes | None]) -> None:
    """Register the namespace from the first header's ns_fields when it is not known yet."""
    if _namespace(store, ns_id) is not None:
        return
    buf = next((h for h in headers if h is not None), None)
    if buf is None or _NS_FIELDS_KEY not in buf:
        # No "ns_fields" string anywhere in the header: it carries none, so there is nothing to
        # register, and no decode is spent on every save of a client that sends none.
        return
    try:
        fields = decode_header(buf)[0].ns_fields
        ns = Namespace.from_wire(fields) if fields is not None else None
    except KVTierError:
        return  # a bad header is refused by the commit itself; bad ns_fields are informative
    if ns is not None and ns.ns_id == ns_id:
        store.register_namespace(ns)
        log.info("registered namespace %s (%s)", ns_id.hex(), ns.model)


async def _commit_all(store: TieredStore, lease_id: int, headers: Sequence[bytes | None], ns_id: bytes,
                      hashes: Sequence[bytes], *, checked: bool = False) -> list[bool]:
    """store.commit, made all or nothing: if a written key fails (bad payload found by
    ``verify_on_commit``, failed write-through), the keys it did make visible are deleted."""
    cfg = store.config
    verified = cfg.verify_on_commit or cfg.write_through  # else commit cannot fail per key
    before = store.counters.checksum_failures if verified else 0
    ok = await store.commit(lease_id, headers, checked=checked)
    failed = [i for i, buf in enumerate(headers) if buf is not None and not ok[i]]
    if failed:
        await _undo(store, ns_id, hashes, ok, len(failed), before)
    return ok


async def _undo(store: TieredStore, ns_id: bytes, hashes: Sequence[bytes], ok: Sequence[bool], failed: int,
                checksum_failures_before: int) -> None:
    """Delete the keys a commit or place made visible (``ok``) when ``failed`` others did not
    make it, then raise why: ChecksumMismatch when the store counted bad payloads since
    ``checksum_failures_before``, else StorageError (a failed write-through)."""
    await store.delete(ns_id, [h for h, done in zip(hashes, ok) if done])
    if store.counters.checksum_failures > checksum_failures_before:
        raise ChecksumMismatch(f"{failed} payloads do not match their header checksums; "
                               "nothing was committed")
    raise StorageError(f"{failed} blocks could not be written through to disk; nothing was committed")


_SHM_OPS = frozenset({"reserve", "commit", "acquire", "grant", "place"})
_INLINE_OPS = frozenset({"ping", "stats", "reserve", "commit", "grant", "place", "release"})
_INLINE_UNLESS_REMOTE = frozenset({"lookup", "acquire"})
_PLACED = PlaceStatus.PLACED
_NOT_RESERVED = {PutStatus.STORED: fr.EXISTS, PutStatus.PENDING: fr.EXISTS, PutStatus.FULL: None}
_PUT_RESULT = {PutStatus.STORED: "exists", PutStatus.PENDING: "exists", PutStatus.FULL: "full",
               PutStatus.RESERVED: "full"}  # RESERVED but not committed only happens on failure


def _slot_ref(slot: Slot) -> fr.SlotRef:
    return (slot.segment, slot.offset, slot.length)


def stats_map(ctx: DaemonContext, store: TieredStore | None = None) -> dict[str, Any]:
    """The ``stats`` response map of ``store`` (default: the default store): store counters,
    tier gauges and server facts (informative)."""
    store = store if store is not None else ctx.store
    counters = store.counters
    gauges = store.gauges()
    out: dict[str, Any] = {f: getattr(counters, f) for f in counters.__slots__ if f != "tiers"}
    out["tiers"] = {t.name.lower(): {f: getattr(c, f) for f in c.__slots__} for t, c in counters.tiers.items()}
    return {
        "server": {"version": ctx.version, "uptime_s": round(time.time() - ctx.started_at, 3),
                   "ready": ctx.ready},
        "counters": out,
        "tiers": {t.name.lower(): {"capacity_bytes": g.capacity_bytes, "used_bytes": g.used_bytes,
                                   "blocks": g.blocks} for t, g in gauges.tiers.items()},
        "blocks": gauges.blocks, "pending": gauges.pending, "leases": gauges.leases,
        "fragmentation": gauges.fragmentation,
        **({"remote": remote_view(store.remote)} if store.remote.enabled else {}),
    }


def _run_all(steps: list[Callable[[], object]]) -> None:
    """Run every step, last first (a lease is released before the turn it was taken in)."""
    for step in reversed(steps):
        step()
