"""kvtier as SGLang's HiCache L3 storage (``--hicache-storage-backend dynamic``, ``interface_v1``).

``kvtier_sglang.storage.KVTierStorage`` is the class SGLang loads (it subclasses SGLang's
``HiCacheStorage``, so importing it imports SGLang); :class:`PageBackend` is the same backend
without the SGLang base class. Importing this package does not import SGLang.
"""

from __future__ import annotations

from typing import Any

from kvtier_sglang.backend import PageBackend
from kvtier_sglang.pages import PAGE_LAYOUTS, PoolGeometry
from kvtier_sglang.settings import BackendSettings

__all__ = ["PAGE_LAYOUTS", "BackendSettings", "KVTierStorage", "PageBackend", "PoolGeometry"]


def __getattr__(name: str) -> Any:
    # KVTierStorage needs SGLang: import it only when asked for.
    if name == "KVTierStorage":
        from kvtier_sglang.storage import KVTierStorage
        return KVTierStorage
    raise AttributeError(f"module 'kvtier_sglang' has no attribute {name!r}")
