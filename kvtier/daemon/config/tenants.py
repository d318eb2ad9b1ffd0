"""Tenants of the daemon (TOML ``[tenants.<name>]``): each gets its own store, token and event hub.

A tenant is configured, never self-declared: a client becomes tenant ``alice`` only by presenting
alice's token. Each tenant's blocks live in a :class:`~kvtier.daemon.store.store.TieredStore` of their
own (shared-memory segments named ``<host_name_prefix>-t-<name>-...``, a disk tier under
``<data_dir>/tenants/<name>/disk``, own index, policy, leases and capacity), so no request of
another tenant can reach, probe or evict them (docs/design.md §7). Torch-free.

Example::

    [tenants.alice]
    host_bytes = "8GiB"
    disk_bytes = "100GiB"
    token_file = "/etc/kvtier/alice.token"   # default <data_dir>/tenants/alice/token, generated 0600
    events_endpoint = "tcp://127.0.0.1:5600" # optional: alice's own ZMQ PUB socket
    accept_lossy = false                     # optional: alice's requests get exact copies unless they ask
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.daemon.config.sections import EventsConfig
from kvtier.daemon.config.values import MIN_TOKEN_LEN, ConfigError, parse_size, typed
from kvtier.daemon.store.config import StoreConfig

TENANT_NAME = re.compile(r"[a-z0-9_-]{1,32}")
TENANTS_DIR = "tenants"  # <data_dir>/tenants/<name>/ holds a tenant's disk tier and token file
MAX_TENANTS = 64  # each tenant costs a store (segments, RocksDB, threads): keep the count sane
TENANT_KEYS = ("host_bytes", "disk_bytes", "gpu_bytes", "token", "token_file", "events_endpoint",
               "events_replay_endpoint", "accept_lossy")
"""Keys of a ``[tenants.<name>]`` table."""
_SIZES = ("host_bytes", "disk_bytes", "gpu_bytes")


@dataclass(frozen=True, slots=True)
class TenantConfig:
    """One tenant's settings.

    Attributes:
        name: ``[a-z0-9_-]{1,32}``; appears in segment names, directories, metric labels, topics.
        host_bytes: the tenant's host-memory budget (its own segments), > 0.
        disk_bytes: the tenant's disk budget; 0: no disk tier for this tenant.
        gpu_bytes: the tenant's GPU budget; 0 (default): none.
        token: the tenant's token itself (prefer ``token_file``).
        token_file: file holding the token; default ``<data_dir>/tenants/<name>/token``,
            generated (0600) when missing.
        events_endpoint: ZMQ PUB endpoint for this tenant's KV events (topic
            ``<events.topic>/<name>``). ZMQ has no authentication, so it is opt-in per tenant;
            None (default): the tenant's events reach only its own ``/v1/events`` stream.
        events_replay_endpoint: ZMQ ROUTER answering replay requests for this tenant's events.
        accept_lossy: the tenant's default for requests that do not say whether a lossy stored
            copy may serve them (``StoreConfig.accept_lossy``); None: the default store's.
    """

    name: str
    host_bytes: int
    disk_bytes: int
    gpu_bytes: int = 0
    token: str | None = None
    token_file: str | None = None
    events_endpoint: str | None = None
    events_replay_endpoint: str | None = None
    accept_lossy: bool | None = None

    def __repr__(self) -> str:  # the token never reaches a log line
        return (f"TenantConfig(name={self.name!r}, host_bytes={self.host_bytes}, disk_bytes={self.disk_bytes}, "
                f"gpu_bytes={self.gpu_bytes}, token={'<set>' if self.token else None}, "
                f"token_file={self.token_file!r}, events_endpoint={self.events_endpoint!r})")

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TENANT_NAME.fullmatch(self.name):
            raise ConfigError(f"tenant name must be 1-32 of [a-z0-9_-], got {self.name!r}")
        where = f"tenants.{self.name}"
        for key in _SIZES:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{where}.{key} must be a size in bytes, got {value!r}")
        if self.host_bytes == 0:
            raise ConfigError(f"{where}.host_bytes must be > 0: the host tier is where blocks are written")
        if self.token is not None and (not isinstance(self.token, str) or len(self.token) < MIN_TOKEN_LEN):
            raise ConfigError(f"{where}.token must be text of at least {MIN_TOKEN_LEN} characters")
        if self.token_file is not None and not typed(f"{where}.token_file", self.token_file, str):
            raise ConfigError(f"{where}.token_file must be a path")
        if self.accept_lossy is not None:
            typed(f"{where}.accept_lossy", self.accept_lossy, bool)
        # EventsConfig checks the endpoints' form (and that replay needs a publisher, at start).
        self.events_config(EventsConfig(topic="kv@check@kvtier"))

    def directory(self, data_dir: str) -> str:
        """``<data_dir>/tenants/<name>``: the tenant's disk tier and default token file."""
        return os.path.join(data_dir, TENANTS_DIR, self.name)

    def default_token_file(self, data_dir: str) -> str:
        return os.path.join(self.directory(data_dir), "token")

    def store_config(self, base: StoreConfig, data_dir: str) -> StoreConfig:
        """The tenant's store: ``base`` (the default store's settings) with the tenant's budgets,
        segment-name prefix and disk directory.

        Raises:
            ConfigError: the combination is invalid (e.g. write-through without a disk tier, or a
                segment prefix longer than 64 characters).
        """
        seg = min(base.host_segment_bytes, self.host_bytes) if base.host_segment_bytes else 0
        disk = os.path.join(self.directory(data_dir), "disk") if self.disk_bytes else None
        try:
            return dataclasses.replace(base, host_bytes=self.host_bytes, host_segment_bytes=seg,
                                       host_name_prefix=f"{base.host_name_prefix}-t-{self.name}",
                                       disk_path=disk, disk_bytes=self.disk_bytes, gpu_bytes=self.gpu_bytes,
                                       accept_lossy=base.accept_lossy if self.accept_lossy is None else self.accept_lossy)
        except ValueError as e:
            raise ConfigError(f"tenants.{self.name}: {e}") from None

    def events_config(self, base: EventsConfig) -> EventsConfig:
        """The tenant's event hub: its own endpoints (if any) and topic ``<base topic>/<name>``."""
        try:
            return dataclasses.replace(base, endpoint=self.events_endpoint,
                                       replay_endpoint=self.events_replay_endpoint, packed_endpoint=None,
                                       topic=f"{base.topic}/{self.name}")
        except ConfigError as e:
            raise ConfigError(f"tenants.{self.name}: {e.message}") from None


def parse_tenants(doc: Any, origin: str) -> tuple[TenantConfig, ...]:
    """The ``[tenants]`` table of a TOML file as TenantConfigs, in name order.

    Raises:
        ConfigError: not a table of tables, an unknown key, a bad name or value.
    """
    if not isinstance(doc, Mapping):
        raise ConfigError(f"tenants ({origin}) must be tables [tenants.<name>]")
    if len(doc) > MAX_TENANTS:
        raise ConfigError(f"tenants ({origin}): {len(doc)} tenants > limit {MAX_TENANTS}")
    out = []
    for name in sorted(doc):
        table = doc[name]
        if not isinstance(table, Mapping):
            raise ConfigError(f"tenants.{name} ({origin}) must be a table")
        unknown = sorted(set(table) - set(TENANT_KEYS))
        if unknown:
            raise ConfigError(f"unknown key(s) in [tenants.{name}] ({origin}): {', '.join(unknown)} "
                              f"(allowed: {', '.join(TENANT_KEYS)})")
        missing = [k for k in ("host_bytes", "disk_bytes") if k not in table]
        if missing:
            raise ConfigError(f"[tenants.{name}] ({origin}) needs {' and '.join(missing)}")
        values: dict[str, Any] = {}
        for key, value in table.items():
            try:
                if key in _SIZES:
                    values[key] = parse_size(value)
                elif key == "token_file":
                    values[key] = os.path.abspath(os.path.expanduser(typed(f"tenants.{name}.{key}", value, str)))
                elif key in ("events_endpoint", "events_replay_endpoint") and value in ("", "off"):
                    values[key] = None
                elif key == "accept_lossy":
                    values[key] = typed(f"tenants.{name}.{key}", value, bool)
                else:
                    values[key] = typed(f"tenants.{name}.{key}", value, str)
            except ConfigError as e:
                raise ConfigError(f"tenants.{name}.{key} ({origin}): {e.message}") from None
        out.append(TenantConfig(name=str(name), **values))
    return tuple(out)


def check_tenants(tenants: tuple[TenantConfig, ...], store: StoreConfig, data_dir: str,
                  admin_token: str | None) -> None:
    """Checks across tenants: unique names, distinct tokens, each tenant's store settings valid.

    Raises:
        ConfigError: the first problem found (tokens are never quoted).
    """
    if not isinstance(tenants, tuple) or not all(isinstance(t, TenantConfig) for t in tenants):
        raise ConfigError("tenants must be a tuple of TenantConfig")
    names = [t.name for t in tenants]
    if len(set(names)) != len(names):
        raise ConfigError(f"tenant names must be unique, got {names}")
    tokens = [t.token for t in tenants if t.token is not None] + ([admin_token] if admin_token else [])
    if len(set(tokens)) != len(tokens):
        raise ConfigError("two tenants (or a tenant and auth.token) share a token; each needs its own")
    for t in tenants:
        t.store_config(store, data_dir)
