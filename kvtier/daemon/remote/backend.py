"""What a remote tier holds, seen by the store: block records and namespaces by key. No I/O here.

The store sits on :class:`RemoteBlocks` and never learns which engine is behind it (Redis Cluster
today, :mod:`kvtier.daemon.remote.redis_cluster`; another engine later). Every call is batched and
answers per key; a fault of the engine (down, slow, failing over, partitioned) is a miss or a
``False``, never an exception: a remote tier can only make a request faster, never fail it. What
happened is counted in :class:`RemoteCounters` for the metrics layer.

A value read back is untrusted bytes: :mod:`kvtier.daemon.remote.verify` judges it.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier_protocol.namespace import NS_ID_LEN

TENANT_NAME = re.compile(r"[a-z0-9_-]{1,32}")
"""A tenant name as the daemon's configuration allows it (``kvtier.daemon.config.tenants``); no
``:``, ``{`` or ``}``, so a name can neither forge another tenant's key nor form a hash tag."""

MIN_HASH_LEN, MAX_HASH_LEN = 8, 64  # a chain hash's length bounds (SPEC.md §3)

Value = bytes | bytearray | memoryview
"""A record to upload: any contiguous bytes (a memoryview of a shared-memory slot uploads without
a copy)."""


@dataclass(frozen=True, slots=True)
class RemoteKey:
    """One block in a remote tier: the tenant it belongs to, its namespace and chain hash.

    Raises:
        ValueError: a tenant name outside ``[a-z0-9_-]{1,32}``, an ``ns_id`` that is not 16 bytes
            or a chain hash outside 8..64 bytes.
    """

    tenant: str
    ns_id: bytes
    chain_hash: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.tenant, str) or not TENANT_NAME.fullmatch(self.tenant):
            raise ValueError(f"tenant must match {TENANT_NAME.pattern}, got {self.tenant!r:.40}")
        if not isinstance(self.ns_id, bytes) or len(self.ns_id) != NS_ID_LEN:
            raise ValueError(f"ns_id must be {NS_ID_LEN} bytes, got {self.ns_id!r:.60}")
        if not isinstance(self.chain_hash, bytes) or not MIN_HASH_LEN <= len(self.chain_hash) <= MAX_HASH_LEN:
            raise ValueError(f"chain hash must be {MIN_HASH_LEN}..{MAX_HASH_LEN} bytes, got {self.chain_hash!r:.60}")

    @classmethod
    def of(cls, tenant: str, block_key: bytes) -> RemoteKey:
        """The remote key of a store key (``ns_id || chain_hash``, the store's ``BlockKey``)."""
        return cls(tenant, bytes(block_key[:NS_ID_LEN]), bytes(block_key[NS_ID_LEN:]))


FETCH_BUCKETS_S: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""Upper bounds (seconds) of the fetch-latency histogram's buckets; one more bucket counts the rest."""


@dataclass(slots=True)
class LatencyHistogram:
    """Cumulative-free histogram of latencies (Prometheus builds the cumulative form on export).

    Attributes:
        bounds_s: upper bound of each bucket, ascending.
        counts: observations per bucket; ``counts[-1]`` holds those above the last bound.
        sum_s: sum of every observation.
        count: observations in all.
    """

    bounds_s: tuple[float, ...] = FETCH_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(FETCH_BUCKETS_S) + 1))
    sum_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        """Count one latency."""
        i = 0
        while i < len(self.bounds_s) and seconds > self.bounds_s[i]:
            i += 1
        self.counts[i] += 1
        self.sum_s += seconds
        self.count += 1


@dataclass(slots=True)
class RemoteCounters:
    """What a remote tier did, for the metrics layer (monotonic counters plus the breaker state).

    Attributes:
        bytes_up / blocks_up: records stored (only those the engine acknowledged).
        bytes_down / blocks_down: records fetched (hits; verification is the caller's, see
            :mod:`kvtier.daemon.remote.verify`).
        misses: keys asked for by ``get`` that came back without a value, whatever the reason.
        put_failures: records not stored (refused, timed out, breaker open).
        deleted: keys deleted on request.
        errors: failed engine calls by kind (``timeout``, ``connection``, ``cluster_down``,
            ``auth``, ``oom``, ``response``, ``other``); one per failed batch, not per key.
        breaker_state: ``closed``, ``open`` or ``half_open``.
        breaker_opens: times the breaker opened from closed (a failed probe re-opening it does
            not count again).
        skipped: calls answered at once (misses / False) because the breaker was open.
        fetch_latency: latency of each ``get`` call that reached the engine.
    """

    bytes_up: int = 0
    blocks_up: int = 0
    bytes_down: int = 0
    blocks_down: int = 0
    misses: int = 0
    put_failures: int = 0
    deleted: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    breaker_state: str = "closed"
    breaker_opens: int = 0
    skipped: int = 0
    fetch_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def error(self, kind: str) -> None:
        """Count one failed call of ``kind``."""
        self.errors[kind] = self.errors.get(kind, 0) + 1


class RemoteBlocks(abc.ABC):
    """Block records and namespaces in a remote tier shared by many hosts.

    Every method is batched (one call, many keys, one answer per key in order) and never raises
    for a fault of the remote engine: a key it could not answer for is a miss (``None``), absent
    (``False``) or not stored (``False``) within the call's timeout. ``timeout_s`` overrides the
    backend's per-call timeout for one call (a lookup's small budget, say); what did not answer in
    time counts as not there.

    Raises (only for caller bugs): ValueError from :class:`RemoteKey`; TypeError for a value that
    is not bytes-like.
    """

    @abc.abstractmethod
    async def exists(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> list[bool]:
        """Whether each key holds a value now (a hint: it may be evicted before a ``get``)."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[RemoteKey], *,
                  timeout_s: float | None = None) -> list[bytes | bytearray | None]:
        """Each key's value (untrusted bytes: verify before use; a ``bytearray`` where the backend
        received it in place), or None."""

    @abc.abstractmethod
    async def put(self, items: Sequence[tuple[RemoteKey, Value]], *,
                  timeout_s: float | None = None) -> list[bool]:
        """Store each record under its key (overwriting); True where the engine acknowledged it."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> None:
        """Remove the keys (a value that failed verification, say); best effort."""

    @abc.abstractmethod
    async def put_namespace(self, tenant: str, ns_id: bytes, canonical: bytes, *,
                            timeout_s: float | None = None) -> bool:
        """Store a namespace's canonical bytes, so a daemon that never saw it can serve it."""

    @abc.abstractmethod
    async def get_namespace(self, tenant: str, ns_id: bytes, *,
                            timeout_s: float | None = None) -> bytes | None:
        """A namespace's canonical bytes (untrusted: see ``verify.verify_namespace``), or None."""

    def prepare(self) -> None:
        """Start connecting in the background, if the engine needs to (called once the event
        loop runs, at the daemon's start); a call before it is ready answers misses."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections; the object answers nothing afterwards."""

    @property
    @abc.abstractmethod
    def counters(self) -> RemoteCounters:
        """The live counters (read them; do not write them)."""


class NoRemoteBlocks(RemoteBlocks):
    """No remote tier: everything is a miss, nothing is stored, nothing is counted but misses.

    What the store uses when ``--remote`` is not given, so it needs no ``if remote is None``.
    """

    def __init__(self) -> None:
        self._counters = RemoteCounters()

    async def exists(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> list[bool]:
        return [False] * len(keys)

    async def get(self, keys: Sequence[RemoteKey], *,
                  timeout_s: float | None = None) -> list[bytes | bytearray | None]:
        self._counters.misses += len(keys)
        return [None] * len(keys)

    async def put(self, items: Sequence[tuple[RemoteKey, Value]], *,
                  timeout_s: float | None = None) -> list[bool]:
        self._counters.put_failures += len(items)
        return [False] * len(items)

    async def delete(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> None:
        return None

    async def put_namespace(self, tenant: str, ns_id: bytes, canonical: bytes, *,
                            timeout_s: float | None = None) -> bool:
        return False

    async def get_namespace(self, tenant: str, ns_id: bytes, *,
                            timeout_s: float | None = None) -> bytes | None:
        return None

    async def close(self) -> None:
        return None

    @property
    def counters(self) -> RemoteCounters:
        return self._counters
