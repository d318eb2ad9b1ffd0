"""What a connection learns at hello (SPEC.md §7.4): the server, its limits, its segments.

Shared by the blocking and the asyncio transports: they differ only in how bytes and
descriptors move, not in what the hello request says or how its answer is checked.
"""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier_protocol import PROTOCOL_VERSION
from kvtier_protocol.errors import UnsupportedVersion
from kvtier_protocol.frames import PLACE_GRANT, QUIET_RELEASE, HelloResponse, Limits

from kvtier.client.grants import GrantPool, pool_limit
from kvtier.client.options import ClientOptions
from kvtier.client.shm import SegmentMap

MIN_INFLIGHT = 4
"""Below this ``max_inflight`` the flows wait for every answer (no room for a pipeline)."""

MAX_FDS = 253
"""Room for descriptors when reading the hello response (Linux's SCM_MAX_FD): a daemon may hand
out one segment per tenant pool, and descriptors that find no room are lost (MSG_CTRUNC)."""


@dataclass(slots=True)
class Session:
    """One connection's view of the daemon, fixed at hello.

    Attributes:
        server: the server's name and version (for logs).
        limits: the daemon's limits; requests stay within them, responses are checked against them.
        shm: the mapped host segments (unix socket), or None: then save and load go inline (put/get).
        lease_ms: lease lifetime asked for reservations and pins, within ``limits.max_lease_ms``.
        trust_checked: skip hashing slots the daemon reports checked (``ClientOptions.verify``).
        pipeline_bytes: payload bytes per pipelined sub-batch, 0: none (``ClientOptions``).
        write_behind: saves do not wait for their commits' answers (``ClientOptions``).
        grants: the slots granted to this connection ahead of saves (kvtier.client.grants), or
            None (TCP, or ``ClientOptions.grant_bytes`` 0).
        peer_gone: whether the daemon has hung up this connection (set by the driver, see
            :func:`hangup_probe`); None: unknown.
        quiet_release: the daemon announced ``quiet_release`` at hello: releases are sent
            ``quiet`` (no answer written, none read; see :func:`release_keys`).
        place_grant: the daemon announced ``place_grant``: a save into granted slots asks for
            its refill in its ``place`` (kvtier.client.save.granted_save_flow).
    """

    server: str
    limits: Limits
    shm: SegmentMap | None
    lease_ms: int
    trust_checked: bool = False
    pipeline_bytes: int = 0
    write_behind: bool = False
    grants: GrantPool | None = None
    peer_gone: Callable[[], bool] | None = None
    quiet_release: bool = False
    place_grant: bool = False

    @property
    def piped(self) -> bool:
        """Whether saves and loads run as pipelines of sub-batches (kvtier.client.save,
        kvtier.client.load): ``pipeline_bytes`` set and room for several requests in flight."""
        return self.pipeline_bytes > 0 and self.limits.max_inflight >= MIN_INFLIGHT

    def close(self) -> None:
        """Unmap the segments (idempotent)."""
        if self.shm is not None:
            self.shm.close()


def hangup_probe(fd: int, closed: Callable[[], bool]) -> Callable[[], bool]:
    """A check, without reading, of whether the peer of the connected socket ``fd`` has hung up
    (EOF or reset; POLLRDHUP, POLLHUP and POLLERR), or ``closed()`` says this side closed it.

    Why it exists: granted slots are copied into before any request of the save is sent. A daemon
    killed and restarted meanwhile adopts the same shared-memory segments (host-tier recovery)
    and may have given those slots to other blocks, which a late copy would overwrite under a
    checksum they already passed. A daemon alive when this runs cannot have been replaced during
    the microseconds of a copy: a restart takes a new process seconds.
    """
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)  # POLLHUP and POLLERR are always reported
    return lambda: closed() or bool(poller.poll(0))


def release_keys(session: Session, lease: int) -> dict[str, Any]:
    """The keys of a ``release`` of ``lease`` that nothing waits for: ``quiet`` where the daemon
    takes it. No flow waits for a release (a lost one expires on its own), so its answer would
    only be read to be dropped: one frame less each way per load (SPEC 7.4). A release sent with
    ``wait`` (a caller that wants to know it took) is answered as ever."""
    return {"lease": lease, "quiet": True} if session.quiet_release else {"lease": lease}


def hello_keys(options: ClientOptions) -> dict[str, Any]:
    """The op-specific keys of the hello request, in wire order (token last, omitted if None)."""
    keys: dict[str, Any] = {"version": PROTOCOL_VERSION, "client": options.client_name}
    if options.tenant is not None:
        keys["tenant"] = options.tenant
    if options.token is not None:
        keys["token"] = options.token
    return keys


def open_session(response: HelloResponse, fds: Sequence[int], options: ClientOptions) -> Session:
    """Check a hello response and map the segments whose descriptors came with it.

    The descriptors are always consumed (mapped, then closed).

    Raises:
        UnsupportedVersion: the server speaks another protocol version.
        FrameError: the number of descriptors differs from the segments announced.
        StorageError: a segment cannot be mapped.
    """
    try:
        if response.version != PROTOCOL_VERSION:
            raise UnsupportedVersion(f"daemon speaks protocol {response.version}, "
                                     f"this client {PROTOCOL_VERSION}")
        if fds or (response.fds and response.segments):
            owned, fds = fds, ()  # from_fds closes them, also when it fails
            shm = SegmentMap.from_fds(response.segments, owned)
            shm.copy_threads = options.resolved_copy_threads
        else:
            shm = None  # TCP: no segments to map, payloads travel inline
    finally:
        for fd in fds:
            os.close(fd)
    lease_ms = min(options.lease_ms, response.limits.max_lease_ms)
    limit = pool_limit(options.grant_bytes, sum(seg.size for seg in response.segments))
    return Session(server=response.server, limits=response.limits, shm=shm, lease_ms=lease_ms,
                   trust_checked=options.verify == "auto", pipeline_bytes=options.pipeline_bytes,
                   write_behind=options.write_behind,
                   grants=GrantPool(limit) if shm is not None and limit > 0 else None,
                   quiet_release=QUIET_RELEASE in (response.features or ()),
                   place_grant=PLACE_GRANT in (response.features or ()))
