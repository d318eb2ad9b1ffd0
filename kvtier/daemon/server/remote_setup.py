"""Building each store's remote tier from the daemon's ``[remote]`` settings (issue 23).

redis-py (the ``kvtier[remote]`` extra) is imported only when a remote tier is configured. Each
store (the default one, each tenant's) gets its own connection to the cluster, keyed by its own
tenant name (``<key_prefix>:<tenant>:...``), so its counters and its breaker are its own.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.daemon.config import ConfigError, DaemonConfig
from kvtier.daemon.config.settings import REMOTE_DEFAULT_TENANT
from kvtier.daemon.store.remote_link import RemoteOptions

log = logging.getLogger(__name__)

def remote_args(config: DaemonConfig, tenant: str | None) -> dict[str, Any]:
    """``TieredStore`` keyword arguments for the store of ``tenant`` (None: the default store):
    ``{}`` without a remote tier.

    Raises:
        ConfigError: redis-py is not installed, or the password file cannot be read.
    """
    rc = config.remote
    if not rc.enabled:
        return {}
    try:
        from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings
    except ImportError as e:
        raise ConfigError(f"remote.url needs redis-py (pip install 'kvtier[remote]'): {e}") from None
    assert rc.url is not None
    settings = RedisClusterSettings(rc.url, user=rc.user, password_file=rc.password_file, timeout_s=rc.timeout_s,
                                    prefix=rc.key_prefix, tls_ca_file=rc.tls_ca_file)
    try:
        blocks = RedisClusterBlocks(settings)
    except OSError as e:
        raise ConfigError(f"remote.password_file: cannot read it: {e.strerror or e}") from None
    name = tenant if tenant is not None else REMOTE_DEFAULT_TENANT
    options = RemoteOptions(tenant=name, write_mode=rc.write_mode, upload_queue_bytes=rc.upload_queue_bytes,
                            lookup_budget_s=rc.lookup_budget_ms / 1000, timeout_s=rc.timeout_s,
                            codec=rc.codec, compression=rc.compression, k_axis=rc.k_axis, models=rc.models)
    log.info("kvtierd remote tier%s: %s as %s, keys %s:%s:*, write mode %s", f" of tenant {tenant}" if tenant else "",
             blocks.address, rc.user or "the default user", rc.key_prefix, name, rc.write_mode)
    return {"remote": blocks, "remote_options": options}
