"""What keeps REST clients, authenticated or not, from starving the daemon: a cap on open REST
connections, header and body deadlines, and file descriptors kept for the data plane.

::

    accept ─► RestGate: open < cap ─► aiohttp's RequestHandler (counted until connection_lost)
                        else       ─► "503, Connection: close", closed at once
    headers: keepalive_timeout = rest.header_timeout_s: a connection waiting for a request's
             headers (new, or after its previous answer) is closed when it runs out, however
             slowly it trickles bytes (aiohttp closes a handler still waiting for a message)
    body:    rest.body_timeout_s around every read of a body (kvtier.daemon.server.rest)

aiohttp has no header deadline of its own and keeps idle connections for an hour by default;
a client sending one header byte every few seconds held a descriptor forever, and a few
thousand of them exhausted the process's descriptors, so the data plane's accept failed.
:func:`rest_connection_cap` sizes the REST cap so that the data plane's own limits always have
descriptors left.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from kvtier.daemon.config import DaemonConfig

log = logging.getLogger(__name__)

DESCRIPTOR_MARGIN = 128  # descriptors for everything but connections: store files, RocksDB, shm, ZMQ, logs
MIN_REST_CONNECTIONS = 4
LINGER_S = 2.0  # after an answer, how long an unread request body is drained before the connection closes
_REFUSAL_BODY = b'{"error": {"code": "busy", "message": "too many REST connections; try again later"}}'
_REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(_REFUSAL_BODY), _REFUSAL_BODY))


def rest_connection_cap(config: DaemonConfig) -> int:
    """REST connections allowed at once: ``rest.max_connections``, lowered where the process's
    descriptor limit would not leave the data plane its connections plus a margin.

    The soft limit is raised toward the hard one first when that is needed (and allowed).
    """
    dp = config.dataplane
    needed = dp.max_connections + (dp.max_tcp_connections if dp.listen is not None else 0) + DESCRIPTOR_MARGIN
    wanted = config.rest.max_connections
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed + wanted:
        target = needed + wanted if hard == resource.RLIM_INFINITY else min(hard, needed + wanted)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    cap = min(wanted, max(MIN_REST_CONNECTIONS, soft - needed))
    if cap < wanted:
        log.warning("kvtierd: REST limited to %d connections (descriptor limit %d, the data plane keeps %d)",
                    cap, soft, needed)
    return cap


def handler_args(config: DaemonConfig) -> dict[str, Any]:
    """aiohttp request-handler settings: the header deadline (``keepalive_timeout``) and a short
    linger for bodies nobody reads."""
    return {"keepalive_timeout": config.rest.header_timeout_s,
            "lingering_time": min(LINGER_S, config.rest.body_timeout_s)}


class _GatedHandler(RequestHandler):
    """aiohttp's handler, counted by its gate from creation to connection loss."""

    __slots__ = ("_gate",)

    def __init__(self, gate: RestGate, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._gate: RestGate | None = gate

    def connection_lost(self, exc: BaseException | None) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.open -= 1
        super().connection_lost(exc)


class _Refused(asyncio.Protocol):
    """A connection above the cap: one 503 answer, then closed (nothing is read)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # (uvloop's transports are no asyncio.WriteTransport subclasses: no isinstance check)
        transport.write(_REFUSAL)  # type: ignore[attr-defined]
        transport.close()


class RestGate:
    """The protocol factory of the REST listener: aiohttp's handlers up to ``cap`` open at once.

    Args:
        server: the runner's low-level aiohttp server (``AppRunner.server``).
        cap: connections open at once.

    Attributes:
        open: connections open now; refused: connections refused so far.
    """

    def __init__(self, server: web.Server, cap: int) -> None:
        assert cap > 0, "a connection count"
        self.server = server
        self.cap = cap
        self.open = 0
        self.refused = 0

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.cap:
            self.refused += 1
            return _Refused()
        self.open += 1  # counted at creation: a burst of accepts sees each one at once
        server = self.server
        try:
            return _GatedHandler(self, server, loop=server._loop, **server._kwargs)
        except BaseException:
            self.open -= 1
            raise


class GatedSite(web.TCPSite):
    """A :class:`aiohttp.web.TCPSite` whose connections go through a :class:`RestGate`."""

    __slots__ = ("gate",)

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, cap: int, **kwargs: Any) -> None:
        super().__init__(runner, host, port, **kwargs)
        assert runner.server is not None, "runner.setup() first"
        self.gate = RestGate(runner.server, cap)

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        self._server = await asyncio.get_running_loop().create_server(
            self.gate, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address,
            reuse_port=self._reuse_port)
