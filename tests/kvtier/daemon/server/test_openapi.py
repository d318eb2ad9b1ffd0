"""The OpenAPI document: valid OpenAPI 3.1 structure, every route documented (and only those), and
real responses match the documented schemas."""

from __future__ import annotations

import re

from kvtier.daemon.server.rest import create_rest_app
from kvtier.daemon.store.types import make_key
from tests.kvtier.daemon.server.restkit import AUTH, NS, NS_HEX, OTHER, open_ctx, put_tokens, rest_client, tokens_for

OPENAPI_TOP = {  # the top level of the OpenAPI 3.1 schema (spec.openapis.org/oas/3.1/schema), as used here
    "type": "object", "required": ["openapi", "info", "paths"],
    "properties": {
        "openapi": {"type": "string", "pattern": r"^3\.1\.\d+(-.+)?$"},
        "info": {"type": "object", "required": ["title", "version"],
                 "properties": {"title": {"type": "string"}, "version": {"type": "string"}}},
        "servers": {"type": "array", "items": {"type": "object", "required": ["url"]}},
        "paths": {"type": "object", "additionalProperties": {"type": "object"}},
        "components": {"type": "object", "properties": {
            "schemas": {"type": "object"}, "responses": {"type": "object"}, "securitySchemes": {"type": "object"}}},
    },
}


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if isinstance(node.get("$ref"), str) else []) + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _resolve(doc: dict, ref: str) -> object:
    assert ref.startswith("#/"), ref
    node: object = doc
    for part in ref[2:].split("/"):
        assert isinstance(node, dict) and part in node, f"dangling $ref {ref}"
        node = node[part]
    return node


async def test_openapi_document_is_valid_and_complete(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        doc = await (await client.get("/openapi.json")).json()
        app_routes = {(r.method, r.resource.canonical) for r in create_rest_app(ctx).router.routes()
                      if r.method != "HEAD"}
    # OpenAPI 3.1 structure (openapi-spec-validator / jsonschema are not installed here).
    conforms({}, OPENAPI_TOP, doc)
    assert re.fullmatch(r"3\.1\.\d+", doc["openapi"])
    assert isinstance(doc["info"]["title"], str) and doc["info"]["version"] == ctx.version
    assert set(doc) <= {"openapi", "info", "jsonSchemaDialect", "servers", "paths", "webhooks", "components",
                        "security", "tags", "externalDocs"}
    assert doc["components"]["securitySchemes"]["bearer"] == {**doc["components"]["securitySchemes"]["bearer"],
                                                              "type": "http", "scheme": "bearer"}
    op_ids = []
    documented = set()
    for path, item in doc["paths"].items():
        assert path.startswith("/")
        for method, op in item.items():
            assert method in {"get", "put", "post", "delete", "options", "head", "patch", "trace"}
            documented.add((method.upper(), path))
            op_ids.append(op["operationId"])
            assert op["responses"] and all(re.fullmatch(r"[1-5]\d\d|default", c) for c in op["responses"])
            declared = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert declared == set(re.findall(r"\{(\w+)\}", path)), (method, path)
            for p in op.get("parameters", []):
                assert p["in"] in {"path", "query", "header", "cookie"} and (p["in"] != "path" or p["required"])
            if "security" in op:
                assert all(set(s) <= set(doc["components"]["securitySchemes"]) for s in op["security"])
    assert len(op_ids) == len(set(op_ids))
    for ref in _refs(doc):
        _resolve(doc, ref)
    # every route is documented, and nothing else is
    assert documented == app_routes
    needs = {(m, p): op.get("security") for p, item in doc["paths"].items() for m, op in item.items()}
    always = {k for k, sec in needs.items() if sec == [{"bearer": []}]}
    assert always == {("delete", "/v1/blocks/{ns}/{hash}"), ("post", "/v1/clear"), ("post", "/v1/check"),
                      ("get", "/v1/tenants")}
    # Reads of the store: a token unless rest.public_reads (an empty requirement: anonymous allowed).
    reads = {k for k, sec in needs.items() if sec == [{"bearer": []}, {}]}
    assert reads == {("get", "/v1/stats"), ("get", "/v1/tiers"), ("get", "/v1/namespaces"), ("get", "/v1/blocks"),
                     ("get", "/v1/blocks/{ns}/{hash}"), ("post", "/v1/lookup"), ("get", "/v1/events")}
    assert {k for k, sec in needs.items() if sec is None} == {
        ("get", "/v1/health"), ("get", "/v1/ready"), ("get", "/metrics"), ("get", "/openapi.json")}


_TYPES = {"object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list),
          "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
          "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "null": lambda v: v is None}


def conforms(doc: dict, schema: dict, value: object, where: str = "$") -> None:
    """Assert ``value`` matches ``schema`` (the JSON Schema subset the document uses)."""
    if "$ref" in schema:
        conforms(doc, _resolve(doc, schema["$ref"]), value, where)
    for sub in schema.get("allOf", []):
        conforms(doc, sub, value, where)
    if "oneOf" in schema:
        assert sum(_matches(doc, sub, value) for sub in schema["oneOf"]) == 1, f"{where}: {value!r} oneOf"
    assert "const" not in schema or value == schema["const"], f"{where}: {value!r} != {schema['const']!r}"
    assert "enum" not in schema or value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    assert "type" not in schema or _TYPES[schema["type"]](value), f"{where}: {value!r} is not {schema['type']}"
    if isinstance(value, dict):
        assert set(schema.get("required", ())) <= set(value), f"{where}: missing {set(schema['required']) - set(value)}"
        extra = schema.get("additionalProperties")
        for k, v in value.items():
            if k in schema.get("properties", {}):
                conforms(doc, schema["properties"][k], v, f"{where}.{k}")
            elif isinstance(extra, dict):
                conforms(doc, extra, v, f"{where}.{k}")
    if isinstance(value, list):
        assert len(value) <= schema.get("maxItems", len(value))
        for i, v in enumerate(value):
            conforms(doc, schema.get("items", {}), v, f"{where}[{i}]")
    if isinstance(value, str) and "pattern" in schema:
        assert re.search(schema["pattern"], value), f"{where}: {value!r} !~ {schema['pattern']}"
    if _TYPES["number"](value):
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{where}: {value} out of range"


def _matches(doc: dict, schema: dict, value: object) -> bool:
    try:
        conforms(doc, schema, value)
    except AssertionError:
        return False
    return True


async def test_responses_match_the_documented_schemas(tmp_path):
    async with open_ctx(tmp_path, ready=False) as ctx, rest_client(ctx) as client:
        doc = await (await client.get("/openapi.json")).json()
        keys = await put_tokens(ctx.store, tokens_for(12))
        await put_tokens(ctx.store, tokens_for(1, seed=1), OTHER)
        ctx.store.disk.delete_many([make_key(NS.ns_id, keys[0])])  # check reports a missing record
        block = f"/v1/blocks/{NS_HEX}/{keys[1].hex()}"
        calls = [
            ("get", "/v1/health", "/v1/health", {}), ("get", "/v1/ready", "/v1/ready", {}),
            ("get", "/v1/stats", "/v1/stats", {}), ("get", "/v1/tiers", "/v1/tiers", {}),
            ("get", "/v1/namespaces", "/v1/namespaces", {}), ("get", "/v1/blocks", "/v1/blocks?limit=5", {}),
            ("get", "/v1/blocks", "/v1/blocks?tier=tape", {}),
            ("get", "/v1/blocks/{ns}/{hash}", block, {}), ("get", "/v1/blocks/{ns}/{hash}", block[:-2] + "00", {}),
            ("post", "/v1/lookup", "/v1/lookup", {"json": {"ns": NS_HEX, "token_ids": tokens_for(12)}}),
            ("post", "/v1/lookup", "/v1/lookup", {"json": {"ns": OTHER.ns_id.hex(), "token_ids": [1]}}),
            ("post", "/v1/check", "/v1/check", {"json": {"fix": False}, "headers": AUTH}),
            ("post", "/v1/check", "/v1/check", {"json": {"fix": False}}),
            ("delete", "/v1/blocks/{ns}/{hash}", block, {"headers": AUTH}),
            ("delete", "/v1/blocks/{ns}/{hash}", block, {"headers": AUTH}),
            ("post", "/v1/clear", "/v1/clear", {"json": {"ns": NS_HEX}, "headers": AUTH}),
            ("get", "/openapi.json", "/openapi.json", {}),
        ]
        seen = set()
        for method, template, url, kwargs in calls:
            resp = await getattr(client, method)(url, **kwargs)
            answer = doc["paths"][template][method]["responses"][str(resp.status)]
            if "$ref" in answer:
                answer = _resolve(doc, answer["$ref"])
            conforms(doc, answer["content"]["application/json"]["schema"], await resp.json(), f"{method} {url}")
            seen.add((method, resp.status))
        assert {("get", 503), ("get", 400), ("get", 404), ("post", 401), ("delete", 404)} <= seen
        # the checker does reject what the document forbids
        assert not _matches(doc, {"$ref": "#/components/schemas/Block"}, {"ns": NS_HEX})
        assert not _matches(doc, {"$ref": "#/components/schemas/LookupRequest"}, {"ns": "zz", "token_ids": [-1]})
