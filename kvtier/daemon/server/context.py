"""The daemon's shared state: what every service (data plane, REST, metrics, events) is handed.

The services import this module and it imports none of them back (only what the state is made of:
settings, auth, the event hub, the store), so the imports among the services point one way; what
it needs of the metrics is the small :class:`ServiceMetrics` protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import kvtier

if TYPE_CHECKING:
    from kvtier.daemon.config import DaemonConfig
    from kvtier.daemon.server.auth import Auth
    from kvtier.daemon.server.events import EventHub
    from kvtier.daemon.store.store import TieredStore


class ServiceMetrics(Protocol):
    """What the services report to and read from :class:`kvtier.daemon.server.metrics.Metrics`."""

    def observe_request(self, op: str, status: str, seconds: float) -> None: ...  # one request, its latency
    def add_lookup_tokens(self, hit_tokens: int, miss_tokens: int) -> None: ...  # one lookup's tokens
    def connections(self, n: int) -> None: ...  # open data-plane connections
    def render(self) -> tuple[bytes, str]: ...  # the Prometheus exposition and its content type


@dataclass(frozen=True, slots=True)
class Scope:
    """Where one principal's requests go: a store and the event hub fed by it.

    Attributes:
        tenant: the tenant's name; None for the default store.
        store: the tenant's (or the default) store, started.
        events: the hub that publishes this store's events (SSE, and ZMQ where configured).
    """

    tenant: str | None
    store: TieredStore
    events: EventHub

    @property
    def label(self) -> str:
        """The ``tenant`` label of metrics: the name, ``""`` for the default store."""
        return self.tenant or ""


@dataclass(slots=True)
class DaemonContext:
    """One running daemon's parts, built by :func:`kvtier.daemon.server.daemon.run_daemon`.

    Attributes:
        config: the settings it runs with.
        store: the default store (started): the one of clients that are no tenant.
        auth: the token checks.
        metrics: the Prometheus metrics (:class:`~kvtier.daemon.server.metrics.Metrics`, bound to this context).
        events: the KV-event hub of the default store.
        started_at: ``time.time()`` when start-up began.
        ready: True from the moment every endpoint listens until shutdown begins (``/v1/ready``).
        version: the kvtier version.
        endpoints: what listens where, by service (``"dataplane"``, ``"rest"``, ``"events"``,
            ``"events:<tenant>"``), with the actual addresses (port 0 resolved), as logged at start.
        tenants: each tenant's scope (own store and event hub), by name; empty without tenants.
    """

    config: DaemonConfig
    store: TieredStore
    auth: Auth
    metrics: ServiceMetrics
    events: EventHub
    started_at: float
    ready: bool = False
    version: str = kvtier.__version__
    endpoints: dict[str, list[str]] = field(default_factory=dict)
    tenants: dict[str, Scope] = field(default_factory=dict)

    def scope(self, tenant: str | None = None) -> Scope:
        """The default scope (``tenant`` None) or a tenant's.

        Raises:
            KeyError: no such tenant (callers check the principal first).
        """
        return Scope(None, self.store, self.events) if tenant is None else self.tenants[tenant]

    def scopes(self) -> list[Scope]:
        """The default scope first, then every tenant's, in name order."""
        return [self.scope()] + [self.tenants[name] for name in sorted(self.tenants)]
