"""Where the daemon's settings come from: embedded defaults, a TOML file, ``KVTIER_*`` variables, flags.

:func:`load_config` is the entry point; this module also holds the option table and the layers it
merges. Torch-free. Sources, highest precedence first::

    flags (kvtier serve --host-bytes ...)  >  KVTIER_* environment  >  TOML file  >  embedded defaults

The TOML file has the sections ``[store]`` (the fields of :class:`~kvtier.daemon.store.config.StoreConfig`),
``[dataplane]``, ``[rest]``, ``[events]``, ``[auth]``, ``[remote]``, ``[daemon]`` (``data_dir``, ``log_level``,
``drain_timeout_s``), ``[tenants.<name>]`` (:mod:`kvtier.daemon.config.tenants`; file only) and
``[tiers.disk]`` / ``[tiers.remote]`` (each tier's ``codec``, ``compression``, ``k_axis`` and
``models`` table: file spellings of ``store.disk_codec`` / ``store.disk_compression`` /
``store.disk_k_axis`` / ``store.disk_models`` and ``remote.codec`` / ``remote.compression`` /
``remote.k_axis`` / ``remote.models``, :data:`TIER_OPTIONS`);
``configs/kvtier.toml`` documents every option with its default. Unknown sections
or keys are errors, so a typo never silently falls back to a default.

Environment: every option is ``KVTIER_<SECTION>__<KEY>`` (upper case, two underscores), e.g.
``KVTIER_STORE__WRITE_THROUGH=1``; the common ones also have the short names of :data:`ENV_ALIASES`
(``KVTIER_HOST_BYTES``, ``KVTIER_SOCKET``, ...), and ``KVTIER_CONFIG`` names the TOML file when no
path is given. Values from the environment and from flags are text: sizes take units (``4GiB``,
see :mod:`kvtier.daemon.config.values`), booleans ``1/0/true/false/yes/no/on/off``, ``off``
switches an optional endpoint off, and a tier's ``models`` table (:data:`MODEL_TABLES`) is
``PATTERN=CODEC[,PATTERN=CODEC...]`` (``KVTIER_STORE__DISK_MODELS='*-draft=int4,*=raw'``; empty: none).
"""

from __future__ import annotations

import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from kvtier_protocol.address import default_data_dir, default_socket
from kvtier.daemon.config.sections import AuthConfig, DataPlaneConfig, EventsConfig, RemoteConfig, RestConfig
from kvtier.daemon.config.settings import DaemonConfig
from kvtier.daemon.config.tenants import TenantConfig, parse_tenants
from kvtier.daemon.config.values import GIB, ConfigError, parse_size, typed
from kvtier.daemon.store.config import StoreConfig, StoreConfigError, check_codec_models

HOST_BYTES_MAX = 4 * GIB  # default host tier: min(4 GiB, 25% of RAM, free /dev/shm)
DISK_BYTES_DEFAULT = 20 * GIB

# --- the option table ------------------------------------------------------------------------

SECTIONS: dict[str, type] = {"store": StoreConfig, "dataplane": DataPlaneConfig, "rest": RestConfig,
                             "events": EventsConfig, "auth": AuthConfig, "remote": RemoteConfig, "daemon": DaemonConfig}
_NESTED = ("store", "dataplane", "rest", "events", "auth", "tenants", "remote")  # fields that are not options
SIZE_OPTIONS = frozenset({"store.host_bytes", "store.host_segment_bytes", "store.disk_bytes", "store.gpu_bytes",
                          "store.gpu_segment_bytes", "dataplane.max_payload_bytes",
                          "dataplane.max_connection_buffer_bytes", "dataplane.max_buffer_bytes",
                          "remote.upload_queue_bytes"})
NULLABLE = frozenset({"dataplane.socket", "dataplane.listen", "rest.listen", "events.endpoint",
                      "events.replay_endpoint", "events.packed_endpoint", "auth.token", "remote.url", "remote.user", "remote.password_file",
                      "remote.tls_ca_file"})
"""Options that take ``"off"`` (or ``""``) for None."""
MODEL_TABLES = frozenset({"store.disk_models", "remote.models"})
"""Per-model codec tables (issue 25): a TOML table ``"pattern" = "codec"`` in the file
(``[tiers.disk.models]``, or inline in ``[store]`` / ``[remote]``), ``PATTERN=CODEC,...`` as text."""

ENV_ALIASES: dict[str, str] = {
    "KVTIER_DATA_DIR": "daemon.data_dir", "KVTIER_LOG_LEVEL": "daemon.log_level",
    "KVTIER_HOST_BYTES": "store.host_bytes", "KVTIER_DISK_BYTES": "store.disk_bytes",
    "KVTIER_GPU_BYTES": "store.gpu_bytes", "KVTIER_SOCKET": "dataplane.socket",
    "KVTIER_LISTEN": "dataplane.listen", "KVTIER_REST": "rest.listen", "KVTIER_EVENTS": "events.endpoint",
    "KVTIER_REPLAY": "events.replay_endpoint", "KVTIER_TOPIC": "events.topic", "KVTIER_TOKEN": "auth.token",
    "KVTIER_TOKEN_FILE": "auth.token_file", "KVTIER_REMOTE": "remote.url",
}
"""Short environment names of the common options (each also has its ``KVTIER_S__K`` name)."""

TIER_OPTIONS: dict[str, dict[str, str]] = {
    "disk": {"codec": "store.disk_codec", "compression": "store.disk_compression", "k_axis": "store.disk_k_axis",
             "models": "store.disk_models"},
    "remote": {"codec": "remote.codec", "compression": "remote.compression", "k_axis": "remote.k_axis",
               "models": "remote.models"},
}
"""``[tiers.<tier>] key`` -> the option it sets (issue 25: precision by tier). The host tier keeps
what clients write, so it has no table."""


def _kinds() -> dict[str, str]:
    out = {}
    for section, cls in SECTIONS.items():
        for f in fields(cls):
            if f.name not in _NESTED:
                out[f"{section}.{f.name}"] = "size" if f"{section}.{f.name}" in SIZE_OPTIONS else str(f.type)
    return out


OPTIONS: dict[str, str] = _kinds()
"""Every option, ``"section.key"`` -> its kind (``"size"`` or the field's annotation)."""


def env_name(option: str) -> str:
    """The long environment name of an option: ``store.host_bytes`` -> ``KVTIER_STORE__HOST_BYTES``."""
    section, key = option.split(".")
    return f"KVTIER_{section.upper()}__{key.upper()}"


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _convert(option: str, value: Any, origin: str) -> Any:
    """One option's value from TOML (typed) or from the environment / a flag (text)."""
    kind, text = OPTIONS[option], isinstance(value, str) and not origin.startswith("file")
    if isinstance(value, str) and "\x00" in value:  # TOML's \u0000: no path or name holds a NUL
        raise ConfigError(f"{option} ({origin}): must not contain a NUL character")
    if option in MODEL_TABLES:
        return _model_table(option, value, origin, text)
    try:
        if option == "store.host_bytes" and value == "auto":
            return None
        if option == "store.host_pin" and value == "auto":
            return "auto"
        if option in NULLABLE and value in ("", "off"):
            return None
        if kind == "size":
            return parse_size(value)
        if text and kind.startswith("bool"):
            if value.strip().lower() not in _TRUE + _FALSE:
                raise ConfigError(f"{value!r} is not a boolean (1/0, true/false, yes/no, on/off)")
            return value.strip().lower() in _TRUE
        if text and kind == "int":
            return int(value.strip())
        if text and kind == "float":
            return float(value.strip())
        if kind == "float":
            return float(typed(option, value, (int, float)))
        if kind.startswith("bool"):
            return typed(option, value, bool)
        return typed(option, value, int if kind == "int" else str)
    except (ConfigError, ValueError, OverflowError) as e:  # float(10**400) overflows
        msg = e.message if isinstance(e, ConfigError) else f"{value!r:.80} is not a valid {kind}"
        raise ConfigError(f"{option} ({origin}): {msg.removeprefix(option + ' ')}") from None


def _model_table(option: str, value: Any, origin: str, text: bool) -> tuple[tuple[str, str], ...]:
    """A tier's ``models`` table (:data:`MODEL_TABLES`), checked: a TOML table from a file,
    ``PATTERN=CODEC[,PATTERN=CODEC...]`` from the environment or a flag (empty: no entry)."""
    try:
        if text:
            pairs = []
            for item in (i.strip() for i in value.split(",")):
                if item:
                    pattern, eq, codec = item.rpartition("=")
                    if not eq:
                        raise ConfigError(f"{item!r:.80} is not PATTERN=CODEC")
                    pairs.append((pattern.strip(), codec.strip()))
            return check_codec_models(option, pairs)
        if not isinstance(value, (dict, list, tuple)):
            raise ConfigError(f"must be a table of \"model pattern\" = \"codec\", got {value!r:.80}")
        return check_codec_models(option, value)
    except (ConfigError, StoreConfigError) as e:
        raise ConfigError(f"{option} ({origin}): {e.message.removeprefix(option).lstrip(': ')}") from None


def _from_toml(path: str) -> tuple[dict[str, tuple[Any, str]], tuple[TenantConfig, ...]]:
    """The options of a TOML file, and its tenants."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:  # tomllib decodes UTF-8 itself
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise ConfigError(f"config file {path} nests arrays or tables too deeply") from None
    out, unknown = {}, []
    tenants = parse_tenants(doc.pop("tenants"), f"file {path}") if "tenants" in doc else ()
    tiers = _tier_options(doc.pop("tiers"), path) if "tiers" in doc else {}
    for section, table in doc.items():
        if section not in SECTIONS or not isinstance(table, dict):
            unknown.append(f"[{section}]")
            continue
        for key, value in table.items():
            option = f"{section}.{key}"
            if option in OPTIONS:
                out[option] = (value, f"file {path}")
            else:
                unknown.append(f"[{section}] {key}")
    if unknown:
        raise ConfigError(f"unknown option(s) in {path}: {', '.join(unknown)} (see configs/kvtier.toml)")
    for option, value in tiers.items():
        if option in out:
            raise ConfigError(f"{path}: {option} is set twice ([{option.split('.')[0]}] and [tiers]); keep one")
        out[option] = value
    return out, tenants


def _tier_options(doc: Any, path: str) -> dict[str, tuple[Any, str]]:
    """The options of a file's ``[tiers.<tier>]`` tables (:data:`TIER_OPTIONS`)."""
    if not isinstance(doc, dict) or not all(isinstance(t, dict) for t in doc.values()):
        raise ConfigError(f"tiers (file {path}) must be tables [tiers.<tier>]")
    out: dict[str, tuple[Any, str]] = {}
    for tier, table in doc.items():
        keys = TIER_OPTIONS.get(tier)
        if keys is None:
            raise ConfigError(f"[tiers.{tier}] (file {path}): only {', '.join(f'[tiers.{t}]' for t in TIER_OPTIONS)} "
                              "takes a codec (host keeps what clients write)")
        for key, value in table.items():
            if key not in keys:
                raise ConfigError(f"unknown key [tiers.{tier}] {key} in {path} (allowed: {', '.join(keys)})")
            out[keys[key]] = (value, f"file {path} [tiers.{tier}{'.models' if key == 'models' else ''}]")
    return out


def _from_env(env: Mapping[str, str]) -> dict[str, tuple[Any, str]]:
    out: dict[str, tuple[Any, str]] = {}
    long_names = {env_name(o): o for o in OPTIONS}
    for name, value in env.items():
        option = long_names.get(name) or ENV_ALIASES.get(name)
        if option is None:
            if name.startswith("KVTIER_") and "__" in name:
                raise ConfigError(f"unknown environment option {name} (options: KVTIER_<SECTION>__<KEY>)")
            continue  # other KVTIER_* names belong to clients and tools
        if option in out and out[option][0] != value:
            raise ConfigError(f"{name} and {out[option][1].split()[-1]} both set {option}, differently")
        out[option] = (value, f"env {name}")
    return out


def default_host_bytes() -> int:
    """min(4 GiB, 25% of RAM, 90% of the free space of /dev/shm), in whole pages.

    /dev/shm is counted because a host tier larger than it fails at the first write to an
    unbacked page (SIGBUS), not at start.
    """
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = min(HOST_BYTES_MAX, ram // 4)
    try:
        st = os.statvfs("/dev/shm")
        limit = min(limit, st.f_bavail * st.f_frsize * 9 // 10)
    except OSError:
        pass
    page = os.sysconf("SC_PAGE_SIZE")
    return max(page, limit // page * page)


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded (cheap: no torch import). False means no CUDA here."""
    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidiactl")


def default_topic() -> str:
    """``kv@<hostname>@kvtier`` (``@`` in a host name would break llm-d's topic split)."""
    return f"kv@{socket.gethostname().replace('@', '_') or 'localhost'}@kvtier"


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
    path = path if path is not None else env.get("KVTIER_CONFIG") or None
    values, tenants = _from_toml(path) if path else ({}, ())
    values.update(_from_env(env))
    for option, value in overrides.items():
        if option not in OPTIONS:
            raise ConfigError(f"unknown option {option!r}")
        values[option] = (value, "flag")
    v = {option: _convert(option, value, origin) for option, (value, origin) in values.items()}
    data_dir = os.path.abspath(os.path.expanduser(v.pop("daemon.data_dir", None) or default_data_dir(env)))
    store = {k.split(".")[1]: x for k, x in v.items() if k.startswith("store.")}
    if store.get("host_bytes") is None:
        store["host_bytes"] = default_host_bytes()
    store.setdefault("disk_bytes", DISK_BYTES_DEFAULT)
    if store["disk_bytes"] == 0:  # 0 switches the disk tier off
        store["disk_path"] = None
    else:
        store["disk_path"] = os.path.abspath(os.path.expanduser(store.get("disk_path") or
                                                                os.path.join(data_dir, "disk")))
    if store.get("host_pin", "auto") == "auto":
        # None lets the store check CUDA with torch in the background; skip even that (and the
        # torch import) on a machine without an NVIDIA driver.
        store["host_pin"] = None if nvidia_driver_present() else False
    sections = {s: {k.split(".")[1]: x for k, x in v.items() if k.startswith(s + ".")} for s in SECTIONS}
    dp = sections["dataplane"]
    if "socket" not in dp:
        dp["socket"] = default_socket(env, data_dir)
    elif dp["socket"] is not None:
        dp["socket"] = os.path.abspath(os.path.expanduser(dp["socket"]))
    auth = sections["auth"]
    if auth.get("token_file"):
        auth["token_file"] = os.path.abspath(os.path.expanduser(auth["token_file"]))
    remote = sections["remote"]
    for name in ("password_file", "tls_ca_file"):
        if remote.get(name):
            remote[name] = os.path.abspath(os.path.expanduser(remote[name]))
    if not sections["events"].get("topic"):
        sections["events"]["topic"] = default_topic()
    try:
        store_cfg = StoreConfig(**store)
    except ValueError as e:
        raise ConfigError(f"store: {e}") from None
    return DaemonConfig(store=store_cfg, dataplane=DataPlaneConfig(**dp), rest=RestConfig(**sections["rest"]),
                        events=EventsConfig(**sections["events"]), auth=AuthConfig(**auth),
                        data_dir=data_dir, **sections["daemon"], tenants=tenants, remote=RemoteConfig(**remote))
