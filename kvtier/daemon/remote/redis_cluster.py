"""The remote tier on a Redis (or Valkey) Cluster, through redis-py's asyncio ``RedisCluster``.

Keys (no hash tag, so a namespace's blocks spread over every shard)::

    <prefix>:<tenant>:<ns_id hex>:<chain hash hex>    a block's whole record (header + payload)
    <prefix>:<tenant>:ns:<ns_id hex>                   a namespace's canonical bytes

A batch is sorted by hash slot and cut into pipelines of ``batch_keys`` commands (consecutive
slots mostly share a master, so a pipeline is mostly one round trip to one node); up to
``parallel`` pipelines of a call are in flight at once. The whole call runs under one deadline:
what has not answered by then is a miss, what has answered is kept. Block GETs are read through
:mod:`kvtier.daemon.remote.resp_get` (values received straight into their own buffers; redis-py
for the slot map, redirections and every other command).

Faults never reach the caller: a connection refused, a timeout, a cluster that is down or failing
over, an ACL refusal is a miss / ``False``, counted by kind in :class:`RemoteCounters`. A circuit
breaker (:mod:`kvtier.daemon.remote.breaker`) stops calling a cluster that failed
``breaker.failures`` calls in a row, and lets one probe through after a back-off.

The cluster kvtier expects: ``cluster-require-full-coverage no`` (a lost shard must not stop the
others), ``maxmemory`` with ``maxmemory-policy allkeys-lru`` (the remote tier's eviction), one
replica per master (failover instead of loss), and, with tenants, one ACL user per tenant limited
to ``~<prefix>:<tenant>:*``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redis import exceptions as rx
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from kvtier_protocol.namespace import NS_ID_LEN

from kvtier.daemon.remote.address import PREFIX, ClusterAddress, parse_cluster_url
from kvtier.daemon.remote.backend import TENANT_NAME, RemoteBlocks, RemoteCounters, RemoteKey, Value
from kvtier.daemon.remote.breaker import BreakerSettings, BreakerState, CircuitBreaker
from kvtier.daemon.remote.resp_get import FastGets, RespAuth

log = logging.getLogger(__name__)

TRANSPORT = frozenset(("timeout", "connection", "cluster_down"))
"""Error kinds that mean the cluster (or a shard) could not be reached: what the breaker counts."""
REFRESH_INTERVAL_S = 0.25
"""Least time between two topology refreshes (one runs after a call that found a node unreachable)."""


@dataclass(frozen=True, slots=True)
class RedisClusterSettings:
    """How to reach the cluster. Nothing here is secret: the password stays in its file.

    Attributes:
        url: seed nodes, ``redis+cluster://HOST:PORT[,HOST:PORT...]`` or ``rediss+cluster://``.
        user: ACL user (None: the default user).
        password_file: file whose first line is the password (None: no password).
        timeout_s: per-call deadline (the whole batch), also the socket timeout.
        prefix: first part of every key (``[A-Za-z0-9_.-]{1,64}``).
        batch_keys: commands per pipeline.
        parallel: pipelines of one call in flight at once.
        tls_ca_file: CA bundle to verify the servers' certificates (TLS only; None: system CAs).
        breaker: the circuit breaker's thresholds.
    """

    url: str
    user: str | None = None
    password_file: str | None = None
    timeout_s: float = 1.0
    prefix: str = "kvtier"
    batch_keys: int = 8
    parallel: int = 4
    tls_ca_file: str | None = None
    breaker: BreakerSettings = field(default_factory=BreakerSettings)

    def __post_init__(self) -> None:
        parse_cluster_url(self.url)
        if not PREFIX.fullmatch(self.prefix):
            raise ValueError(f"key prefix must match {PREFIX.pattern}, got {self.prefix!r:.80}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        for name in ("batch_keys", "parallel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")


def block_key(prefix: str, key: RemoteKey) -> bytes:
    """The cluster key of a block."""
    return f"{prefix}:{key.tenant}:{key.ns_id.hex()}:{key.chain_hash.hex()}".encode()


def namespace_key(prefix: str, tenant: str, ns_id: bytes) -> bytes:
    """The cluster key of a namespace's canonical bytes.

    Raises:
        ValueError: a bad tenant name or ``ns_id``.
    """
    if not isinstance(tenant, str) or not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant must match {TENANT_NAME.pattern}, got {tenant!r:.40}")
    if not isinstance(ns_id, bytes) or len(ns_id) != NS_ID_LEN:
        raise ValueError(f"ns_id must be {NS_ID_LEN} bytes, got {ns_id!r:.60}")
    return f"{prefix}:{tenant}:ns:{ns_id.hex()}".encode()


def error_kind(e: BaseException) -> str:
    """The counter name of a failure (the order matters: redis-py's classes nest)."""
    if isinstance(e, (asyncio.TimeoutError, asyncio.CancelledError, rx.TimeoutError)):
        return "timeout"
    if isinstance(e, (rx.NoPermissionError, rx.AuthenticationError, rx.AuthenticationWrongNumberOfArgsError)):
        return "auth"
    if isinstance(e, rx.OutOfMemoryError):
        return "oom"
    if isinstance(e, (rx.ClusterDownError, rx.TryAgainError, rx.RedisClusterException)):
        return "cluster_down"
    if isinstance(e, (rx.ConnectionError, OSError)):
        return "connection"
    if isinstance(e, rx.ResponseError):
        return "response"
    return "other"


class _Failed:
    """A command that got no answer (the reason is counted once per pipeline, not per key)."""

    __slots__ = ("kind",)

    def __init__(self, kind: str) -> None:
        self.kind = kind


def _read_password(path: str | None) -> str | None:
    if path is None:
        return None
    lines = Path(path).read_text().splitlines()
    return lines[0] if lines else ""


class RedisClusterBlocks(RemoteBlocks):
    """Block records in a Redis Cluster. See the module docstring for keys and faults.

    Construction reads the password file and checks the settings; nothing connects until the
    first call (a cluster down at start is a miss like any other, and the breaker's business).

    Raises (construction): ValueError for bad settings; OSError when the password file cannot be
    read.
    """

    def __init__(self, settings: RedisClusterSettings, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.address = parse_cluster_url(settings.url)
        self._password = _read_password(settings.password_file)
        self._counters = RemoteCounters()
        self._breaker = CircuitBreaker(settings.breaker, clock=clock, on_change=self._breaker_changed)
        self._client: RedisCluster | None = None
        self._clock = clock
        self._refresh: asyncio.Task[None] | None = None  # a topology refresh in flight
        self._init: asyncio.Task[Any] | None = None  # the client's first slot-map discovery
        self._init_started = 0.0
        self._refreshed_at = -REFRESH_INTERVAL_S
        self._stragglers: set[asyncio.Task[Any]] = set()  # cancelled pipelines still unwinding
        self._closed = False
        self._fast = FastGets(RespAuth(settings.user, self._password, self.address.tls, settings.tls_ca_file))

    def __repr__(self) -> str:  # never the password
        return f"RedisClusterBlocks({self.address}, user={self.settings.user!r}, prefix={self.settings.prefix!r})"

    @property
    def counters(self) -> RemoteCounters:
        return self._counters

    @property
    def breaker_state(self) -> BreakerState:
        """The circuit breaker's state now."""
        return self._breaker.state

    # -- the interface ------------------------------------------------------------------------

    async def exists(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> list[bool]:
        prefix = self.settings.prefix
        answers = await self._call([("EXISTS", block_key(prefix, k)) for k in keys], timeout_s)
        return [not isinstance(a, (_Failed, BaseException)) and bool(a) for a in answers]

    async def get(self, keys: Sequence[RemoteKey], *,
                  timeout_s: float | None = None) -> list[bytes | bytearray | None]:
        prefix = self.settings.prefix
        start = time.perf_counter()
        answers = await self._call([("GET", block_key(prefix, k)) for k in keys], timeout_s, fast=True)
        if keys and not all(isinstance(a, _Failed) and a.kind == "skipped" for a in answers):
            self._counters.fetch_latency.observe(time.perf_counter() - start)
        out: list[bytes | bytearray | None] = []
        c = self._counters
        for a in answers:
            if isinstance(a, (bytes, bytearray)):
                out.append(a)
                c.blocks_down += 1
                c.bytes_down += len(a)
            else:
                out.append(None)
                c.misses += 1
        return out

    async def put(self, items: Sequence[tuple[RemoteKey, Value]], *,
                  timeout_s: float | None = None) -> list[bool]:
        prefix = self.settings.prefix
        values = [_bytes_like(v) for _, v in items]
        answers = await self._call([("SET", block_key(prefix, k), v) for (k, _), v in zip(items, values)], timeout_s)
        out = [a is True or a == b"OK" for a in answers]
        c = self._counters
        for ok, v in zip(out, values):
            if ok:
                c.blocks_up += 1
                c.bytes_up += v.nbytes if isinstance(v, memoryview) else len(v)
            else:
                c.put_failures += 1
        return out

    async def delete(self, keys: Sequence[RemoteKey], *, timeout_s: float | None = None) -> None:
        prefix = self.settings.prefix
        answers = await self._call([("DEL", block_key(prefix, k)) for k in keys], timeout_s)
        self._counters.deleted += sum(1 for a in answers if isinstance(a, int) and a > 0)

    async def put_namespace(self, tenant: str, ns_id: bytes, canonical: bytes, *,
                            timeout_s: float | None = None) -> bool:
        key = namespace_key(self.settings.prefix, tenant, ns_id)
        [a] = await self._call([("SET", key, _bytes_like(canonical))], timeout_s)
        return a is True or a == b"OK"

    async def get_namespace(self, tenant: str, ns_id: bytes, *,
                            timeout_s: float | None = None) -> bytes | None:
        key = namespace_key(self.settings.prefix, tenant, ns_id)
        [a] = await self._call([("GET", key)], timeout_s)
        return a if isinstance(a, bytes) else None

    def prepare(self) -> None:
        """Start discovering the cluster now, in the background (the daemon calls it at start),
        so that the first lookup, whose budget is a few milliseconds, finds a client ready."""
        self._initialized(self._cluster())

    async def close(self) -> None:
        self._closed = True
        if self._init is not None and not self._init.done():
            self._init.cancel()
            await asyncio.gather(self._init, return_exceptions=True)
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
        if self._stragglers:
            await asyncio.gather(*self._stragglers, return_exceptions=True)
        self._fast.close()
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    # -- the engine -----------------------------------------------------------------------------

    def _cluster(self) -> RedisCluster:
        """The client, made on first use (inside the loop that will drive it)."""
        if self._closed:
            raise RuntimeError("RedisClusterBlocks is closed")
        if self._client is None:
            s = self.settings
            extra: dict[str, Any] = {}
            if self.address.tls:
                extra.update(ssl=True, ssl_ca_certs=s.tls_ca_file)
            self._client = RedisCluster(
                startup_nodes=[ClusterNode(h, p) for h, p in self.address.nodes],
                username=s.user, password=self._password, decode_responses=False,
                socket_timeout=s.timeout_s, socket_connect_timeout=s.timeout_s,
                # A lost shard must not turn the others' keys into errors: only its slots miss.
                require_full_coverage=False,
                # One quick retry (a MOVED topology refresh); the call's deadline bounds the rest.
                retry=Retry(NoBackoff(), 1),
                **extra)
        return self._client

    async def _call(self, commands: list[tuple[Any, ...]], timeout_s: float | None, *,
                    fast: bool = False) -> list[Any]:
        """Run single-key commands in pipelines; one answer per command: the reply or a _Failed.
        ``fast``: the commands are GETs of block records, read through :class:`FastGets`."""
        if not commands:
            return []
        if not self._breaker.allow():
            self._counters.skipped += 1
            return [_Failed("skipped")] * len(commands)
        deadline = self.settings.timeout_s if timeout_s is None else timeout_s
        answers: list[Any] = [_Failed("timeout")] * len(commands)
        # Sorted by hash slot: a pipeline of consecutive slots mostly talks to one master.
        order = sorted(range(len(commands)), key=lambda i: key_slot(commands[i][1]))
        n = self.settings.batch_keys
        chunks = [order[i:i + n] for i in range(0, len(order), n)]
        gate = asyncio.Semaphore(self.settings.parallel)
        reached = failed = False
        kinds: set[str] = set()
        client = self._cluster()
        init = self._initialized(client)
        if not init.done():
            # The slot map is being discovered (first use, or again after a failed discovery):
            # wait for it within this call's deadline, never cancelling it, so that calls with
            # small budgets (lookups) cannot keep the client from ever getting ready.
            began = time.monotonic()
            await asyncio.wait([init], timeout=deadline)
            deadline -= time.monotonic() - began
            if not init.done() or (deadline <= 0 and init.exception() is None):
                self._counters.error("timeout")
                # A discovery pending longer than a whole call's timeout is a cluster that does
                # not answer (a failure for the breaker); a younger one only outlasted a small
                # budget (a lookup's) and says nothing yet.
                if self._clock() - self._init_started >= self.settings.timeout_s:
                    self._breaker.failure()
                else:
                    self._breaker.abandon()
                return answers
            if init.exception() is not None:
                kind = error_kind(init.exception())  # type: ignore[arg-type]
                self._counters.error(kind)
                self._breaker.failure()
                return [_Failed(kind)] * len(commands)
        run = self._fast_pipeline if fast else self._pipeline
        tasks = [asyncio.ensure_future(run(client, gate, [commands[i] for i in chunk])) for chunk in chunks]
        try:
            _, pending = await asyncio.wait(tasks, timeout=deadline)
        except asyncio.CancelledError:  # our caller gave up: so do we, and the probe slot is free
            self._breaker.abandon()
            for task in tasks:
                task.cancel()
                self._stragglers.add(task)
                task.add_done_callback(self._straggler_done)
            raise
        for task in pending:
            task.cancel()
            self._stragglers.add(task)
            task.add_done_callback(self._straggler_done)
        for chunk, task in zip(chunks, tasks):
            if task in pending:
                failed = True
                kinds.add("timeout")
                continue
            exc = task.exception()
            if exc is not None:
                failed = True
                kinds.add(error_kind(exc))
                log.debug("remote %s pipeline failed: %s", commands[chunk[0]][0], type(exc).__name__)
                for i in chunk:
                    answers[i] = _Failed(error_kind(exc))
                continue
            chunk_reached = False
            for i, reply in zip(chunk, task.result()):
                if isinstance(reply, BaseException):
                    kind = error_kind(reply)
                    kinds.add(kind)
                    answers[i] = _Failed(kind)
                    chunk_reached |= kind not in TRANSPORT
                else:
                    answers[i] = reply
                    chunk_reached = True
            reached |= chunk_reached
            failed |= not chunk_reached
        for kind in kinds:
            self._counters.error(kind)
        if kinds & TRANSPORT:
            self._refresh_topology(client)
        # A call that reached any node proves the cluster is there (a lost shard alone must not
        # open the breaker for every other shard); one that reached none is a failure.
        if reached:
            self._breaker.success()
        elif failed:
            self._breaker.failure()
        else:
            self._breaker.abandon()
        return answers

    def _initialized(self, client: RedisCluster) -> asyncio.Task[Any]:
        """The client's discovery task: started once, and again after one that failed."""
        init = self._init
        if init is None or (init.done() and (init.cancelled() or init.exception() is not None)):
            init = self._init = asyncio.ensure_future(client.initialize())
            self._init_started = self._clock()
            init.add_done_callback(_retrieved)
        return init

    def _refresh_topology(self, client: RedisCluster) -> None:
        """Ask the cluster for its slot map again, in the background.

        A node that stopped answering (a host cut off) makes redis-py refresh its topology only
        when its own socket timeout fires before the call's deadline cancels it; a call cancelled
        first leaves the old map, and every later call would time out on the old master forever,
        even after its replica took over. So a call that found a node unreachable starts one
        refresh that no call's deadline cancels (at most one at a time, at most one per
        REFRESH_INTERVAL_S)."""
        now = self._clock()
        if (self._refresh is not None and not self._refresh.done()) or now - self._refreshed_at < REFRESH_INTERVAL_S:
            return
        self._refreshed_at = now
        self._refresh = asyncio.ensure_future(self._rediscover(client))

    @staticmethod
    async def _rediscover(client: RedisCluster) -> None:
        try:
            await client.nodes_manager.initialize()
        except Exception as e:  # nobody answered: the next failed call starts another refresh
            log.debug("remote topology refresh failed: %s", type(e).__name__)

    @staticmethod
    async def _pipeline(client: RedisCluster, gate: asyncio.Semaphore, commands: list[tuple[Any, ...]]) -> list[Any]:
        async with gate:
            pipe = client.pipeline()
            for command in commands:
                pipe.execute_command(*command)
            return await pipe.execute(raise_on_error=False)

    async def _fast_pipeline(self, client: RedisCluster, gate: asyncio.Semaphore,
                             commands: list[tuple[Any, ...]]) -> list[Any]:
        """:meth:`_pipeline` of GETs through :class:`FastGets`: one pipeline per master, all at
        once. What the slot map cannot place, what a node answers MOVED / ASK / TRYAGAIN (a slot
        migrating, a failover redis-py has not seen) and the keys of a node that could not be
        reached go through redis-py's pipeline, which follows redirections, refreshes the map
        and answers (or fails) as it did before this path existed."""
        async with gate:
            nodes: dict[tuple[str, int], list[int]] = {}
            slow: list[int] = []
            for i, command in enumerate(commands):
                try:
                    node = client.nodes_manager.get_node_from_slot(key_slot(command[1]))
                except (rx.RedisError, rx.RedisClusterException, KeyError, IndexError):  # no node for the slot
                    slow.append(i)
                    continue
                nodes.setdefault((node.host, node.port), []).append(i)
            replies: list[Any] = [None] * len(commands)
            got = await asyncio.gather(*(self._fast.get(node, [commands[i][1] for i in idx])
                                         for node, idx in nodes.items()), return_exceptions=True)
            for idx, answer in zip(nodes.values(), got):
                if isinstance(answer, BaseException):
                    if isinstance(answer, asyncio.CancelledError):
                        raise answer
                    # A node not reached (killed, failed over): redis-py tries again the way it
                    # always did (refreshing its map), within the same deadline.
                    log.debug("remote fast GET from a node failed: %s", type(answer).__name__)
                    slow += idx
                    continue
                for i, reply in zip(idx, answer):
                    if isinstance(reply, (rx.MovedError, rx.AskError, rx.TryAgainError)):
                        slow.append(i)
                    else:
                        replies[i] = reply
            if slow:
                slow.sort()
                pipe = client.pipeline()
                for i in slow:
                    pipe.execute_command(*commands[i])
                for i, reply in zip(slow, await pipe.execute(raise_on_error=False)):
                    replies[i] = reply
            return replies

    def _straggler_done(self, task: asyncio.Task[Any]) -> None:
        self._stragglers.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late failure of a call already answered is not news

    def _breaker_changed(self, old: BreakerState, new: BreakerState) -> None:
        self._counters.breaker_state = new.value
        if new is BreakerState.OPEN:
            if old is BreakerState.CLOSED:
                self._counters.breaker_opens += 1
                log.warning("remote tier %s unreachable: circuit breaker open, calls answer misses "
                            "until a probe succeeds", self.address)
        elif new is BreakerState.CLOSED:
            log.warning("remote tier %s reachable again: circuit breaker closed", self.address)


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a background task's failure as seen (the next call looks at it and counts it)."""
    if not task.cancelled():
        task.exception()


def _bytes_like(v: Value) -> bytes | memoryview:
    """What redis-py packs without a copy: bytes or a byte memoryview.

    Raises:
        TypeError: not bytes-like.
    """
    if isinstance(v, bytes):
        return v
    if isinstance(v, (bytearray, memoryview)):
        return memoryview(v).cast("B")
    raise TypeError(f"a remote value must be bytes-like, got {type(v).__name__}")
