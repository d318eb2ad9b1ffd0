"""The daemon's settings (torch-free): what ``kvtier serve`` reads, checked and typed.

The modules, each importing only those above it (never this package)::

    values    ConfigError, sizes, HOST:PORT, the type and range checks every section uses
    sections  DataPlaneConfig, RestConfig, EventsConfig, AuthConfig
    tenants   TenantConfig: [tenants.<name>] and the checks across tenants
    settings  DaemonConfig: the whole tree
    sources   load_config: defaults < TOML file < KVTIER_* environment < flags; the option table

Callers import the names below from this package.
"""

from kvtier.daemon.config.sections import AuthConfig, DataPlaneConfig, EventsConfig, RestConfig
from kvtier.daemon.config.settings import LOG_LEVELS, DaemonConfig
from kvtier.daemon.config.sources import (ENV_ALIASES, OPTIONS, SECTIONS, default_host_bytes, env_name,
                                          load_config, nvidia_driver_present)
from kvtier.daemon.config.tenants import TENANT_KEYS, TenantConfig
from kvtier.daemon.config.values import GIB, KIB, MIB, UNIX_PATH_MAX, ConfigError, parse_size, split_hostport

__all__ = [
    "AuthConfig", "ConfigError", "DaemonConfig", "DataPlaneConfig", "ENV_ALIASES", "EventsConfig", "GIB", "KIB",
    "LOG_LEVELS", "MIB", "OPTIONS", "RestConfig", "SECTIONS", "TENANT_KEYS", "TenantConfig", "UNIX_PATH_MAX",
    "default_host_bytes", "env_name", "load_config", "nvidia_driver_present", "parse_size", "split_hostport",
]
