"""The client without I/O: every operation of :class:`~kvtier.client.Client` and
:class:`~kvtier.client.AsyncClient`, written once.

The two clients are thin drivers around this core: they own a connection (a plain socket, or
asyncio streams) and do the I/O the core asks for, nothing else. The core is these modules,
none of which touches a socket or an event loop::

    core.py      ClientCore: the operations, their arguments and documentation; a call's policy
                 (degrade to misses, hold-down); lookup, delete, clear, stats and ping flows
    save.py      every save: its checks, put (TCP), granted slots, reserve/copy/commit
    load.py      every load: load and load_into, get (TCP), acquire/copy/release
    get.py       get: whole records inline on any connection, decoded by the daemon if asked
    grants.py    the pool of slots granted ahead of saves
    steps.py     what a flow yields (Call, Await), and FlowRun: a flow's steps as the driver's I/O
    retry.py     when a call retries, when it stops (Attempt), the hold-down
    records.py   records and keys: checks, header/payload split, verification
    session.py   what a connection learns at hello (limits, segments, the grant pool)
    behind.py    write-behind: late commit failures, the deferred flush (blocking client)
    tensors.py   block tensors <-> records (torch imported on first use)
    options.py, errors.py; shm.py + memcopy.py: the mapped segments and the copies in and out

and the drivers, which only do I/O::

    sync.py + transport.py       Client: one call at a time under a lock, blocking sockets
    aio.py  + aio_transport.py   AsyncClient: many calls in flight on one connection

How a call runs: the public method (here) builds a :class:`Job` — the arguments are checked by
``Job.prepare`` before any connection is made — and hands it to the driver's ``_run``. The
driver takes a connection and, per attempt (``retry.attempts_of``), starts the operation's flow
(a generator: kvtier.client.steps) in a ``FlowRun``, whose I/O it does until the flow returns.

The save path, as a reader follows it (what it decides lives in core, save and grants)::

    core.ClientCore.save                  builds the Job
      → save.prepare_save                 checks keys, records, tokens, priority; splits records
      → sync.Client._run (aio.AsyncClient._run) → retry.attempts_of → the driver's _drive:
          steps.FlowRun steps the flow, the transport's perform() sends and receives
      → save.save_flow                    TCP: save.put_flow; unix socket:
      → save.granted_save_flow            the pool (grants.GrantPool) holds the slots: copy, place;
      → save.reserve_commit_flow          else reserve → copy → commit, in save.save_batches
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from kvtier_protocol.address import Address, default_address, parse_address
from kvtier_protocol.errors import FrameError, Unavailable

from kvtier.client.behind import LateErrors
from kvtier.client.errors import ConnectionLost
from kvtier.client.get import GotRecord, decode_rest, prepare_get
from kvtier.client.load import lossy_keys, prepare_load, prepare_load_into
from kvtier.client.options import ClientOptions
from kvtier.client.records import check_hashes, check_ns_id
from kvtier.client.retry import Holddown
from kvtier.client.save import prepare_save
from kvtier.client.session import Session
from kvtier.client.steps import Call, Flow, FlowFactory
from kvtier.client.tensors import decode_blocks, encode_blocks

if TYPE_CHECKING:
    import torch

    from kvtier_protocol.header import BlockHeader
    from kvtier_protocol.namespace import Namespace

log = logging.getLogger("kvtier.client")

T = TypeVar("T")


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


@dataclass(frozen=True, slots=True)
class Job(Generic[T]):
    """One call of an operation, for a driver's ``_run``.

    Attributes:
        prepare: checks the call's arguments (the caller's errors raise here, before any
            connection is made) and returns what starts its flow on a session, once per attempt.
        idempotent: a lost connection is retried up to ``retries`` times (else once, and only
            before the flow sent a commit).
        degrade: an unavailable daemon answers ``fallback`` instead of raising.
        fallback: what a degraded call returns.
        then: applied to the result (or the fallback) once the call's I/O is done (decoding
            tensors: outside the client's lock and deadline).
    """

    prepare: Callable[[], FlowFactory]
    idempotent: bool
    degrade: bool = False
    fallback: Any = None
    then: Callable[[Any], T] | None = None

    def finish(self, result: Any) -> T:
        """The call's answer: ``result`` passed through ``then``."""
        return result if self.then is None else self.then(result)


class Connection(Protocol):
    """What the core reads of a driver's connection (no I/O)."""

    @property
    def closed(self) -> bool: ...

    @property
    def kept(self) -> int: ...

    session: Session | None
    late: LateErrors


class ClientCore:
    """The operations both clients offer, and what a call does before and after its I/O.

    Args:
        address: ``"unix:/path"``, a plain path, ``"tcp://host:port"`` or ``"host:port"``; None:
            ``kvtier_protocol.address.default_address()`` — ``$KVTIER_ADDRESS``, else
            ``$KVTIER_SOCKET``, else the socket ``kvtier serve`` listens on by default.
        options: connection options; or pass their fields as keywords (token, tenant,
            client_name, timeout_s, connect_timeout_s, retries, holddown_s, lease_ms, ...).
        clock: the monotonic clock ``holddown_s`` is measured on (default ``time.monotonic``; tests
            pass a clock they advance by hand). Call deadlines always use ``time.monotonic``.

    The constructor does not connect: the first call does (see ``connect`` to fail early). On
    :class:`~kvtier.client.AsyncClient` every operation returns an awaitable of what it returns
    here.
    """

    _conn: Connection | None

    def __init__(self, address: str | Address | None = None, options: ClientOptions | None = None, *,
                 clock: Callable[[], float] = time.monotonic, **kwargs: Any) -> None:
        self.address = parse_address(default_address() if address is None else address)
        self.options = options if options is not None else ClientOptions(**kwargs)
        self._holddown = Holddown(self.options.holddown_s, clock=clock)
        self._conn = None
        self._closed = False
        self._late = LateErrors()  # write-behind failures of connections already replaced

    @property
    def session(self) -> Session | None:
        """The current connection's session (server, limits, segments), or None if not connected."""
        conn = self._conn
        return None if conn is None or conn.closed else conn.session

    @property
    def late_failures(self) -> int:
        """Write-behind commits that failed after their save returned, since the client was made
        (``ClientOptions.write_behind``; ``flush()`` raises them)."""
        conn = self._conn
        return self._late.total + (conn.late.total if conn is not None else 0)

    # -- operations --------------------------------------------------------------------------

    def lookup(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True,
               accept_lossy: bool | None = None) -> LookupResult:
        """How many of ``hashes``, from the first, are stored, and the tier of each hit.

        Args:
            ns_id: the namespace id (16 bytes).
            hashes: chain hashes of consecutive blocks of a prefix, first first.
            degrade: an unavailable daemon answers no hits instead of raising.
            accept_lossy: False: count exact copies only (a block stored lossily, e.g. re-encoded
                int8 on the daemon's disk tier, is a miss); None: the daemon's default (True
                unless its operator configured otherwise). The same keyword on the loads.

        Raises:
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
            InvalidKey: a malformed ns_id or hash.
        """
        flow = lookup_flow if accept_lossy is None else partial(lookup_flow, accept_lossy=accept_lossy)
        return self._run(Job(partial(_prepare_keys, flow, ns_id, hashes), idempotent=True,
                             degrade=degrade, fallback=NO_HITS))

    def save(self, ns_id: bytes, blocks: Sequence[tuple[bytes, bytes]], *,
             tokens: Sequence[Sequence[int] | None] | None = None,
             unit_hashes: Sequence[Sequence[bytes] | None] | None = None, priority: int = 0) -> list[str]:
        """Store whole block records; per block ``"stored"``, ``"exists"`` or ``"full"``.

        Args:
            ns_id: the namespace id; every record's header must name it and its key.
            blocks: ``(chain_hash, record)`` pairs; a record is header + payload (§4).
            tokens: optionally, per block, its token ids (for KV events).
            unit_hashes: optionally, per block, its hash-unit digests, last = the key.
            priority: eviction priority, -128..127 (higher is kept longer).

        Raises:
            Unavailable: the daemon is unreachable or silent.
            InvalidRequest, InvalidKey, HeaderError: malformed blocks (nothing is sent).
        """
        return self._run(Job(partial(prepare_save, ns_id, blocks, tokens=tokens,
                                     unit_hashes=unit_hashes, priority=priority),
                             idempotent=False))

    def load(self, ns_id: bytes, hashes: Sequence[bytes], *, degrade: bool = True,
             accept_lossy: bool | None = None) -> list[bytes]:
        """The whole records of the stored prefix of ``hashes`` (shorter on a miss).

        Each record is checked against its checksums and key; a failing one counts as a miss.

        Raises:
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
        """
        return self._run(Job(partial(prepare_load, ns_id, hashes, accept_lossy), idempotent=True, degrade=degrade,
                             fallback=[]))

    def get(self, ns_id: bytes, hashes: Sequence[bytes], *, decode: bool = False, degrade: bool = True,
            accept_lossy: bool | None = None) -> list[GotRecord]:
        """The verified records of the stored prefix of ``hashes``, fetched inline (the ``get``
        operation, on a TCP or a unix socket connection alike; shorter on a miss).

        Args:
            decode: False: each record as the daemon stores it (its header's codec may be lossy,
                e.g. int8 re-encoded on the disk tier, or its payload lz4-compressed). True: the
                daemon decodes every lossy or compressed record into a raw record of the block's
                dtype (same key, namespace, layout, shape; codec raw, a new checksum); a daemon
                that ignores the request key sends them as stored and this client decodes them
                (torch is imported then). Decoded or not, each result's ``decoded_from`` names
                the codec of the stored copy it came from, and ``exact`` says whether the values
                are the writer's: a block decoded from an int8 copy is raw in form, not in value.
            accept_lossy: False: a lossy stored copy is a miss (the prefix ends there), decode or
                not; None: the daemon's default. As for :meth:`load`.

        Raises:
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
            InvalidKey: a malformed ns_id or hash.
        """
        return self._run(Job(partial(prepare_get, ns_id, hashes, decode, accept_lossy), idempotent=True,
                             degrade=degrade, fallback=[], then=decode_rest if decode else None))

    def load_into(self, ns_id: bytes, hashes: Sequence[bytes], buffers: Sequence[Any], *,
                  degrade: bool = True, accept_lossy: bool | None = None) -> list[BlockHeader]:
        """Copy the payloads of the stored prefix of ``hashes`` into ``buffers``, one per key.

        Cheaper than :meth:`load`: no record is allocated, and each payload is verified (xxh3-64)
        chunk by chunk while it is copied. Buffer ``i`` receives block ``i``'s payload in its first
        ``headers[i].payload_len`` bytes (a bytearray, a memoryview, a numpy array, a CPU torch
        tensor's ``.numpy()``); buffers past the prefix are untouched.

        Returns:
            The verified headers of the blocks copied (layout, shape, dtype, codec, sections, to
            decode them), first first; shorter than ``hashes`` on a miss. A block that fails
            verification is a miss (its buffer's contents are then unspecified).

        Raises:
            InvalidRequest: not one writable contiguous buffer per key, or a buffer smaller
                than its block's payload (the blocks before it are copied).
            Unavailable: the daemon is unreachable or silent (only with ``degrade=False``).
        """
        return self._run(Job(partial(prepare_load_into, ns_id, hashes, buffers, accept_lossy), idempotent=True,
                             degrade=degrade, fallback=[]))

    def save_tensors(self, ns: Namespace, hashes: Sequence[bytes], tensors: Sequence[torch.Tensor], *,
                     layout: str = "canonical", codec: str = "raw",
                     parents: Sequence[bytes | None] | None = None, **save_kwargs: Any) -> list[str]:
        """Encode block tensors into records of namespace ``ns`` and :meth:`save` them.

        Args:
            parents: parent chain hash per block; None: ``hashes`` form one chain from the root.
            save_kwargs: as :meth:`save` takes them (tokens, unit_hashes, priority).
        """
        def prepare() -> FlowFactory:
            blocks = encode_blocks(ns, hashes, tensors, layout=layout, codec=codec, parents=parents)
            return prepare_save(ns.ns_id, blocks, **save_kwargs)
        return self._run(Job(prepare, idempotent=False))

    def load_tensors(self, ns: Namespace, hashes: Sequence[bytes], *, layout: str | None = None,
                     device: Any = "cpu", degrade: bool = True, accept_lossy: bool | None = None) -> list[torch.Tensor]:
        """:meth:`load` the stored prefix of ``hashes`` and decode each block into a tensor."""
        def decode(records: list[bytes]) -> list[torch.Tensor]:
            return decode_blocks(records, layout=layout, device=device) if records else []
        return self._run(Job(partial(prepare_load, ns.ns_id, hashes, accept_lossy), idempotent=True, degrade=degrade,
                             fallback=[], then=decode))

    def delete(self, ns_id: bytes, hashes: Sequence[bytes]) -> int:
        """Drop keys from every tier; returns how many existed."""
        return self._run(Job(partial(_prepare_keys, delete_flow, ns_id, hashes), idempotent=True))

    def clear(self, ns_id: bytes) -> int:
        """Drop every block of a namespace; returns how many there were."""
        return self._run(Job(partial(_prepare_clear, ns_id), idempotent=True))

    def stats(self) -> dict[str, Any]:
        """The daemon's counters and gauges (names are informative)."""
        return self._run(Job(lambda: stats_flow, idempotent=True))

    def ping(self) -> float:
        """Round-trip time of one ping, in seconds (connecting first if needed)."""
        return self._run(Job(lambda: ping_flow, idempotent=True))

    # -- what a call does around its I/O --------------------------------------------------------

    def _run(self, job: Job[T]) -> T:
        """Run ``job`` on a connection: the driver's I/O (an awaitable of the result, for
        AsyncClient)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        """Raise ConnectionLost once the client is closed (never degraded to misses)."""
        if self._closed:
            raise ConnectionLost("the client is closed")

    def _degraded(self, job: Job[Any], exc: Unavailable) -> Any:
        """What a call that found the daemon unavailable answers: ``job.fallback`` when it
        degrades (logged); else ``exc`` is raised."""
        if not job.degrade:
            raise exc
        log.warning("kvtier daemon at %s unavailable (%s); answering misses", self.address, exc.message)
        return job.fallback


# -- the small flows ----------------------------------------------------------------------------


def _prepare_keys(flow: Callable[[Session, bytes, list[bytes]], Flow[Any]], ns_id: bytes,
                  hashes: Sequence[bytes]) -> FlowFactory:
    ns_id, keys = check_ns_id(ns_id), check_hashes(hashes)
    return lambda s: flow(s, ns_id, keys)


def _prepare_clear(ns_id: bytes) -> FlowFactory:
    ns_id = check_ns_id(ns_id)
    return lambda s: clear_flow(s, ns_id)


def _batches(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def lookup_flow(s: Session, ns_id: bytes, hashes: list[bytes], accept_lossy: bool | None = None) -> Flow[LookupResult]:
    """Lookup in batches of ``max_batch``, stopping at the first batch with a miss."""
    tiers: list[str] = []
    for chunk in _batches(hashes, s.limits.max_batch):
        r = yield Call("lookup", {"ns_id": ns_id, "hashes": list(chunk), **lossy_keys(accept_lossy)})
        if r.num_hits > len(chunk):
            raise FrameError(f"lookup answered {r.num_hits} hits for {len(chunk)} keys")
        tiers.extend(r.tiers)
        if r.num_hits < len(chunk):
            break
    return LookupResult(len(tiers), tuple(tiers)) if tiers else NO_HITS


def delete_flow(s: Session, ns_id: bytes, hashes: list[bytes]) -> Flow[int]:
    """Drop keys from every tier; returns how many existed."""
    deleted = 0
    for chunk in _batches(hashes, s.limits.max_batch):
        r = yield Call("delete", {"ns_id": ns_id, "hashes": list(chunk)})
        deleted += r.deleted
    return deleted


def clear_flow(s: Session, ns_id: bytes) -> Flow[int]:
    """Drop every block of a namespace; returns how many there were."""
    return (yield Call("clear", {"ns_id": ns_id})).deleted


def stats_flow(s: Session) -> Flow[dict[str, Any]]:
    """The daemon's counters and gauges."""
    return (yield Call("stats")).stats


def ping_flow(s: Session) -> Flow[float]:
    """Round-trip time of one ping, in seconds."""
    start = time.perf_counter()
    yield Call("ping")
    return time.perf_counter() - start


__all__ = ["NO_HITS", "ClientCore", "Connection", "Job", "LookupResult", "clear_flow", "delete_flow",
           "lookup_flow", "ping_flow", "stats_flow"]
