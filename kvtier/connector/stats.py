"""Counters of one connector core, for engines, benchmarks and tests (exported elsewhere, if at all)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class ConnectorStats:
    """What a connector core did since it was made (or since the last :meth:`take`).

    Attributes:
        lookups: lookup calls answered by the daemon.
        lookup_hits: blocks those lookups found.
        loaded_blocks: blocks written into pages (load) or returned as tensors (fetch).
        saved_blocks: blocks newly stored by save/store.
        skipped_blocks: blocks save/store found already stored (not copied or sent).
        failed_calls: daemon calls that failed or timed out (answered as misses / not stored).
    """

    lookups: int = 0
    lookup_hits: int = 0
    loaded_blocks: int = 0
    saved_blocks: int = 0
    skipped_blocks: int = 0
    failed_calls: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **counts: int) -> None:
        """Add to counters by name (the engine thread and the job worker both count)."""
        with self._lock:
            for name, n in counts.items():
                setattr(self, name, getattr(self, name) + n)

    def take(self) -> dict[str, int]:
        """The counters as a dict, reset to zero."""
        with self._lock:
            out = {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}
            for name in out:
                setattr(self, name, 0)
        return out
