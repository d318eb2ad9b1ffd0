"""The data plane: the unix socket and optional TCP listeners, and the connections they accept.

::

    start():  unix socket (0600, in a 0700 directory when it creates one)  ─┐
              TCP HOST:PORT (127.0.0.1 by default; port 0 = any free)       ─┴► Connection per client
    stop():   close listeners ─► stop reading ─► drain in-flight (bounded) ─► cancel the rest
              ─► every connection releases its leases and closes ─► socket file removed

Admission: the unix socket and TCP count their connections apart (``max_connections``,
``max_tcp_connections``); TCP may have at most ``max_unauthenticated`` connections that have not
yet completed their hello, and every connection must complete it within ``hello_timeout_s``:
idle strangers on TCP can neither fill the daemon nor keep the unix socket's clients (any
tenant's) out. (The unix socket, mode 0600, reaches only the daemon's user: a burst of engine
workers connecting at once there is never refused for not having said hello yet.) Received
payloads are charged to one byte budget for the daemon (``max_buffer_bytes``, see
:mod:`kvtier.daemon.server.connection`).

The socket file is bound under a temporary name, given mode 0600, then linked into place, so it
is never reachable with looser permissions. A socket file left by a dead daemon is replaced; a
live one (something accepts on it) or a path that is not a socket is refused.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import secrets
import socket
import stat
from typing import TYPE_CHECKING

from kvtier_protocol import frames as fr
from kvtier_protocol.errors import Busy, KVTierError, StorageError, Unavailable

from kvtier.daemon.config import UNIX_PATH_MAX, split_hostport
from kvtier_protocol.buffers import ByteBudget, PayloadBuffers
from kvtier.daemon.server.connection import HELLO_STREAM_LIMIT, Connection
from kvtier.daemon.server.handlers import RequestHandler
from kvtier_protocol.frame_stream import FrameStream

if TYPE_CHECKING:
    from kvtier.daemon.server.context import DaemonContext

log = logging.getLogger(__name__)

STREAM_LIMIT = 4 << 20  # bytes a connection buffers ahead of its reader before reading pauses
BACKLOG = 512
PAYLOAD_KEEP_BYTES = 256 << 20  # inline payload buffers kept for reuse across connections (buffers.py)
ABORT_WAIT_S = 2.0  # after the drain timeout, how long cancelled requests get to unwind


class DataPlane:
    """Serves the frame protocol of SPEC.md §7 for one daemon.

    Args:
        ctx: the daemon's shared state (config.dataplane, store, auth, metrics, events).
    """

    def __init__(self, ctx: DaemonContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.config.dataplane
        store_cfg = ctx.store.config
        self.limits = fr.Limits(max_payload_len=self.cfg.max_payload_bytes,
                                max_batch=min(self.cfg.max_batch, store_cfg.max_batch),
                                max_lease_ms=max(1, int(store_cfg.max_lease_seconds * 1000)),
                                max_inflight=self.cfg.max_inflight)
        self.buffers = PayloadBuffers(PAYLOAD_KEEP_BYTES)
        self.budget = ByteBudget(self.cfg.max_buffer_bytes)
        self._open = {False: 0, True: 0}  # connections served, by listener (tcp?)
        self._strangers = {False: 0, True: 0}  # of which not yet through their hello
        self.handler = RequestHandler(ctx, self.limits, self.buffers)
        self._servers: list[asyncio.Server] = []
        self._closed_servers: list[asyncio.Server] = []
        self._conns: dict[Connection, asyncio.Task[None] | None] = {}
        self._socket_path: str | None = None
        self._socket_ino: int | None = None
        self._stopping = False

    @property
    def num_connections(self) -> int:
        """Connections open now."""
        return len(self._conns)

    @property
    def num_unauthenticated(self) -> int:
        """Connections open now that have not completed their hello."""
        return self._strangers[False] + self._strangers[True]

    async def start(self) -> list[str]:
        """Listen on the configured socket and TCP address.

        Returns:
            The endpoints, e.g. ``["unix:/run/kvtier/kvtier.sock", "tcp:127.0.0.1:7470"]`` (the
            real port when 0 was asked).

        Raises:
            StorageError: the socket path is taken by a live daemon or by something that is not
                a socket, or cannot be created. OSError: the TCP address cannot be bound.
        """
        endpoints = []
        try:
            if self.cfg.socket is not None:
                endpoints.append(await self._start_unix(self.cfg.socket))
            if self.cfg.listen is not None:
                endpoints.append(await self._start_tcp(self.cfg.listen))
        except BaseException:
            await self.stop(0.0)
            raise
        return endpoints

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop accepting, let in-flight requests finish (up to the timeout), close everything.

        Every lease a connection still holds is released; the socket file is removed.
        """
        self._stopping = True
        await self._close_servers()
        for conn in self._conns:
            conn.stop_reading()
        tasks = [t for t in self._conns.values() if t is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, drain_timeout_s))
            if pending:
                log.warning("%d connections still busy after %.1f s: cancelling their requests",
                            len(pending), drain_timeout_s)
                for conn in self._conns:
                    conn.abort()
                await asyncio.wait(pending, timeout=ABORT_WAIT_S)
        servers, self._closed_servers = self._closed_servers, []
        for server in servers:
            # Python 3.12+ waits here for the server's connections too, all closed by now.
            try:
                await asyncio.wait_for(server.wait_closed(), ABORT_WAIT_S)
            except TimeoutError:
                log.warning("a data-plane listener did not close in %.0f s", ABORT_WAIT_S)
        self.buffers.close()
        self._remove_socket_file()

    # --- listeners -----------------------------------------------------------------------------

    async def _start_unix(self, path: str) -> str:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o700, exist_ok=True)
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            _bind_private(sock, path)
            self._socket_path, self._socket_ino = path, os.stat(path).st_ino
            server = await asyncio.get_running_loop().create_unix_server(
                lambda: FrameStream(HELLO_STREAM_LIMIT, lambda r, w: self._accept(r, w, tcp=False)), sock=sock,
                backlog=BACKLOG)
        except OSError as e:
            sock.close()
            raise StorageError(f"cannot listen on unix socket {path}: {e.strerror or e}") from e
        except BaseException:
            sock.close()
            raise
        self._servers.append(server)
        return f"unix:{path}"

    async def _start_tcp(self, listen: str) -> str:
        host, port = split_hostport(listen)
        server = await asyncio.get_running_loop().create_server(
            lambda: FrameStream(HELLO_STREAM_LIMIT, lambda r, w: self._accept(r, w, tcp=True)), host, port,
            backlog=BACKLOG)
        self._servers.append(server)
        name = server.sockets[0].getsockname()
        shown = f"[{name[0]}]" if ":" in name[0] else name[0]
        return f"tcp:{shown}:{name[1]}"

    async def _close_servers(self) -> None:
        servers, self._servers = self._servers, []
        for server in servers:
            server.close()  # stops accepting at once; wait_closed() comes once connections end
        self._closed_servers += servers

    def _remove_socket_file(self) -> None:
        path, self._socket_path = self._socket_path, None
        if path is None:
            return
        try:
            st = os.lstat(path)
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._socket_ino:
                os.unlink(path)  # only our own socket: a successor may have bound the path since
        except FileNotFoundError:
            pass

    # --- connections ---------------------------------------------------------------------------

    async def _accept(self, reader: FrameStream, writer: asyncio.StreamWriter, *, tcp: bool) -> None:
        try:
            await self._serve(reader, writer, tcp=tcp)
        finally:
            reader.release()  # no cycle left for the collector, which skips frozen objects

    async def _serve(self, reader: FrameStream, writer: asyncio.StreamWriter, *, tcp: bool) -> None:
        if self._stopping:
            await _refuse(writer, Unavailable("the daemon is shutting down"))
            return
        cap = self.cfg.max_tcp_connections if tcp else self.cfg.max_connections
        if self._open[tcp] >= cap:
            where = "TCP" if tcp else "unix-socket"
            await _refuse(writer, Busy(f"the daemon serves {cap} {where} connections at most"))
            return
        if tcp and self._strangers[tcp] >= self.cfg.max_unauthenticated:
            await _refuse(writer, Busy(f"{self.cfg.max_unauthenticated} connections are waiting for their "
                                       f"hello already; try again"))
            return
        stranger = [True]

        def hello_done() -> None:
            stranger[0] = False
            self._strangers[tcp] -= 1

        conn = Connection(self.ctx, self.handler, self.limits, reader, writer, tcp=tcp,
                          idle_timeout_s=self.cfg.idle_timeout_s,
                          socket_requires_token=self.cfg.socket_requires_token, buffers=self.buffers,
                          hello_timeout_s=self.cfg.hello_timeout_s, budget=self.budget,
                          connection_budget_bytes=self.cfg.max_connection_buffer_bytes,
                          stream_limit=STREAM_LIMIT, on_hello=hello_done)
        self._conns[conn] = asyncio.current_task()
        self._open[tcp] += 1
        self._strangers[tcp] += 1
        self.ctx.metrics.connections(len(self._conns))
        try:
            await conn.serve()
        finally:
            del self._conns[conn]
            self._open[tcp] -= 1
            if stranger[0]:
                self._strangers[tcp] -= 1
            self.ctx.metrics.connections(len(self._conns))


async def _refuse(writer: asyncio.StreamWriter, exc: KVTierError) -> None:
    """Answer a connection we will not serve with one error frame (id 0), then close it."""
    try:
        writer.writelines(fr.encode_frame(fr.error_response(fr.CONNECTION_ERROR_ID, exc)))
        await writer.drain()
    except (ConnectionError, OSError):
        pass
    writer.close()
    try:
        await writer.wait_closed()
    except (ConnectionError, OSError):
        pass


def _bind_private(sock: socket.socket, path: str) -> None:
    """Bind ``sock`` to ``path`` so that the path never names a socket others may connect to.

    The socket is bound under a temporary name, chmod 0600, then linked to ``path``: link() is
    atomic and refuses an existing path, so a daemon that started meanwhile is not replaced.
    (Where the temporary name would be too long for a socket address, ``path`` is bound
    directly; the fchmod before bind gives the file mode 0600 at creation on Linux.)

    Raises:
        StorageError: ``path`` appeared meanwhile. OSError: bind failed.
    """
    os.fchmod(sock.fileno(), 0o600)
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".kvtier-{secrets.token_hex(4)}")
    if len(os.fsencode(tmp)) > UNIX_PATH_MAX:
        sock.bind(path)
        os.chmod(path, 0o600)
        return
    sock.bind(tmp)
    try:
        os.chmod(tmp, 0o600)
        os.link(tmp, path)
    except FileExistsError:
        raise StorageError(f"{path} appeared while this daemon was starting") from None
    finally:
        os.unlink(tmp)


def _remove_stale_socket(path: str) -> None:
    """Remove a socket file nobody accepts on; refuse a live socket or a non-socket path.

    Raises:
        StorageError: the path exists and is not a socket, or a live daemon listens on it.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise StorageError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise StorageError(f"cannot check the existing socket {path}: {e.strerror}") from e
    else:
        raise StorageError(f"{path} is in use by a running daemon")
    finally:
        probe.close()
    log.info("removing stale socket %s", path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
