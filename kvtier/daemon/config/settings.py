"""The daemon's settings as a whole: :class:`DaemonConfig`, one typed, frozen dataclass tree
(aesthetics §2.15) of the store, the service sections (:mod:`kvtier.daemon.config.sections`),
the ``[daemon]`` options and the tenants (:mod:`kvtier.daemon.config.tenants`). Torch-free.

:func:`kvtier.daemon.config.sources.load_config` builds one from defaults, a TOML file, the
environment and flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.daemon.config.sections import AuthConfig, DataPlaneConfig, EventsConfig, RemoteConfig, RestConfig
from kvtier.daemon.config.tenants import TenantConfig, check_tenants
from kvtier.daemon.config.values import ConfigError, positive, typed
from kvtier.daemon.store.config import StoreConfig

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
REMOTE_DEFAULT_TENANT = "default"
"""The tenant part of the default store's remote keys (``<prefix>:default:...``)."""


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
        remote: the remote tier shared by many hosts (off unless ``remote.url`` is set).
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
    remote: RemoteConfig = RemoteConfig()

    def __post_init__(self) -> None:
        if not typed("daemon.data_dir", self.data_dir, str):
            raise ConfigError("daemon.data_dir must be a path")
        if typed("daemon.log_level", self.log_level, str).lower() not in LOG_LEVELS:
            raise ConfigError(f"daemon.log_level must be one of {LOG_LEVELS}, got {self.log_level!r}")
        object.__setattr__(self, "log_level", self.log_level.lower())
        positive("daemon.drain_timeout_s", self.drain_timeout_s, number=True, zero=True)
        typed("daemon.gc_freeze", self.gc_freeze, bool)
        if self.tenants != ():
            check_tenants(self.tenants, self.store, self.data_dir, self.auth.token)
        if self.remote.enabled and any(t.name == REMOTE_DEFAULT_TENANT for t in self.tenants):
            # The default store's remote keys are <prefix>:default:...; a tenant of that name would share them.
            raise ConfigError(f"a tenant named {REMOTE_DEFAULT_TENANT!r} would share the default store's remote "
                              "keys; rename it")
