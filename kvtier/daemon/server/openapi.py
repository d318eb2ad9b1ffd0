"""The OpenAPI 3.1 document of the REST API (served at ``/openapi.json``).

Written by hand next to the routes in kvtier/daemon/server/rest.py; a test checks that both list the same
(method, path) pairs, so a route cannot be added without documenting it.
"""

from __future__ import annotations

import copy
from typing import Any

from kvtier.daemon.server.rest_views import DEFAULT_PAGE, MAX_LOOKUP_TOKENS, MAX_PAGE, MAX_REPORT_KEYS

_INT = {"type": "integer", "minimum": 0}
_NUM = {"type": "number", "minimum": 0}
_STR = {"type": "string"}
_HEX = {"type": "string", "pattern": "^([0-9a-fA-F]{2})+$"}
_NS_HEX = {"type": "string", "pattern": "^[0-9a-fA-F]{32}$", "description": "namespace id, 16 bytes as hex"}
_TIER = {"type": "string", "enum": ["gpu", "host", "disk", "remote"]}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(props: dict[str, Any], required: tuple[str, ...] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema; every property is required unless ``required`` says otherwise."""
    return {"type": "object", "properties": props,
            "required": list(props if required is None else required), **extra}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"oneOf": [schema, {"type": "null"}]}


def _counts(names: tuple[str, ...]) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": _INT, "description": "keys: " + ", ".join(names)}


_KEY = _obj({"ns": _NS_HEX, "hash": _HEX})
_BLOCK = _obj({
    "ns": _NS_HEX, "hash": _HEX, "parent": _nullable(_HEX), "num_tokens": _INT,
    "size": {**_INT, "description": "payload bytes"}, "tiers": {"type": "array", "items": _TIER},
    "priority": _INT, "hits": _INT, "leases": _INT,
    "idle_s": {**_NUM, "description": "seconds since the last commit, acquire or touch"},
})
_HEADER = _obj({
    "ns_id": _NS_HEX, "chain_hash": _HEX, "parent_hash": _nullable(_HEX), "num_tokens": _INT, "layout": _STR,
    "shape": {"type": "array", "items": _INT}, "dtype": _STR, "codec": _STR,
    "lossy": {"type": "boolean", "description": "the codec is not raw: the stored copy is not exact (SPEC 5)"},
    "compression": _nullable(_obj({
        "alg": {**_STR, "description": "lz4 (SPEC 4.8): byte shuffle + lz4 per section"},
        "sections": {"type": "array", "items": _obj({
            "stride": {**_INT, "description": "0: stored verbatim; else the shuffle stride of one lz4 block"},
            "raw_len": {**_INT, "description": "the section's length once decompressed"}})}})),
    "sections": {"type": "array", "items": _obj({"name": _STR, "offset": _INT, "length": _INT})},
    "payload_len": _INT, "checksum_alg": _STR, "checksum": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
    "quant": _nullable({"type": "object"}), "ns_fields": _nullable(_ref("NamespaceFields")),
    "created_ms": _nullable(_INT), "extra": {"type": "object"},
})

SCHEMAS: dict[str, Any] = {
    "Error": _obj({"error": _obj({"code": {**_STR, "description": "wire code of kvtier_protocol.errors"},
                                  "message": _STR})}),
    "Health": _obj({"status": {"const": "ok"}, "version": _STR, "uptime_s": _NUM}),
    "Ready": _obj({"ready": {"const": True}}),
    "Stats": _obj({"version": _STR, "uptime_s": _NUM, "ready": {"type": "boolean"},
                   "tenant": {**_nullable(_STR), "description": "the tenant whose store this is; null: default"},
                   "counters": {"type": "object", "description": "store counters (StoreCounters), per tier too"},
                   "gauges": {"type": "object", "description": "store gauges (StoreGauges), per tier too"},
                   "remote": _ref("Remote")},
                  ("version", "uptime_s", "ready", "tenant", "counters", "gauges")),
    "Tier": _obj({"tier": _TIER, "medium": _STR, "enabled": {"type": "boolean"},
                  "capacity_bytes": {**_nullable(_INT), "description": "null for the remote tier (the cluster's own)"},
                  "used_bytes": _nullable(_INT), "free_bytes": _nullable(_INT), "blocks": _nullable(_INT),
                  "fragmentation": _nullable(_NUM), "hits": _INT, "misses": _INT, "bytes_in": _INT, "bytes_out": _INT,
                  "evictions": _INT, "demotions": _INT, "remote": _ref("Remote"),
                  "precision": {"oneOf": [{"type": "null"}, _obj({
                      "codec": _STR, "k_axis": {"enum": ["channel", "token"]}, "compression": {"enum": ["none", "lz4"]},
                      "models": {"type": "array", "items": _obj({"pattern": _STR, "codec": _STR})}})],
                      "description": "the codec blocks take on their way into this tier (disk and remote: "
                                     "[tiers.*] codec, k_axis, compression, models); null: kept as written"}},
                 ("tier", "medium", "enabled", "capacity_bytes", "used_bytes", "free_bytes", "blocks", "fragmentation",
                  "hits", "misses", "bytes_in", "bytes_out", "evictions", "demotions", "precision")),
    "Remote": _obj({
        "enabled": {"type": "boolean"}, "address": {**_STR, "description": "the cluster's seed nodes (no secret)"},
        "tenant": {**_STR, "description": "the tenant part of this store's keys"},
        "write_mode": {"enum": ["through", "back", "read-only"]},
        "breaker_state": {"enum": ["closed", "open", "half_open"]}, "breaker_opens": _INT,
        "bytes_up": _INT, "blocks_up": _INT, "bytes_down": _INT, "blocks_down": _INT, "misses": _INT,
        "put_failures": _INT, "deleted": _INT, "skipped": _INT,
        "errors": _counts(("timeout", "connection", "cluster_down", "auth", "oom", "response", "other")),
        "fetch_latency": _obj({"count": _INT, "sum_s": _NUM}),
        "lookup_keys": _INT, "lookup_hits": _INT, "fetched_blocks": _INT, "fetched_bytes": _INT,
        "bad_values": _counts(("truncated", "bad_header", "too_large", "bad_checksum", "wrong_block",
                               "wrong_geometry")),
        "uploads_queued": _INT, "uploaded": _INT, "upload_drops": _INT, "upload_drop_bytes": _INT,
        "upload_failures": _INT, "queue_bytes": _INT, "queue_blocks": _INT, "namespaces_fetched": _INT,
        "namespaces_uploaded": _INT, "codec": {**_STR, "description": "the codec of uploads (raw: exact)"},
        "recoded": _INT, "recoded_saved_bytes": _INT}, description="the remote tier of this store (issue 23), when one is configured"),
    "NamespaceFields": {"type": "object", "required": ["model", "revision", "attention", "salted"],
                        "description": "the namespace map (SPEC.md §2) without tenant_salt",
                        "properties": {"model": _STR, "revision": _STR, "attention": {"enum": ["mha", "mla"]},
                                       "salted": {"type": "boolean", "description": "a tenant salt is set"}}},
    "Namespace": _obj({"ns_id": _NS_HEX, "registered": {"type": "boolean"}, "blocks": _INT,
                       "fields": _ref("NamespaceFields")}, ("ns_id", "registered", "blocks")),
    "Block": _BLOCK,
    "BlockDetail": {"allOf": [_BLOCK, _obj({
        "header": _nullable(_HEADER), "header_error": _STR,
        "age_s": {**_nullable(_NUM), "description": "seconds since the block was encoded (needs header.created_ms)"},
    }, ("header", "age_s"))]},
    "BlockPage": _obj({"blocks": {"type": "array", "items": _ref("Block")}, "next_cursor": _nullable(_STR)}),
    "LookupRequest": _obj({"ns": _NS_HEX, "token_ids": {"type": "array", "maxItems": MAX_LOOKUP_TOKENS,
                                                        "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": (1 << 32) - 1}},
                           "accept_lossy": {"type": "boolean", "description": (
                               "false: count exact copies only (a block a lossy tier re-encoded ends the "
                               "prefix); default: the store's accept_lossy")}}, ("ns", "token_ids")),
    "LookupResult": _obj({"hit_tokens": _INT, "num_tokens": _INT, "num_blocks": _INT, "hit_blocks": _INT,
                          "block_tokens": _INT,
                          "per_tier": {"type": "object", "additionalProperties": _INT,
                                       "description": "hit tokens by the fastest tier holding each block"}}),
    "ClearRequest": _obj({"ns": _NS_HEX}),
    "Cleared": _obj({"cleared": _INT}),
    "Deleted": _obj({"deleted": {"const": 1}}),
    "Tenant": _obj({"name": _STR, "blocks": _INT,
                    "tiers": {"type": "object", "description": "keys: gpu, host, disk",
                              "additionalProperties": _obj({"capacity_bytes": _INT, "used_bytes": _INT,
                                                            "blocks": _INT})}}),
    "CheckRequest": _obj({"fix": {"type": "boolean", "default": False}}, ()),
    "CheckReport": _obj({
        "ok": {"type": "boolean"}, "fixed": {"type": "boolean"},
        "counts": _counts(("missing", "orphans", "corrupt", "accounting", "adopted")),
        "missing": {"type": "array", "items": _KEY, "maxItems": MAX_REPORT_KEYS},
        "orphans": {"type": "array", "items": _KEY, "maxItems": MAX_REPORT_KEYS},
        "corrupt": {"type": "array", "maxItems": MAX_REPORT_KEYS,
                    "items": {"allOf": [_KEY, _obj({"tier": _TIER})]}},
        "accounting": {"type": "array", "items": _STR, "maxItems": MAX_REPORT_KEYS},
        "adopted": {"type": "array", "items": _KEY, "maxItems": MAX_REPORT_KEYS},
    }),
}

_ERRORS = {"400": "malformed request (bad JSON, bad hex, bad argument)", "401": "missing or wrong token",
           "404": "no such block, namespace or tenant", "408": "the request body did not arrive in time", "413": "body or token list too large",
           "429": "busy, retry later", "500": "internal error", "503": "not ready"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _op(op_id: str, summary: str, ok: dict[str, Any], errors: tuple[str, ...] = (), *,
        body: str | None = None, params: list[dict[str, Any]] | None = None,
        token: bool = False, read: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op_id, "summary": summary,
                           "responses": {"200": ok, **{c: {"$ref": f"#/components/responses/E{c}"} for c in errors}}}
    if body is not None:
        out["requestBody"] = {"required": body != "CheckRequest",
                              "content": {"application/json": {"schema": _ref(body)}}}
    if params:
        out["parameters"] = params
    if token:
        out["security"] = [{"bearer": []}]
    elif read:  # a token, unless the daemon serves anonymous reads (rest.public_reads)
        out["security"] = [{"bearer": []}, {}]
    return out


def _param(name: str, where: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": where, "required": where == "path", "schema": schema, "description": description}


_TENANT = _param("tenant", "query", {"type": "string", "pattern": "^[a-z0-9_-]{1,32}$"},
                 "the tenant whose store to use (admin token; a tenant token may name only itself); "
                 "default: the token's tenant, else the default store")
_BLOCK_PARAMS = [_param("ns", "path", _NS_HEX, "namespace id"),
                 _param("hash", "path", _HEX, "chain hash (hash_bytes bytes) as hex"), _TENANT]
_BLOCK_GET_PARAMS = [_BLOCK_PARAMS[0], _param("hash", "path", {"type": "string", "pattern": "^[0-9a-fA-F]{4,}$"},
                                              "chain hash as hex, or a unique prefix of at least 4 digits "
                                              "(an ambiguous one is a 400 naming a few matches)"), _TENANT]


def _json_ok(name: str, description: str) -> dict[str, Any]:
    return _json(_ref(name), description)


def _paths() -> dict[str, Any]:
    return {
        "/v1/health": {"get": _op("health", "Liveness: the process answers", _json_ok("Health", "alive"))},
        "/v1/ready": {"get": _op("ready", "Readiness: 200 once serving, 503 while starting or stopping",
                                 _json_ok("Ready", "serving"), ("503",))},
        "/v1/stats": {"get": _op("stats", "Store counters and gauges", _json_ok("Stats", "counters and gauges"),
                                 ("401", "404"), params=[_TENANT], read=True)},
        "/v1/tiers": {"get": _op("tiers", "Capacity, use and traffic of each tier",
                                 _json(_obj({"tiers": {"type": "array", "items": _ref("Tier")}}), "tiers"),
                                 ("401", "404"), params=[_TENANT], read=True)},
        "/v1/namespaces": {"get": _op("namespaces", "Registered namespaces and namespaces holding blocks",
                                      _json(_obj({"namespaces": {"type": "array", "items": _ref("Namespace")}}),
                                            "namespaces (tenant salts redacted)"), ("401", "404"), params=[_TENANT], read=True)},
        "/v1/tenants": {"get": _op("tenants", "The tenants this token may see (admin: all; a tenant: itself)",
                                   _json(_obj({"tenants": {"type": "array", "items": _ref("Tenant")}}), "tenants"),
                                   ("401",), token=True)},
        "/v1/blocks": {"get": _op(
            "blocks", "Committed blocks in key order, one page at a time", _json_ok("BlockPage", "a page"),
            ("400", "401", "404"), params=[
                _param("ns", "query", _NS_HEX, "only this namespace"), _TENANT,
                _param("tier", "query", _TIER, "only blocks with a copy in this tier"),
                _param("limit", "query", {"type": "integer", "minimum": 1, "maximum": MAX_PAGE,
                                          "default": DEFAULT_PAGE}, "page size"),
                _param("cursor", "query", _STR, "next_cursor of the previous page (opaque)")], read=True)},
        "/v1/blocks/{ns}/{hash}": {
            "get": _op("block", "One block: decoded header, tiers, size, hits, age",
                       _json_ok("BlockDetail", "the block"), ("400", "401", "404"), params=_BLOCK_GET_PARAMS, read=True),
            "delete": _op("delete_block", "Remove a block from every tier", _json_ok("Deleted", "removed"),
                          ("400", "401", "404"), params=_BLOCK_PARAMS, token=True),
        },
        "/v1/lookup": {"post": _op("lookup", "Hit tokens per tier for a prompt's token ids",
                                   _json_ok("LookupResult", "the stored prefix"), ("400", "401", "404", "413"),
                                   body="LookupRequest", params=[_TENANT], read=True)},
        "/v1/clear": {"post": _op("clear", "Remove every block of a namespace", _json_ok("Cleared", "removed"),
                                  ("400", "401", "404", "413"), body="ClearRequest", token=True, params=[_TENANT])},
        "/v1/check": {"post": _op("check", "Audit the index against the tiers, optionally repairing",
                                  _json_ok("CheckReport", "the audit"), ("400", "401", "404", "413"),
                                  body="CheckRequest", token=True, params=[_TENANT])},
        "/v1/events": {"get": _op("events", "KV events as server-sent events (one JSON object per data line)",
                                  {"description": "an endless event stream",
                                   "content": {"text/event-stream": {"schema": _STR}}}, ("401", "404"),
                                  params=[_TENANT], read=True)},
        "/metrics": {"get": _op("metrics", "Prometheus text exposition",
                                {"description": "metrics", "content": {"text/plain": {"schema": _STR}}})},
        "/openapi.json": {"get": _op("openapi", "This document",
                                     _json({"type": "object"}, "the OpenAPI 3.1 document"))},
    }


def openapi_document(version: str) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document (a fresh dict each call)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvtier daemon REST API", "version": version,
                 "description": "Inspection and administration of a kvtier daemon. Errors are JSON "
                                "{\"error\": {\"code\", \"message\"}}; mutations need the daemon's token. "
                                "A tenant's token scopes every store route to that tenant's store."},
        "servers": [{"url": "http://127.0.0.1:7471"}],
        "paths": _paths(),
        "components": {
            "schemas": copy.deepcopy(SCHEMAS),
            "responses": {f"E{c}": _json(_ref("Error"), d) for c, d in _ERRORS.items()},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "the daemon's token (token file, 0600)"}},
        },
    }
