"""The tiered block store: index, policies, leases and tiers behind one facade, :class:`TieredStore`.

Names are re-exported lazily (PEP 562): importing ``kvtier.store.index`` or another bookkeeping
module must not pull in RocksDB or torch through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TieredStore": "kvtier.store.store",
    "StoreConfig": "kvtier.store.config",
    "StoreConfigError": "kvtier.store.config",
    "ZeroCapacity": "kvtier.store.config",
    "LookupResult": "kvtier.store.results",
    "Reservation": "kvtier.store.results",
    "PutStatus": "kvtier.store.results",
    "Acquired": "kvtier.store.results",
    "AcquiredBlock": "kvtier.store.results",
    "BlockInfo": "kvtier.store.results",
    "CheckReport": "kvtier.store.results",
    "StoreCounters": "kvtier.store.stats",
    "TierCounters": "kvtier.store.stats",
    "StoreGauges": "kvtier.store.stats",
    "TierGauges": "kvtier.store.stats",
    "StoreEvent": "kvtier.store.stats",
    "EventKind": "kvtier.store.stats",
    "BlockKey": "kvtier.store.types",
    "Slot": "kvtier.store.types",
    "Tier": "kvtier.store.types",
    "make_key": "kvtier.store.types",
    "split_key": "kvtier.store.types",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvtier.store.config import StoreConfig, StoreConfigError, ZeroCapacity
    from kvtier.store.results import (Acquired, AcquiredBlock, BlockInfo, CheckReport, LookupResult,
                                      PutStatus, Reservation)
    from kvtier.store.stats import (EventKind, StoreCounters, StoreEvent, StoreGauges, TierCounters,
                                    TierGauges)
    from kvtier.store.store import TieredStore
    from kvtier.store.types import BlockKey, Slot, Tier, make_key, split_key


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
