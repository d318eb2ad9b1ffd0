"""The REST API of the daemon (aiohttp): inspection, token lookup, admin mutations, SSE, metrics.

::

    GET    /v1/health  /v1/ready  /v1/stats  /v1/tiers  /v1/namespaces  /v1/events  /metrics  /openapi.json
    GET    /v1/blocks?ns=&tier=&limit=&cursor=      GET /v1/blocks/{ns}/{hash}   (hash: or a unique prefix)
    POST   /v1/lookup                               (read-only)
    DELETE /v1/blocks/{ns}/{hash}   POST /v1/clear   POST /v1/check      (token: Authorization: Bearer)
    GET    /v1/tenants                              (a token: the tenants it may see)

Tenants (:mod:`kvtier.daemon.server.tenancy`): every store route (stats, tiers, namespaces, blocks,
lookup, delete, clear, check, events) serves one store. A tenant's token selects its own store
(another tenant's block is a 404 like a missing one); the admin token the default store, or
``?tenant=NAME``. A token that is presented must be valid.

Without a token: health, readiness, ``/metrics`` (the default store's series only, unless
``rest.public_tenant_metrics``) and the OpenAPI document. Reading the store (stats, tiers,
namespaces, blocks, lookup, events) needs a token unless ``rest.public_reads`` is set; then
anonymous reads see the default store. The work a request can cause is bounded: bodies of at
most :data:`MAX_BODY_BYTES` that must arrive within ``rest.body_timeout_s``, lookups of at most
``MAX_LOOKUP_TOKENS`` token ids, parsed and hashed in a worker thread, :data:`HEAVY_SLOTS` at a
time (more wait), so the event loop, which also serves the data plane, stays responsive.
Connections are capped and must send their headers in time (:mod:`kvtier.daemon.server.rest_guard`).

One middleware turns every error into a JSON body ``{"error": {"code", "message"}}`` (the codes
are the wire codes of kvtier_protocol.errors) and counts each request in the metrics as
``rest_<route>``.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from kvtier_protocol.errors import (Busy, InvalidKey, InvalidRequest, KVTierError, LimitExceeded, NamespaceError,
                                    NotFound, ProtocolError, Unauthorized, Unavailable)
from kvtier_protocol.namespace import NS_ID_LEN

from kvtier.daemon.server import rest_views as views
from kvtier.daemon.server.auth import Principal
from kvtier.daemon.server.openapi import openapi_document
from kvtier.daemon.server.remote_views import remote_tier_row, remote_view
from kvtier.daemon.server.tenancy import rest_scope
from kvtier.daemon.store.types import split_key

if TYPE_CHECKING:
    from kvtier.daemon.server.context import DaemonContext, Scope
    from kvtier.daemon.store.store import TieredStore

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 << 20  # a lookup of MAX_LOOKUP_TOKENS ids in JSON is ~3 MiB
HEARTBEAT_S = 15.0
HEAVY_SLOTS = 1  # lookups parsed and hashed at once (each in a worker thread); more wait their turn

CTX_KEY: web.AppKey[DaemonContext] = web.AppKey("kvtier_ctx")
HEARTBEAT_KEY = web.AppKey("kvtier_sse_heartbeat_s", float)
STOPPING_KEY = web.AppKey("kvtier_stopping", asyncio.Event)
OPENAPI_KEY = web.AppKey("kvtier_openapi", dict)
HEAVY_KEY = web.AppKey("kvtier_heavy", asyncio.Semaphore)

_STATUS: tuple[tuple[type[KVTierError], int], ...] = (
    (Unauthorized, 401), (NotFound, 404), (NamespaceError, 404), (LimitExceeded, 413),
    (InvalidKey, 400), (InvalidRequest, 400), (ProtocolError, 400), (Busy, 429), (Unavailable, 503),
)
"""HTTP status of each error class, most specific first; any other KVTierError is a 500."""
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 408: "timeout", 413: "limit_exceeded"}

routes = web.RouteTableDef()


class _QuietBadRequests(logging.Filter):
    """aiohttp logs every malformed HTTP request as ERROR with a traceback, so any peer that can
    reach the port could flood the log with them. The peer already got its 400: one INFO line
    without a traceback says enough."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg, record.args = "malformed HTTP request: %s", (str(exc).replace("\n", " ")[:200],)
        record.exc_info = record.exc_text = None
        return logging.getLogger(record.name).isEnabledFor(logging.INFO)


_QUIET_BAD_REQUESTS = _QuietBadRequests()


def http_status(exc: KVTierError) -> int:
    """The HTTP status an error maps to."""
    return next((status for cls, status in _STATUS if isinstance(exc, cls)), 500)


def _error(status: int, code: str, message: str, headers: Any = None) -> web.Response:
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """JSON error bodies for every failure, and one metrics observation per request."""
    started = time.perf_counter()
    outcome = "ok"
    try:
        return await handler(request)
    except KVTierError as exc:
        outcome = exc.code
        if request.body_exists and not request.content.is_eof():
            # Refused before its body was read (no token, too large): the connection ends after
            # the answer, and the body's remaining bytes are dropped unparsed, not drained.
            request.protocol.close()
        headers = {"WWW-Authenticate": 'Bearer realm="kvtier"'} if isinstance(exc, Unauthorized) else None
        return _error(http_status(exc), exc.code, exc.message, headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        outcome = _HTTP_CODES.get(exc.status, "http_error")
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(exc.status, outcome, exc.reason, allow)
    except Exception:
        # The message stays generic: internals (paths, reprs) are for the daemon's log only.
        log.exception("REST %s %s failed", request.method, request.path)
        outcome = "internal"
        return _error(500, "internal", "internal error; see the daemon log")
    finally:
        name = request.match_info.route.name
        request.app[CTX_KEY].metrics.observe_request(f"rest_{name or 'other'}", outcome,
                                                     time.perf_counter() - started)


def create_rest_app(ctx: DaemonContext, *, heartbeat_s: float = HEARTBEAT_S) -> web.Application:
    """The REST application over one daemon context.

    Args:
        ctx: the daemon's context (store, auth, metrics, events, readiness).
        heartbeat_s: seconds between SSE heartbeat comments on ``/v1/events``.
    """
    logging.getLogger("aiohttp.server").addFilter(_QUIET_BAD_REQUESTS)  # once: addFilter skips a repeat
    app = web.Application(middlewares=[error_middleware], client_max_size=MAX_BODY_BYTES)
    app[CTX_KEY] = ctx
    app[HEARTBEAT_KEY] = heartbeat_s
    app[STOPPING_KEY] = asyncio.Event()
    app[OPENAPI_KEY] = openapi_document(ctx.version)
    app[HEAVY_KEY] = asyncio.Semaphore(HEAVY_SLOTS)
    app.add_routes(routes)
    app.on_shutdown.append(_end_streams)
    return app


async def _end_streams(app: web.Application) -> None:
    # Event streams never end by themselves: without this, shutdown would wait its full timeout.
    app[STOPPING_KEY].set()


def _ctx(request: web.Request) -> DaemonContext:
    return request.app[CTX_KEY]


def _principal(request: web.Request) -> Principal | None:
    """Who sent the request: None without a token.

    Raises:
        Unauthorized: a token was presented and it is nobody's (whatever the route).
    """
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    presented = token.strip() if scheme.lower() == "bearer" and token.strip() else None
    auth = _ctx(request).auth
    principal = auth.identify(presented)
    if presented is not None and principal is None:
        raise Unauthorized("wrong token")
    return principal


def _scope(request: web.Request, *, mutating: bool = False) -> Scope:
    """The store (and event hub) the request may reach (see the module docstring).

    Raises:
        Unauthorized: a wrong token; no token for a mutating call, for a tenant, or for a read
            unless ``rest.public_reads``.
        NotFound: a tenant that does not exist or that this token may not see.
    """
    principal = _principal(request)
    if mutating and principal is None:
        raise Unauthorized("a valid token is required")
    if principal is None and not _ctx(request).config.rest.public_reads:
        raise Unauthorized("reading the store needs a token (or rest.public_reads = true)")
    return rest_scope(_ctx(request), principal, request.query.get("tenant"))


async def _raw_body(request: web.Request) -> bytes:
    """The request's body: at most MAX_BODY_BYTES (413 at once when its length says more, else
    as soon as more arrives), within ``rest.body_timeout_s`` (408, and the connection closes)."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        # Refused before a byte of it is read; aiohttp drains what follows for a bounded time
        # (lingering_time) so an honest client still reads the answer, then closes.
        raise LimitExceeded(f"request body of {request.content_length} bytes > limit {MAX_BODY_BYTES}")
    timeout_s = _ctx(request).config.rest.body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()  # read() enforces client_max_size (413) as bytes arrive
    except TimeoutError:
        # The rest of the body may still come: the stream is lost. close(), not force_close():
        # the answer goes out first, then the connection ends (after at most lingering_time).
        request.protocol.close()
        raise web.HTTPRequestTimeout(reason=f"the request body did not arrive within {timeout_s:g} s") from None


async def _body(request: web.Request) -> dict[str, Any]:
    return views.parse_json_object(await _raw_body(request))


# --- liveness and state ---------------------------------------------------------------------------


@routes.get("/v1/health", name="health")
async def health(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    return web.json_response({"status": "ok", "version": ctx.version, "uptime_s": _uptime(ctx)})


@routes.get("/v1/ready", name="ready")
async def ready(request: web.Request) -> web.Response:
    if not _ctx(request).ready:
        raise Unavailable("the daemon is starting or stopping")
    return web.json_response({"ready": True})


def _uptime(ctx: DaemonContext) -> float:
    return round(max(0.0, time.time() - ctx.started_at), 3)


@routes.get("/v1/stats", name="stats")
async def stats(request: web.Request) -> web.Response:
    ctx = _ctx(request)
    scope = _scope(request)
    store = scope.store
    return web.json_response({"version": ctx.version, "uptime_s": _uptime(ctx), "ready": ctx.ready,
                              "tenant": scope.tenant,
                              "counters": views.counters_view(store.counters),
                              "gauges": views.gauges_view(store.gauges()),
                              **({"remote": remote_view(store.remote)} if store.remote.enabled else {})})


@routes.get("/v1/tiers", name="tiers")
async def tiers(request: web.Request) -> web.Response:
    store = _scope(request).store
    rows = views.tiers_view(store.counters, store.gauges())
    if store.remote.enabled:
        rows.append(remote_tier_row(store.remote))
    cfg = store.config
    for row in rows:  # what each tier stores (issue 25); the GPU and host tiers keep what clients write
        if row["tier"] == "disk":
            row["precision"] = views.tier_precision(cfg.disk_codec, cfg.disk_k_axis, cfg.disk_compression,
                                                    cfg.disk_models)
        elif row["tier"] == "remote":
            o = store.remote.options
            row["precision"] = views.tier_precision(o.codec, o.k_axis, o.compression, o.models)
        else:
            row["precision"] = None
    return web.json_response({"tiers": rows})


@routes.get("/v1/namespaces", name="namespaces")
async def namespaces(request: web.Request) -> web.Response:
    store = _scope(request).store
    counts: dict[bytes, int] = {}
    for meta in store.index.blocks():
        if meta.committed:
            counts[meta.ns_id] = counts.get(meta.ns_id, 0) + 1
    registered = {ns.ns_id: ns for ns in store.namespaces()}
    ids = sorted(set(registered) | set(counts))
    return web.json_response({"namespaces": [views.namespace_view(registered.get(i), i, counts.get(i, 0))
                                             for i in ids]})


# --- blocks ------------------------------------------------------------------------------------


@routes.get("/v1/blocks", name="blocks")
async def blocks(request: web.Request) -> web.Response:
    """One page of committed blocks in key order; ``next_cursor`` is null on the last page."""
    store = _scope(request).store
    q = request.query
    ns_id = views.parse_ns(q["ns"]) if "ns" in q else None
    tier = views.parse_tier(q.get("tier"))
    limit = views.parse_limit(q.get("limit"))
    after = views.decode_cursor(q.get("cursor"), NS_ID_LEN + store.config.hash_bytes)
    metas = store.index.namespace(ns_id) if ns_id is not None else store.index.blocks()
    # Key order is stable under inserts and deletes, so a walk sees each surviving block once;
    # nsmallest keeps this O(blocks * log page) without sorting the whole index per page.
    keys = heapq.nsmallest(limit + 1, (m.key for m in metas
                                       if m.committed and m.key > after and (tier is None or m.in_tier(tier))))
    now = store.now()
    page = [info for info in (store.info(*split_key(k)) for k in keys[:limit]) if info is not None]
    return web.json_response({"blocks": [views.block_view(i, now) for i in page],
                              "next_cursor": views.encode_cursor(keys[limit - 1]) if len(keys) > limit else None})


def _block_key(request: web.Request, store: TieredStore) -> tuple[bytes, bytes]:
    return (views.parse_ns(request.match_info["ns"]),
            views.parse_hex(request.match_info["hash"], "hash", store.config.hash_bytes))


@routes.get("/v1/blocks/{ns}/{hash}", name="block")
async def block(request: web.Request) -> web.Response:
    """One block; ``hash`` may be a unique prefix of its chain hash (``kvtier ls`` shows 16 digits)."""
    store = _scope(request).store
    ns_id = views.parse_ns(request.match_info["ns"])
    prefix = views.parse_hash_prefix(request.match_info["hash"], store.config.hash_bytes)
    if len(prefix) == 2 * store.config.hash_bytes:
        chain_hash = bytes.fromhex(prefix)
    else:  # one pass over the namespace's blocks, as /v1/blocks makes over all of them
        found = views.match_hash_prefix((m.key for m in store.index.namespace(ns_id) if m.committed), prefix)
        if len(found) > 1:
            raise InvalidKey(views.ambiguous_prefix_message(prefix, found))
        if not found:
            raise NotFound(f"no block of namespace {ns_id.hex()} has a hash starting with {prefix}")
        chain_hash = found[0]
    info = store.info(ns_id, chain_hash)
    if info is None:
        raise NotFound("no such block")
    return web.json_response(views.block_detail(info, store.now(), time.time()))


@routes.delete("/v1/blocks/{ns}/{hash}", name="delete_block")
async def delete_block(request: web.Request) -> web.Response:
    store = _scope(request, mutating=True).store
    ns_id, chain_hash = _block_key(request, store)
    if not await store.delete(ns_id, [chain_hash]):
        raise NotFound("no such block")
    return web.json_response({"deleted": 1})


@routes.post("/v1/clear", name="clear")
async def clear(request: web.Request) -> web.Response:
    store = _scope(request, mutating=True).store
    ns_id = views.parse_ns((await _body(request)).get("ns"))
    return web.json_response({"cleared": await store.clear(ns_id)})


@routes.post("/v1/check", name="check")
async def check(request: web.Request) -> web.Response:
    store = _scope(request, mutating=True).store
    fix = (await _body(request)).get("fix", False) if request.body_exists else False
    if not isinstance(fix, bool):
        raise InvalidRequest("fix must be true or false")
    return web.json_response(views.check_view(await store.check(fix=fix)))


@routes.post("/v1/lookup", name="lookup")
async def lookup(request: web.Request) -> web.Response:
    """Hash the token ids with the registered namespace's scheme, then look the keys up."""
    ctx = _ctx(request)
    store = _scope(request).store
    raw = await _raw_body(request)
    namespaces = {n.ns_id: n for n in store.namespaces()}
    # Parsing, checking and hashing up to MAX_LOOKUP_TOKENS ids takes a fraction of a second:
    # in a worker thread, one lookup at a time, so the loop (and the data plane) keeps its pace.
    async with request.app[HEAVY_KEY]:
        ns, tokens, keys, accept_lossy = await asyncio.to_thread(_lookup_keys, raw, namespaces)
    hits, names = store.lookup_names(ns.ns_id, keys, accept_lossy=accept_lossy)
    per_tier: dict[str, int] = {}
    for label in names:
        per_tier[label] = per_tier.get(label, 0) + ns.block_tokens
    hit_tokens = hits * ns.block_tokens
    ctx.metrics.add_lookup_tokens(hit_tokens, len(tokens) - hit_tokens)
    return web.json_response({"hit_tokens": hit_tokens, "num_tokens": len(tokens), "num_blocks": len(keys),
                              "hit_blocks": hits, "block_tokens": ns.block_tokens, "per_tier": per_tier})


def _lookup_keys(raw: bytes, namespaces: dict[bytes, Any]) -> tuple[Any, list[int], list[bytes], bool | None]:
    """The namespace, token ids, block keys and ``accept_lossy`` of a lookup body (in a worker thread)."""
    body = views.parse_json_object(raw)
    ns_id = views.parse_ns(body.get("ns"))
    tokens = views.parse_token_ids(body.get("token_ids"))
    accept_lossy = body.get("accept_lossy")
    if accept_lossy is not None and not isinstance(accept_lossy, bool):
        raise InvalidRequest(f"accept_lossy must be true or false, got {accept_lossy!r}")
    ns = namespaces.get(ns_id)
    if ns is None:
        raise NotFound(f"namespace {ns_id.hex()} is not registered")
    return ns, tokens, ns.block_keys(tokens), accept_lossy


@routes.get("/v1/tenants", name="tenants")
async def tenants(request: web.Request) -> web.Response:
    """The tenants this token may see (the admin: all; a tenant: itself), with their tiers' use."""
    ctx = _ctx(request)
    principal = _principal(request)
    if principal is None:
        raise Unauthorized("listing tenants needs a token")
    names = sorted(ctx.tenants) if principal.admin else [principal.tenant]
    return web.json_response({"tenants": [views.tenant_view(n, ctx.tenants[n].store.gauges()) for n in names]})


# --- streams and documents ----------------------------------------------------------------------


@routes.get("/v1/events", name="events")
async def events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: one ``data:`` line of JSON per KV event; a comment as heartbeat."""
    hub = _scope(request).events
    stopping = request.app[STOPPING_KEY]
    heartbeat = request.app[HEARTBEAT_KEY]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    queue = hub.subscribe()
    stop = asyncio.ensure_future(stopping.wait())
    get: asyncio.Future[Any] | None = None
    try:
        await resp.write(b": kvtier events\n\n")
        while not stopping.is_set():
            get = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait((get, stop), timeout=heartbeat, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()  # Queue.get loses no item when cancelled
                if not stopping.is_set():
                    await resp.write(b": heartbeat\n\n")  # also how a gone client is noticed
                continue
            batch = [get.result()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            await resp.write(b"".join(b"data: " + json.dumps(views.jsonable(e)).encode() + b"\n\n" for e in batch))
    except ConnectionResetError:
        pass  # the client went away; unsubscribing below is all there is to do
    finally:
        stop.cancel()
        if get is not None:
            get.cancel()
        hub.unsubscribe(queue)
    return resp


@routes.get("/metrics", name="metrics")
async def metrics(request: web.Request) -> web.Response:
    """Prometheus metrics; the tenants' series only to their tokens (the admin: all) unless
    ``rest.public_tenant_metrics``."""
    ctx = _ctx(request)
    principal = _principal(request)
    shown: frozenset[str | None] | None = None
    if not ctx.config.rest.public_tenant_metrics and not (principal is not None and principal.admin):
        shown = frozenset({None, principal.tenant}) if principal is not None else frozenset({None})
    body, content_type = ctx.metrics.render(shown)
    return web.Response(body=body, headers={"Content-Type": content_type})


@routes.get("/openapi.json", name="openapi")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI_KEY])
