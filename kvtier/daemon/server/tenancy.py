"""Tenant isolation: one store and event hub per tenant, and who may reach which.

Isolation is structural, not a filter: each tenant's blocks live in a
:class:`~kvtier.daemon.store.store.TieredStore` of their own (own shared-memory segments, disk
directory, index, policy, leases, capacity). A request is routed to exactly one store, chosen
from the token it came with, so another tenant's request never reaches it: it cannot read, probe,
evict or map those blocks (docs/design.md §7).

::

    token ──Auth.identify──► Principal ──hello_scope / rest_scope──► Scope(store, events)

    data plane: a tenant token ─► its store (and only its segments' descriptors)
                the admin token, or none on the unix socket ─► the default store
                hello naming a tenant the token does not belong to ─► unauthorized
    REST:       a tenant token ─► its store; another tenant's name ─► 404, as for no tenant
                the admin token ─► the default store, or ?tenant=NAME
                no token ─► the default store, read-only
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvtier_protocol.errors import NotFound, Unauthorized

from kvtier.daemon.config import DaemonConfig
from kvtier.daemon.server.auth import Principal
from kvtier.daemon.server.context import DaemonContext, Scope
from kvtier.daemon.server.events import EventHub, EventMetrics
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.server.remote_setup import remote_args
from kvtier.daemon.store.store import TieredStore

log = logging.getLogger(__name__)


async def open_tenants(config: DaemonConfig, metrics: EventMetrics | None,
                       checked: Callable[[StoreConfig], StoreConfig] = lambda c: c) -> dict[str, Scope]:
    """Start every tenant's store and make its event hub (not started: see :func:`start_hubs`).

    Args:
        config: the daemon settings (``tenants``, ``store``, ``events``, ``data_dir``).
        metrics: where the hubs count published events.
        checked: adjusts a tenant's store settings to this host (the daemon drops an unavailable
            GPU tier).

    Raises:
        KVTierError, OSError: a store could not start; the ones already started are closed.
    """
    scopes: dict[str, Scope] = {}
    try:
        for tenant in config.tenants:
            store_cfg = checked(tenant.store_config(config.store, config.data_dir))
            log.info("kvtierd tenant %s: host %d B, disk %s, gpu %d B", tenant.name, store_cfg.host_bytes,
                     f"{store_cfg.disk_bytes} B at {store_cfg.disk_path}" if store_cfg.disk_path else "off",
                     store_cfg.gpu_bytes)
            store = TieredStore(store_cfg, **remote_args(config, tenant.name))
            await store.start()
            hub = EventHub(tenant.events_config(config.events), metrics)
            scopes[tenant.name] = Scope(tenant.name, store, hub)
    except BaseException:
        await close_stores(list(scopes.values()))
        raise
    return scopes


def start_hubs(scopes: dict[str, Scope]) -> dict[str, list[str]]:
    """Open the ZMQ sockets of the tenants that have an events endpoint.

    Returns:
        ``{"events:<tenant>": [endpoint, replay endpoint]}`` for each tenant that publishes.
    """
    out = {}
    for name, scope in scopes.items():
        endpoints = scope.events.start()
        if endpoints:
            out[f"events:{name}"] = endpoints
    return out


async def close_stores(scopes: list[Scope]) -> None:
    """Close the stores side by side (each flushes its memory blocks to its disk); failures are
    logged, so one broken store never keeps the others open."""
    results = await asyncio.gather(*(s.store.close() for s in scopes), return_exceptions=True)
    for scope, result in zip(scopes, results):
        if isinstance(result, BaseException):
            log.error("kvtierd: closing the store of tenant %s failed", scope.tenant, exc_info=result)


def close_hubs(scopes: list[Scope]) -> None:
    """Close the tenants' event hubs (idempotent)."""
    for scope in scopes:
        scope.events.close()


def hello_scope(ctx: DaemonContext, principal: Principal | None, asked: str | None) -> Scope:
    """The data-plane scope of a connection whose hello presented ``principal`` and asked for tenant ``asked``.

    Raises:
        Unauthorized: ``asked`` is not the tenant whose token was presented. The same answer for
            a tenant that does not exist, so a hello cannot probe tenant names.
    """
    if asked is not None and (principal is None or principal.tenant != asked):
        raise Unauthorized("the token does not allow the tenant asked for")
    if principal is not None and principal.tenant is not None:
        return ctx.tenants[principal.tenant]
    return ctx.scope()


def rest_scope(ctx: DaemonContext, principal: Principal | None, asked: str | None) -> Scope:
    """The REST scope of a request by ``principal`` (None: no token) asking for tenant ``asked``.

    Raises:
        NotFound: the admin asked for a tenant that does not exist, or a tenant asked for another
            tenant (answered as if it did not exist: no probing).
        Unauthorized: an anonymous request asked for a tenant.
    """
    if principal is not None and principal.tenant is not None:
        if asked not in (None, principal.tenant):
            raise NotFound("no such tenant")
        return ctx.tenants[principal.tenant]
    if asked is None or asked == "":
        return ctx.scope()
    if principal is None:
        raise Unauthorized("a tenant's data needs its token or the admin token")
    if asked not in ctx.tenants:
        raise NotFound("no such tenant")
    return ctx.tenants[asked]
