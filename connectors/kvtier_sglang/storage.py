"""``KVTierStorage``: the class SGLang's ``dynamic`` storage backend loads (imports SGLang).

::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier", "module_path": "kvtier_sglang.storage",
        "class_name": "KVTierStorage", "interface_v1": 1, "address": "unix:/run/kvtier/kvtier.sock"}'

SGLang's ``StorageBackendFactory`` imports this module, checks that the class subclasses
``HiCacheStorage`` and constructs it as ``KVTierStorage(storage_config, kwargs)``; the cache
controller then calls ``register_mem_pool_host`` and, with ``interface_v1: 1``, the zero-copy
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``. All behaviour is in
:class:`kvtier_sglang.backend.PageBackend`, listed first so its methods override the base's.
"""

from __future__ import annotations

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvtier_sglang.backend import PageBackend

__all__ = ["KVTierStorage"]


class KVTierStorage(PageBackend, HiCacheStorage):
    """SGLang HiCache L3 storage in a kvtier daemon (see :class:`PageBackend`)."""
