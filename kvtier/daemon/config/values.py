"""The value checks every settings section shares: the typed error, sizes, ``HOST:PORT``, type and
range checks. Imports nothing else of the config package (every other module of it imports this).

Sizes: ``KiB MiB GiB TiB`` (and ``K M G T``, ``Ki Mi Gi Ti``) are powers of 1024, ``KB MB GB TB``
powers of 1000, a bare number is bytes; fractions are allowed when they give whole bytes.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from typing import Any

from kvtier_protocol.errors import InvalidRequest

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
MIN_TOKEN_LEN = 16
"""The shortest token accepted from any source (inline, environment, token file, tenant): one rule."""


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


def hostport_option(name: str, value: str | None) -> str | None:
    """Option ``name``'s ``HOST:PORT`` in one spelling (``host:port``, ``[v6]:port``); None stays None.

    Raises:
        ConfigError: not text, or no valid port; the message names the option.
    """
    if value is None:
        return None
    try:
        host, port = split_hostport(typed(name, value, str))
    except ConfigError as e:
        raise ConfigError(f"{name}: {e.message}") from None
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def typed(name: str, value: Any, kind: type | tuple[type, ...]) -> Any:
    """``value`` itself when it is of ``kind`` (a bool is never an int here).

    Raises:
        ConfigError: naming option ``name`` and the kinds it takes.
    """
    if isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
        kinds = kind if isinstance(kind, tuple) else (kind,)
        raise ConfigError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    return value


def positive(name: str, value: Any, *, number: bool = False, zero: bool = False) -> None:
    """Check that option ``name`` is a positive integer (``number``: a finite int or float;
    ``zero``: 0 allowed too).

    Raises:
        ConfigError: naming the option and what it takes.
    """
    typed(name, value, (int, float) if number else int)
    if not (value >= 0 if zero else value > 0) or number and not math.isfinite(value):
        raise ConfigError(f"{name} must be a {'non-negative' if zero else 'positive'} "
                          f"{'number' if number else 'integer'}, got {value!r}")
