"""The daemon's shared state: what every service (data plane, REST, metrics, events) is handed."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import kvtier

if TYPE_CHECKING:
    from kvtier.config import DaemonConfig
    from kvtier.server.auth import Auth
    from kvtier.server.dataplane import DataPlane
    from kvtier.server.events import EventHub
    from kvtier.server.metrics import Metrics
    from kvtier.store.store import TieredStore


@dataclass(slots=True)
class DaemonContext:
    """One running daemon's parts, built by :func:`kvtier.server.daemon.run_daemon`.

    Attributes:
        config: the settings it runs with.
        store: the tiered store (started).
        auth: the token check.
        metrics: the Prometheus metrics (bound to this context).
        events: the KV-event hub.
        started_at: ``time.time()`` when start-up began.
        ready: True from the moment every endpoint listens until shutdown begins (``/v1/ready``).
        version: the kvtier version.
        dataplane: the data plane, once started (for connection counts).
        endpoints: what listens where, by service (``"dataplane"``, ``"rest"``, ``"events"``),
            with the actual addresses (port 0 resolved), as logged at start.
    """

    config: DaemonConfig
    store: TieredStore
    auth: Auth
    metrics: Metrics
    events: EventHub
    started_at: float
    ready: bool = False
    version: str = kvtier.__version__
    dataplane: DataPlane | None = None
    endpoints: dict[str, list[str]] = field(default_factory=dict)
