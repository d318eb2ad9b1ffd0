"""Where a kvtier daemon listens: a unix socket path or a TCP host and port.

Accepted spellings::

    unix:/run/kvtier/kvtier.sock      unix socket (also unix:///run/kvtier/kvtier.sock)
    /run/kvtier/kvtier.sock           a plain path (anything that is not HOST:PORT)
    tcp://127.0.0.1:7470              TCP
    127.0.0.1:7470, [::1]:7470        TCP without the scheme

Where a daemon listens when nobody says (:func:`default_socket`) and where a client looks for it
(:func:`default_address`) come from the same functions, so ``kvtier serve`` on its defaults and a
client, a CLI command or a connector on theirs meet at the same socket.

Stdlib only: the daemon and every engine-side package import it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier_protocol.errors import InvalidRequest

DEFAULT_TCP_HOST = "127.0.0.1"
_HOST_PORT = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.]+)\]|(?P<host>[A-Za-z0-9_.-]*)):(?P<port>\d{1,5})\Z")


@dataclass(frozen=True, slots=True)
class Address:
    """A parsed daemon address.

    Attributes:
        kind: ``"unix"`` or ``"tcp"``.
        path: the socket path (unix only).
        host: the TCP host (tcp only).
        port: the TCP port, 1..65535 (tcp only).
    """

    kind: str
    path: str | None = None
    host: str | None = None
    port: int | None = None

    @property
    def is_unix(self) -> bool:
        """True for a unix socket: the shared-memory fast path is possible."""
        return self.kind == "unix"

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


def parse_address(text: str | Address) -> Address:
    """Parse a daemon address (see the module docstring for the accepted forms).

    Raises:
        InvalidRequest: empty text, a ``tcp://`` address without a valid port, a port outside
            1..65535, or an unknown scheme.
    """
    if isinstance(text, Address):
        return text
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"a daemon address is a non-empty string, got {text!r}")
    text = text.strip()
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if path.startswith("//"):
            path = path[2:]  # unix:///abs/path -> /abs/path
        if not path:
            raise InvalidRequest(f"unix address {text!r} has no path")
        return Address("unix", path=path)
    if text.startswith("tcp://"):
        return _tcp(text[len("tcp://"):], text)
    if text.startswith("tcp:"):
        return _tcp(text[len("tcp:"):], text)  # the form kvtierd logs: "listening tcp:HOST:PORT"
    if "://" in text:
        raise InvalidRequest(f"unknown address scheme in {text!r}; use unix:PATH or tcp://HOST:PORT")
    if "/" not in text and _HOST_PORT.match(text):
        return _tcp(text, text)
    return Address("unix", path=text)


def _tcp(rest: str, original: str) -> Address:
    m = _HOST_PORT.match(rest)
    if m is None:
        raise InvalidRequest(f"TCP address {original!r} is not HOST:PORT")
    port = int(m["port"])
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"TCP port {port} in {original!r} is outside 1..65535")
    host = m["v6"] or m["host"] or DEFAULT_TCP_HOST
    return Address("tcp", host=host, port=port)


def default_data_dir(env: Mapping[str, str]) -> str:
    """``$XDG_CACHE_HOME/kvtier``, else ``~/.cache/kvtier``."""
    cache = env.get("XDG_CACHE_HOME") or os.path.join(env.get("HOME") or os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvtier")


def default_socket(env: Mapping[str, str], data_dir: str) -> str:
    """``$XDG_RUNTIME_DIR/kvtier/kvtier.sock``; else ``/run/kvtier/kvtier.sock`` where this user may
    create it (root, or a pre-made writable ``/run/kvtier``); else ``<data_dir>/kvtier.sock``."""
    if env.get("XDG_RUNTIME_DIR"):
        return os.path.join(env["XDG_RUNTIME_DIR"], "kvtier", "kvtier.sock")
    run = "/run/kvtier"
    if os.access(run, os.W_OK | os.X_OK) or not os.path.exists(run) and os.access("/run", os.W_OK | os.X_OK):
        return os.path.join(run, "kvtier.sock")
    return os.path.join(data_dir, "kvtier.sock")


def default_address(env: Mapping[str, str] | None = None) -> str:
    """Where a client finds the daemon when it is given no address.

    ``$KVTIER_ADDRESS`` (any spelling :func:`parse_address` accepts), else ``$KVTIER_SOCKET`` (the
    variable that moves the daemon's own socket), else the socket a daemon started with the same
    environment listens on by default (:func:`default_socket` under ``$KVTIER_DATA_DIR`` or
    :func:`default_data_dir`).
    """
    env = os.environ if env is None else env
    explicit = env.get("KVTIER_ADDRESS") or env.get("KVTIER_SOCKET")
    if explicit:
        return explicit
    return "unix:" + default_socket(env, env.get("KVTIER_DATA_DIR") or default_data_dir(env))
