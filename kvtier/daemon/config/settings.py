"""Daemon settings: one typed, frozen dataclass tree (aesthetics §2.15). Torch-free.

Sources, highest precedence first::

    flags (kvtier serve --host-bytes ...)  >  KVTIER_* environment  >  TOML file  >  embedded defaults

The TOML file has the sections ``[store]`` (the fields of :class:`~kvtier.daemon.store.config.StoreConfig`),
``[dataplane]``, ``[rest]``, ``[events]``, ``[auth]``, ``[daemon]`` (``data_dir``, ``log_level``,
``drain_timeout_s``) and ``[tenants.<name>]`` (:mod:`kvtier.daemon.config.tenants`; file only);
``configs/kvtier.toml`` documents every option with its default. Unknown sections
or keys are errors, so a typo never silently falls back to a default.

Environment: every option is ``KVTIER_<SECTION>__<KEY>`` (upper case, two underscores), e.g.
``KVTIER_STORE__WRITE_THROUGH=1``; the common ones also have the short names of :data:`ENV_ALIASES`
(``KVTIER_HOST_BYTES``, ``KVTIER_SOCKET``, ...), and ``KVTIER_CONFIG`` names the TOML file when no
path is given. Values from the environment and from flags are text: sizes take units (``4GiB``),
booleans ``1/0/true/false/yes/no/on/off``, and ``off`` switches an optional endpoint off.

Sizes: ``KiB MiB GiB TiB`` (and ``K M G T``, ``Ki Mi Gi Ti``) are powers of 1024, ``KB MB GB TB``
powers of 1000, a bare number is bytes; fractions are allowed when they give whole bytes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import TYPE_CHECKING, Any

from kvtier_protocol.errors import InvalidRequest

from kvtier.daemon.store.config import StoreConfig

if TYPE_CHECKING:
    from kvtier.daemon.config.tenants import TenantConfig

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


class ConfigError(InvalidRequest, ValueError):
    """A setting is invalid; the message names the option and where its value came from."""


_UNITS = {"": 1, "b": 1, "k": KIB, "ki": KIB, "kib": KIB, "m": MIB, "mi": MIB, "mib": MIB, "g": GIB,
          "gi": GIB, "gib": GIB, "t": 1 << 40, "ti": 1 << 40, "tib": 1 << 40, "kb": 10**3, "mb": 10**6,
          "gb": 10**9, "tb": 10**12}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes named by ``text``: an int, or a number with an optional unit ("4GiB", "1.5GiB", "20G").

    Raises:
        ConfigError: not a non-negative size, an unknown unit, or a fraction of a byte.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ConfigError(f"size must not be negative, got {text}")
        return text
    m = _SIZE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ConfigError(f"{text!r} is not a size (expected bytes or a number with a unit: 4GiB, 512MiB, "
                          "20G, 1.5GiB, 500MB)")
    try:
        value = Decimal(m.group(1)) * unit
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise ConfigError(f"{text!r} is not a size") from None
    if value != value.to_integral_value():
        raise ConfigError(f"{text!r} is not a whole number of bytes")
    return int(value)


def split_hostport(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``"HOST:PORT"``, ``"[v6]:PORT"``, ``":PORT"`` or ``"PORT"`` as ``(host, port)``; port 0 = any free.

    Raises:
        ConfigError: no valid port (0..65535).
    """
    if not isinstance(text, str):
        raise ConfigError(f"{text!r} is not HOST:PORT")
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not port.isascii() or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{text!r} is not HOST:PORT (port 0..65535)")
    return host or default_host, int(port)


def _hostport(name: str, value: str | None) -> str | None:
    if value is None:
        return None
    try:
        host, port = split_hostport(_typed(name, value, str))
    except ConfigError as e:
        raise ConfigError(f"{name}: {e.message}") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _typed(name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ConfigError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def _positive(name: str, value: Any, *, number: bool = False, zero: bool = False) -> None:
    _typed(name, value, (int, float) if number else int)
    if not (value >= 0 if zero else value > 0) or number and not math.isfinite(value):
        raise ConfigError(f"{name} must be a {'non-negative' if zero else 'positive'} "
                          f"{'number' if number else 'integer'}, got {value!r}")


@dataclass(frozen=True, slots=True)
class DataPlaneConfig:
    """The data plane (the frame protocol of SPEC.md §7).

    Attributes:
        socket: path of the unix socket (mode 0600); None: no unix socket.
        listen: ``HOST:PORT`` of the TCP data plane (payloads inline, token required); None: off.
        socket_requires_token: ask for the token on the unix socket too (the file mode already
            limits it to the daemon's user).
        max_connections: connections served at once; more are refused.
        max_inflight: requests one connection may have outstanding (more: ``busy``).
        idle_timeout_s: a connection silent this long is closed.
        max_payload_bytes: largest frame payload (and block record).
        max_batch: most keys in one request.
    """

    socket: str | None
    listen: str | None = None
    socket_requires_token: bool = False
    max_connections: int = 256
    max_inflight: int = 64
    idle_timeout_s: float = 300.0
    max_payload_bytes: int = 256 * MIB
    max_batch: int = 4096

    def __post_init__(self) -> None:
        if self.socket is not None:
            _typed("dataplane.socket", self.socket, str)
            if not self.socket or len(os.fsencode(self.socket)) > UNIX_PATH_MAX:
                raise ConfigError(f"dataplane.socket must be a path of 1..{UNIX_PATH_MAX} bytes, got "
                                  f"{self.socket!r} (use a shorter data_dir or socket path)")
        object.__setattr__(self, "listen", _hostport("dataplane.listen", self.listen))
        _typed("dataplane.socket_requires_token", self.socket_requires_token, bool)
        for name in ("max_connections", "max_inflight", "max_payload_bytes", "max_batch"):
            _positive(f"dataplane.{name}", getattr(self, name))
        _positive("dataplane.idle_timeout_s", self.idle_timeout_s, number=True)
        if self.socket is None and self.listen is None:
            raise ConfigError("dataplane: both socket and listen are off; nothing would serve the data plane")


@dataclass(frozen=True, slots=True)
class RestConfig:
    """The REST API and ``/metrics``. Attributes: listen: ``HOST:PORT``, or None (off)."""

    listen: str | None = "127.0.0.1:7471"

    def __post_init__(self) -> None:
        object.__setattr__(self, "listen", _hostport("rest.listen", self.listen))


_ZMQ_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV events (SPEC.md §9): a ZMQ PUB socket and a replay ROUTER, vLLM 0.33 compatible.

    Attributes:
        endpoint: ZMQ endpoint of the PUB socket (``tcp://127.0.0.1:5557``); None: no publisher.
        replay_endpoint: ZMQ endpoint of the replay ROUTER; None: no replay.
        topic: topic of every message, ``kv@<pod>@<model>``; load_config computes
            ``kv@<hostname>@kvtier`` when it is empty.
        legacy_array: encode events as arrays (vLLM before map encoding) instead of maps.
        buffer_steps: batches kept for replay.
        hwm: ZMQ send high-water mark (messages).
    """

    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str = ""
    legacy_array: bool = False
    buffer_steps: int = 10000
    hwm: int = 100000

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not _ZMQ_ENDPOINT.fullmatch(_typed(f"events.{name}", value, str)):
                raise ConfigError(f"events.{name} must be a ZMQ endpoint such as tcp://127.0.0.1:5557, got {value!r}")
        _typed("events.topic", self.topic, str)
        _typed("events.legacy_array", self.legacy_array, bool)
        _positive("events.buffer_steps", self.buffer_steps)
        _positive("events.hwm", self.hwm, zero=True)


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """The shared-secret token of TCP and mutating REST calls.

    Attributes:
        token: the token itself (prefer token_file: the environment and files leak more easily).
        token_file: file holding the token; default ``<data_dir>/token``, generated (0600) when
            missing.
    """

    token: str | None = None
    token_file: str | None = None

    def __repr__(self) -> str:  # the token never reaches a log line
        return f"AuthConfig(token={'<set>' if self.token else None}, token_file={self.token_file!r})"

    def __post_init__(self) -> None:
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < 16):
            raise ConfigError("auth.token must be text of at least 16 characters")
        if self.token_file is not None and not _typed("auth.token_file", self.token_file, str):
            raise ConfigError("auth.token_file must be a path")


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything ``kvtier serve`` needs.

    Attributes:
        store: the tiered store (host, disk and GPU tiers).
        dataplane, rest, events, auth: the services.
        data_dir: directory of the disk tier (``<data_dir>/disk`` by default) and the token file.
        log_level: one of :data:`LOG_LEVELS`.
        drain_timeout_s: at shutdown, how long in-flight requests may take to finish.
        gc_freeze: keep CPython's garbage collector from walking the whole index
            (:mod:`kvtier.daemon.server.collector`); False leaves the interpreter's defaults.
        tenants: the tenants (:mod:`kvtier.daemon.config.tenants`), each with its own store; empty:
            one shared store.
    """

    store: StoreConfig
    dataplane: DataPlaneConfig
    rest: RestConfig
    events: EventsConfig
    auth: AuthConfig
    data_dir: str
    log_level: str = "info"
    drain_timeout_s: float = 10.0
    gc_freeze: bool = True
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        if not _typed("daemon.data_dir", self.data_dir, str):
            raise ConfigError("daemon.data_dir must be a path")
        if _typed("daemon.log_level", self.log_level, str).lower() not in LOG_LEVELS:
            raise ConfigError(f"daemon.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.lower())
        _positive("daemon.drain_timeout_s", self.drain_timeout_s, number=True, zero=True)
        _typed("daemon.gc_freeze", self.gc_freeze, bool)
        if self.tenants != ():
            from kvtier.daemon.config.tenants import check_tenants  # it imports this module

            check_tenants(self.tenants, self.store, self.data_dir, self.auth.token)



def load_config(path: str | None = None, *, env: Mapping[str, str] = os.environ,
                overrides: Mapping[str, object] = {}) -> DaemonConfig:
    """The daemon's settings: ``overrides`` > ``env`` > the TOML file > embedded defaults.

    Defaults: host tier min(4 GiB, 25% of RAM, 90% of free /dev/shm); disk tier of 20 GiB in
    ``<data_dir>/disk`` with ``data_dir`` = ``$XDG_CACHE_HOME/kvtier`` (else ``~/.cache/kvtier``);
    GPU tier off; unix socket ``$XDG_RUNTIME_DIR/kvtier/kvtier.sock`` (else
    ``/run/kvtier/kvtier.sock`` where writable, else ``<data_dir>/kvtier.sock``); REST on
    127.0.0.1:7471; no TCP data plane, no event publisher.

    Args:
        path: TOML file; None: ``$KVTIER_CONFIG`` when set, else no file.
        env: where ``KVTIER_*`` options (and the XDG directories, HOME) are read.
        overrides: ``{"section.key": value}`` from flags (``{"store.host_bytes": "4GiB"}``);
            text is parsed as the environment's is.

    Raises:
        ConfigError: an unreadable or malformed file, an unknown option, a wrong type or value.
    """
    from kvtier.daemon.config.sources import load  # it needs the classes above

    return load(path, env, overrides)
