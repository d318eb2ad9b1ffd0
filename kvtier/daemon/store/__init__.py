"""The tiered block store: index, policies, leases and tiers behind one facade, :class:`TieredStore`.

Names are re-exported lazily (PEP 562): importing ``kvtier.daemon.store.index`` or another bookkeeping
module must not pull in RocksDB or torch through this package's ``__init__``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "TieredStore": "kvtier.daemon.store.store",
    "StoreConfig": "kvtier.daemon.store.config",
    "StoreConfigError": "kvtier.daemon.store.config",
    "ZeroCapacity": "kvtier.daemon.store.config",
    "LookupResult": "kvtier.daemon.store.results",
    "Reservation": "kvtier.daemon.store.results",
    "PutStatus": "kvtier.daemon.store.results",
    "Acquired": "kvtier.daemon.store.results",
    "AcquiredBlock": "kvtier.daemon.store.results",
    "BlockInfo": "kvtier.daemon.store.results",
    "CheckReport": "kvtier.daemon.store.results",
    "StoreCounters": "kvtier.daemon.store.stats",
    "TierCounters": "kvtier.daemon.store.stats",
    "StoreGauges": "kvtier.daemon.store.stats",
    "TierGauges": "kvtier.daemon.store.stats",
    "StoreEvent": "kvtier.daemon.store.stats",
    "EventKind": "kvtier.daemon.store.stats",
    "BlockKey": "kvtier.daemon.store.types",
    "Slot": "kvtier.daemon.store.types",
    "Tier": "kvtier.daemon.store.types",
    "make_key": "kvtier.daemon.store.types",
    "split_key": "kvtier.daemon.store.types",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from kvtier.daemon.store.config import StoreConfig, StoreConfigError, ZeroCapacity
    from kvtier.daemon.store.results import (Acquired, AcquiredBlock, BlockInfo, CheckReport, LookupResult,
                                      PutStatus, Reservation)
    from kvtier.daemon.store.stats import (EventKind, StoreCounters, StoreEvent, StoreGauges, TierCounters,
                                    TierGauges)
    from kvtier.daemon.store.store import TieredStore
    from kvtier.daemon.store.types import BlockKey, Slot, Tier, make_key, split_key


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.daemon.store' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
