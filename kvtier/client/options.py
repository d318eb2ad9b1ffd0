"""Options of a kvtier client connection (shared by :class:`Client` and :class:`AsyncClient`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier_protocol.errors import InvalidRequest
from kvtier_protocol.wire_checks import DEFAULT_LEASE_MS, MAX_TEXT_LEN

from kvtier.client.memcopy import MAX_COPY_THREADS, default_copy_threads, env_copy_threads


VERIFY_MODES = ("auto", "always")

PIPELINE_BYTES = 16 << 20
"""A good ``ClientOptions.pipeline_bytes`` where the daemon has a core of its own: large enough
that a request's fixed cost (a round trip and the daemon's per-request work, ~50-500 us) is small
next to the copy of one sub-batch (~2-4 ms), small enough that a 64 MiB call has four to overlap.
Not the default: on a host whose cores are busy, Linux runs the daemon woken by a unix-socket send
on the sender's core, so each request preempts the copying client, and the pipelined flows
measured 5-25 % slower than one request at a time on the 2-core development host."""

GRANT_BYTES = 256 << 20
"""Default ``ClientOptions.grant_bytes``: four 64 MiB saves' worth, a small share of a host tier."""


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client connects and how long it waits.

    Attributes:
        token: the daemon's shared secret; required over TCP (and where the daemon asks for it
            on its unix socket). Kept out of reprs and logs.
        tenant: the tenant whose store to use (its token must be presented too); None: the
            store the token selects (a tenant token: its tenant; otherwise the default store).
        client_name: free-form name the daemon logs for this connection.
        timeout_s: bound on one call as a whole: every round trip, reconnect and retry it makes.
            A call that runs out of time raises :class:`TimedOut` (or degrades to misses).
        connect_timeout_s: bound on one connect + hello (also within ``timeout_s``).
        retries: reconnect-and-retry attempts of an idempotent call after a lost connection
            (``save`` retries at most once, and only before its commit was sent).
        holddown_s: after a call found the daemon unavailable, later calls within this time fail
            (or degrade) at once instead of waiting on a dead or stuck daemon again.
        lease_ms: lifetime asked for reservations (save) and pins (load) over shared memory; the
            daemon reclaims them after this time if the client vanishes.
        verify: which loaded payloads the client hashes against their header checksum.
            ``"auto"``: all, except shared-memory slots the daemon reports it checked after they
            were written (a host copy checked at commit or on promotion from disk is immutable
            until freed, so hashing it again on every load only halves load bandwidth).
            ``"always"``: every payload, whatever the daemon says. Headers, keys and lengths are
            checked either way; a failed check is a miss.
        pipeline_bytes: 0 (default): a save or load over shared memory sends one request batch at
            a time and waits for each answer (releases excepted). > 0: payload bytes per
            sub-batch of a pipelined save or load, whose requests travel while the client copies
            another sub-batch (kvtier.client.save, kvtier.client.load; :data:`PIPELINE_BYTES` is a good value
            where the daemon has an idle core).
        write_behind: False (default): a save over shared memory returns once the daemon
            answered its commit, so ``"stored"`` is final. True: it returns once the payloads are
            in shared memory and the commit is on its way; the commit's answer is claimed later
            (kvtier.client.save), so the daemon makes the blocks visible while the caller
            goes on. Reads on the same client (lookup, load, delete, stats...) still see every
            earlier save: they first wait for the commits still unanswered. A commit the daemon
            refuses later is logged, counted and raised by ``flush()``; its blocks are then
            simply not stored (a miss later, never a wrong hit).
        grant_bytes: the most payload bytes of slots the daemon grants this connection ahead of
            its saves over shared memory (kvtier.client.grants; at most an eighth of the
            daemon's host memory): a save of blocks of one size that fits copies into granted
            slots at once and needs one round trip instead of two. They are held until used, the
            connection ends, or half their lease passed. 0: every save reserves its slots.
        copy_threads: threads that copy a batch of payloads into and out of shared memory
            (kvtier.client.memcopy.copy_many_threads: batches from 8 MiB on are shared out; one core does
            not reach the memory's bandwidth). None (default): ``$KVTIER_COPY_THREADS`` if set,
            else the CPUs this process may use (its affinity and its cgroup's CPU quota), at most
            4. 1: the calling thread alone.
    """

    token: str | None = field(default=None, repr=False)
    tenant: str | None = None
    client_name: str = "kvtier.client"
    timeout_s: float = 5.0
    connect_timeout_s: float = 2.0
    retries: int = 2
    holddown_s: float = 1.0
    lease_ms: int = DEFAULT_LEASE_MS
    verify: str = "auto"
    pipeline_bytes: int = 0
    write_behind: bool = False
    grant_bytes: int = GRANT_BYTES
    copy_threads: int | None = None

    def __post_init__(self) -> None:
        for name in ("token", "tenant"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or len(value) > MAX_TEXT_LEN):
                raise InvalidRequest(f"client option {name} must be a string of at most "
                                     f"{MAX_TEXT_LEN} characters")
        if not isinstance(self.client_name, str) or not 0 < len(self.client_name) <= MAX_TEXT_LEN:
            raise InvalidRequest("client option client_name must be a non-empty string")
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise InvalidRequest(f"client option {name} must be a positive number of seconds, "
                                     f"got {value!r}")
        if not isinstance(self.holddown_s, (int, float)) or not 0 <= self.holddown_s < math.inf:
            raise InvalidRequest(f"client option holddown_s must be >= 0, got {self.holddown_s!r}")
        if type(self.retries) is not int or not 0 <= self.retries <= 10:
            raise InvalidRequest(f"client option retries must be an integer in 0..10, got {self.retries!r}")
        if self.verify not in VERIFY_MODES:
            raise InvalidRequest(f"client option verify must be one of {VERIFY_MODES}, got {self.verify!r}")
        if type(self.pipeline_bytes) is not int or self.pipeline_bytes < 0:
            raise InvalidRequest(f"client option pipeline_bytes must be an integer >= 0, "
                                 f"got {self.pipeline_bytes!r}")
        if type(self.grant_bytes) is not int or self.grant_bytes < 0:
            raise InvalidRequest(f"client option grant_bytes must be an integer >= 0, got {self.grant_bytes!r}")
        if self.copy_threads is not None and (type(self.copy_threads) is not int
                                              or not 1 <= self.copy_threads <= MAX_COPY_THREADS):
            raise InvalidRequest(f"client option copy_threads must be an integer in 1..{MAX_COPY_THREADS} "
                                 f"or None, got {self.copy_threads!r}")
        if self.copy_threads is None:
            try:
                env_copy_threads()  # a malformed setting fails here, not at the first save
            except ValueError as e:
                raise InvalidRequest(str(e)) from None
        if type(self.write_behind) is not bool:
            raise InvalidRequest(f"client option write_behind must be a bool, got {self.write_behind!r}")
        if type(self.lease_ms) is not int or self.lease_ms < 1:
            raise InvalidRequest(f"client option lease_ms must be a positive integer, got {self.lease_ms!r}")

    @property
    def resolved_copy_threads(self) -> int:
        """``copy_threads``, or the default for this process when None (kvtier.client.memcopy:
        ``KVTIER_COPY_THREADS``, else its CPUs, at most 4).

        Raises:
            InvalidRequest: ``KVTIER_COPY_THREADS`` is malformed.
        """
        if self.copy_threads is not None:
            return self.copy_threads
        try:
            return default_copy_threads()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
