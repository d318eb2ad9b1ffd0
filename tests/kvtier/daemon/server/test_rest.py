"""REST API on a real store: every endpoint, pagination, errors as JSON, auth, SSE, metrics.

The OpenAPI document is tested in test_openapi.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import random
import re
from urllib.parse import quote

from prometheus_client.parser import text_string_to_metric_families

from kvtier.daemon.server.rest import MAX_BODY_BYTES
from kvtier.daemon.server.rest_views import MAX_LOOKUP_TOKENS
from kvtier.daemon.store.types import Tier, make_key
from tests.kvtier.daemon.server.restkit import (AUTH, NS, NS_HEX, OTHER, SALT, TOKEN, open_ctx, put_tokens, rest_client,
                                         tokens_for)


async def error_of(resp, status: int) -> str:
    """Assert a JSON error body with ``status``; returns its code."""
    assert resp.status == status, await resp.text()
    body = await resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"} and body["error"]["message"]
    return body["error"]["code"]


async def test_health_and_ready(tmp_path):
    async with open_ctx(tmp_path, ready=False) as ctx, rest_client(ctx) as client:
        health = await (await client.get("/v1/health")).json()
        assert health["status"] == "ok" and health["version"] == ctx.version and health["uptime_s"] >= 0
        assert await error_of(await client.get("/v1/ready"), 503) == "unavailable"
        ctx.ready = True
        resp = await client.get("/v1/ready")
        assert resp.status == 200 and await resp.json() == {"ready": True}


async def test_stats_and_tiers(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        await put_tokens(ctx.store, tokens_for(12))  # 8 fit in host memory, 4 are demoted to disk
        stats = await (await client.get("/v1/stats")).json()
        assert stats["counters"]["commits"] == 12 and stats["counters"]["demotions"] == 4
        assert stats["counters"]["tiers"]["host"]["evictions"] == 4
        assert stats["gauges"]["blocks"] == 12 and stats["gauges"]["tiers"]["disk"]["blocks"] == 4
        tiers = (await (await client.get("/v1/tiers")).json())["tiers"]
        assert [t["tier"] for t in tiers] == ["gpu", "host", "disk"]
        gpu, host, disk = tiers
        assert not gpu["enabled"] and gpu["fragmentation"] is None and disk["fragmentation"] is None
        assert host["enabled"] and host["blocks"] == 8 and 0 <= host["fragmentation"] < 1
        assert host["free_bytes"] == host["capacity_bytes"] - host["used_bytes"]
        assert disk["blocks"] == 4 and disk["bytes_in"] > 0 and disk["medium"] == "STORAGE"
        # the default: every tier exact (issue 25)
        assert gpu["precision"] is None and host["precision"] is None
        assert disk["precision"] == {"codec": "raw", "k_axis": "channel", "compression": "none", "models": []}


async def test_tiers_say_what_a_lossy_disk_tier_stores(tmp_path):
    async with open_ctx(tmp_path, disk_codec="int8", disk_k_axis="token", disk_compression="lz4",
                        disk_models={"meta-llama/*": "raw", "*-draft": "int4"}) as ctx, rest_client(ctx) as client:
        disk = (await (await client.get("/v1/tiers")).json())["tiers"][2]
        assert disk["tier"] == "disk" and disk["precision"] == {
            "codec": "int8", "k_axis": "token", "compression": "lz4",
            "models": [{"pattern": "meta-llama/*", "codec": "raw"}, {"pattern": "*-draft", "codec": "int4"}]}


async def test_namespaces_redact_the_salt(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        await put_tokens(ctx.store, tokens_for(3))
        await put_tokens(ctx.store, tokens_for(2, seed=1), OTHER)
        resp = await client.get("/v1/namespaces")
        assert SALT not in await resp.text()
        spaces = {n["ns_id"]: n for n in (await resp.json())["namespaces"]}
        mine, other = spaces[NS_HEX], spaces[OTHER.ns_id.hex()]
        assert mine["registered"] and mine["blocks"] == 3
        assert mine["fields"]["model"] == "test/model" and mine["fields"]["salted"] is True
        assert "tenant_salt" not in mine["fields"]
        assert other == {"ns_id": OTHER.ns_id.hex(), "registered": False, "blocks": 2}


async def walk(client, query: str = "", limit: int = 4) -> list[dict]:
    out, cursor = [], None
    while True:
        url = f"/v1/blocks?limit={limit}{query}" + (f"&cursor={cursor}" if cursor else "")
        page = await (await client.get(url)).json()
        assert len(page["blocks"]) <= limit
        out += page["blocks"]
        cursor = page["next_cursor"]
        if cursor is None:
            return out


async def test_blocks_pagination_covers_every_block_once(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        mine = await put_tokens(ctx.store, tokens_for(12))
        other = await put_tokens(ctx.store, tokens_for(3, seed=1), OTHER)
        every = [(b["ns"], b["hash"]) for b in await walk(client)]
        expected = sorted([(NS_HEX, k.hex()) for k in mine] + [(OTHER.ns_id.hex(), k.hex()) for k in other])
        assert every == expected  # each block once, in key order
        assert [b["hash"] for b in await walk(client, f"&ns={NS_HEX}", limit=5)] == sorted(k.hex() for k in mine)
        for tier, count in (("host", 8), ("disk", 7)):  # 4 + 3 blocks were demoted (host holds 8)
            listed = await walk(client, f"&tier={tier}", limit=3)
            assert len(listed) == count and all(tier in b["tiers"] for b in listed)
        assert await walk(client, "&tier=gpu") == []
        page = await (await client.get("/v1/blocks")).json()
        assert len(page["blocks"]) == 15 and page["next_cursor"] is None
        b = page["blocks"][0]
        assert set(b) == {"ns", "hash", "parent", "num_tokens", "size", "tiers", "priority", "hits", "leases",
                          "idle_s"}


async def test_pagination_survives_deletes_between_pages(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        keys = sorted(await put_tokens(ctx.store, tokens_for(10)))
        first = await (await client.get("/v1/blocks?limit=3")).json()
        assert [b["hash"] for b in first["blocks"]] == [k.hex() for k in keys[:3]]
        await ctx.store.delete(NS.ns_id, [keys[1], keys[6]])  # one already seen, one not yet
        rest, cursor = [], first["next_cursor"]
        while cursor:
            page = await (await client.get(f"/v1/blocks?limit=3&cursor={cursor}")).json()
            rest += [b["hash"] for b in page["blocks"]]
            cursor = page["next_cursor"]
        assert rest == [k.hex() for k in keys[3:] if k != keys[6]]


async def test_block_detail(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        keys = await put_tokens(ctx.store, tokens_for(2))
        resp = await client.get(f"/v1/blocks/{NS_HEX}/{keys[1].hex().upper()}")  # either case is accepted
        assert SALT not in await resp.text()
        info = await resp.json()
        assert info["hash"] == keys[1].hex() and info["parent"] == keys[0].hex()
        assert info["tiers"] == ["host"] and info["size"] == 4096 and info["hits"] == 0
        assert 4 <= info["age_s"] < 60  # the test headers are stamped 5 s in the past
        h = info["header"]
        assert h["chain_hash"] == keys[1].hex() and h["parent_hash"] == keys[0].hex()
        assert h["shape"] == [1, 2, 1, 16, 64] and h["dtype"] == "float16" and h["codec"] == "raw"
        assert h["sections"] == [{"name": "payload", "offset": 0, "length": 4096}]
        assert h["lossy"] is False and h["compression"] is None
        assert re.fullmatch(r"[0-9a-f]{16}", h["checksum"]) and h["checksum_alg"] == "xxh3-64"
        assert h["ns_fields"]["salted"] is True and "tenant_salt" not in h["ns_fields"]


async def test_block_detail_shows_the_compression_stage(tmp_path):
    import torch

    from kvtier_protocol.block import encode_block
    from kvtier_protocol.header import split_record

    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        (key,) = NS.block_keys(tokens_for(1))
        block = torch.zeros(NS.num_layers, 2, NS.num_kv_heads, NS.block_tokens, NS.head_dim, dtype=torch.float16)
        record = encode_block(block, ns_id=NS.ns_id, chain_hash=key, parent_hash=None, layout="canonical",
                              ns_fields=NS.to_wire(), compression="lz4")
        h, payload = split_record(record)
        res = await ctx.store.reserve(NS.ns_id, [key], [len(payload)])
        ctx.store.host.view(res.slots[0])[:] = payload
        assert await ctx.store.commit(res.lease_id, [bytes(record[:len(record) - len(payload)])]) == [True]
        info = await (await client.get(f"/v1/blocks/{NS_HEX}/{key.hex()}")).json()
        shown = info["header"]
        assert shown["codec"] == "raw" and shown["lossy"] is False
        assert shown["compression"]["alg"] == "lz4" and len(payload) < 4096
        assert [s["raw_len"] for s in shown["compression"]["sections"]] == [4096]


async def test_lookup_by_token_ids(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        tokens = tokens_for(12)
        await put_tokens(ctx.store, tokens)
        resp = await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": tokens + [7, 8, 9]})
        found = await resp.json()
        assert found["hit_tokens"] == 192 and found["num_tokens"] == 195 and found["num_blocks"] == 12
        assert found["per_tier"] == {"disk": 64, "host": 128}  # the fastest tier of each block
        diverged = tokens[:40] + [1] * 40
        found = await (await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": diverged})).json()
        assert found["hit_tokens"] == 32 and found["hit_blocks"] == 2 and found["num_blocks"] == 5
        found = await (await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": []})).json()
        assert found["hit_tokens"] == 0 and found["per_tier"] == {}
        exact = await (await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": tokens,
                                                             "accept_lossy": False})).json()
        assert exact["hit_tokens"] == 192, "raw copies are exact copies"
        resp = await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": tokens, "accept_lossy": "no"})
        assert await error_of(resp, 400) == "invalid_request"
        body = (await (await client.get("/metrics")).read()).decode()
        values = {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples if not s.labels}
        assert values["kvtier_lookup_hit_tokens_total"] == 192 + 32 + 192
        assert values["kvtier_lookup_miss_tokens_total"] == 3 + 48


async def test_malformed_input_gets_json_4xx(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        h = "ab" * 32
        assert await error_of(await client.post("/v1/lookup", data=b"{not json"), 400) == "invalid_request"
        assert await error_of(await client.post("/v1/lookup", data=b"[1, 2]"), 400) == "invalid_request"
        assert await error_of(await client.post("/v1/lookup", data=b'{"ns": NaN}'), 400) == "invalid_request"
        assert await error_of(await client.post("/v1/lookup", json={"ns": "zz", "token_ids": []}), 400) == "invalid_key"
        bad_tokens = {"ns": NS_HEX, "token_ids": [1, -2]}
        assert await error_of(await client.post("/v1/lookup", json=bad_tokens), 400) == "invalid_request"
        assert await error_of(await client.post("/v1/lookup", json={"ns": NS_HEX, "token_ids": [True]}),
                              400) == "invalid_request"
        unknown = {"ns": OTHER.ns_id.hex(), "token_ids": [1, 2]}
        assert await error_of(await client.post("/v1/lookup", json=unknown), 404) == "not_found"
        assert await error_of(await client.get(f"/v1/blocks/{NS_HEX[:-1]}g/{h}"), 400) == "invalid_key"
        assert await error_of(await client.get(f"/v1/blocks/{NS_HEX}/abc"), 400) == "invalid_key"  # prefix < 4
        assert await error_of(await client.get(f"/v1/blocks/{NS_HEX}/{h}ab"), 400) == "invalid_key"  # too long
        assert await error_of(await client.get(f"/v1/blocks/{NS_HEX}/{h}"), 404) == "not_found"
        assert await error_of(await client.get("/v1/blocks?tier=tape"), 400) == "invalid_request"
        assert await error_of(await client.get("/v1/blocks?limit=0"), 400) == "invalid_request"
        assert await error_of(await client.get("/v1/blocks?limit=x"), 400) == "invalid_request"
        assert await error_of(await client.get("/v1/blocks?limit=%C2%B2"), 400) == "invalid_request"  # a Unicode digit
        assert await error_of(await client.get("/v1/blocks?cursor=AAAA"), 400) == "invalid_request"
        assert await error_of(await client.get("/v1/blocks?ns=12"), 400) == "invalid_key"
        assert await error_of(await client.get("/v1/nothing"), 404) == "not_found"
        resp = await client.put("/v1/health")
        assert await error_of(resp, 405) == "method_not_allowed" and "GET" in resp.headers["Allow"]
        assert await error_of(await client.post("/v1/check", json={"fix": "yes"}, headers=AUTH),
                              400) == "invalid_request"


async def test_junk_never_gets_a_500(tmp_path):
    rng = random.Random(7)
    values = [None, True, 1, -1, 1.5, 2**70, "", "x", NS_HEX, NS_HEX.upper(), "00" * 16, "ab" * 32, [], {}, [1.5],
              [2**40], [True], [1, 2, 3], ["1"], {"a": 1}]
    quoted = [quote(t, safe="") for t in ("..", "%00", "\u00e9", "a" * 300, "ab" * 32, NS_HEX, "g" * 32, "", " ")]
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        await put_tokens(ctx.store, tokens_for(2))
        for _ in range(60):
            body = {k: rng.choice(values) for k in rng.sample(["ns", "token_ids", "fix", "extra"], rng.randrange(4))}
            for url in ("/v1/lookup", "/v1/clear", "/v1/check"):
                resp = await client.post(url, json=body, headers=AUTH)
                assert resp.status < 500, (url, body, await resp.text())
            raw = rng.randbytes(rng.randrange(40))
            assert (await client.post("/v1/lookup", data=raw)).status == 400
            path = f"/v1/blocks/{rng.choice(quoted) or 'x'}/{rng.choice(quoted) or 'y'}"
            for method in ("get", "delete"):
                resp = await getattr(client, method)(path, headers=AUTH)
                assert resp.status in (400, 404), (path, await resp.text())
                assert (await resp.json())["error"]["code"]
            query = "&".join(f"{k}={rng.choice(quoted)}" for k in rng.sample(["ns", "tier", "limit", "cursor"], 2))
            assert (await client.get(f"/v1/blocks?{query}")).status in (200, 400)


async def test_size_limits(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        too_many = b'{"ns": "%s", "token_ids": [%s]}' % (NS_HEX.encode(), b",".join([b"1"] * (MAX_LOOKUP_TOKENS + 1)))
        assert len(too_many) < MAX_BODY_BYTES  # refused for its count, not its size
        assert await error_of(await client.post("/v1/lookup", data=io.BytesIO(too_many)), 413) == "limit_exceeded"
        huge = b'{"pad": "' + b"x" * MAX_BODY_BYTES + b'"}'
        assert await error_of(await client.post("/v1/lookup", data=io.BytesIO(huge)), 413) == "limit_exceeded"


async def test_mutations_need_the_token(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        keys = await put_tokens(ctx.store, tokens_for(3))
        url = f"/v1/blocks/{NS_HEX}/{keys[0].hex()}"
        resp = await client.delete(url)
        assert await error_of(resp, 401) == "unauthorized" and resp.headers["WWW-Authenticate"].startswith("Bearer")
        assert await error_of(await client.delete(url, headers={"Authorization": "Bearer nope"}), 401) == "unauthorized"
        assert await error_of(await client.delete(url, headers={"Authorization": TOKEN}), 401) == "unauthorized"
        assert await error_of(await client.post("/v1/clear", json={"ns": NS_HEX}), 401) == "unauthorized"
        assert await error_of(await client.post("/v1/check", json={}), 401) == "unauthorized"
        assert ctx.store.info(NS.ns_id, keys[0]) is not None  # nothing changed
        resp = await client.delete(url, headers=AUTH)
        assert resp.status == 200 and await resp.json() == {"deleted": 1}
        assert await error_of(await client.delete(url, headers=AUTH), 404) == "not_found"
        resp = await client.post("/v1/clear", json={"ns": NS_HEX}, headers=AUTH)
        assert await resp.json() == {"cleared": 2}
        assert (await (await client.get("/v1/blocks")).json())["blocks"] == []
        body = await (await client.get("/metrics")).text()
        assert TOKEN not in body
        assert 'kvtier_requests_total{op="rest_delete_block",status="unauthorized"} 3.0' in body
        assert 'kvtier_deletes_total{tenant=""} 3.0' in body


async def test_without_a_configured_token_mutations_are_open(tmp_path):
    async with open_ctx(tmp_path, token=None) as ctx, rest_client(ctx) as client:
        await put_tokens(ctx.store, tokens_for(2))
        assert await (await client.post("/v1/clear", json={"ns": NS_HEX})).json() == {"cleared": 2}


async def test_check_reports_and_repairs(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        keys = await put_tokens(ctx.store, tokens_for(12))
        report = await (await client.post("/v1/check", headers=AUTH)).json()  # no body: fix = false
        assert report["ok"] and not report["fixed"] and report["counts"]["missing"] == 0
        assert ctx.store.info(NS.ns_id, keys[0]).tiers == [Tier.DISK]  # the oldest blocks were demoted
        ctx.store.disk.delete_many([make_key(NS.ns_id, keys[0])])  # lose a disk-only record behind the index
        report = await (await client.post("/v1/check", json={"fix": False}, headers=AUTH)).json()
        assert not report["ok"] and report["counts"]["missing"] == 1
        assert report["missing"] == [{"ns": NS_HEX, "hash": keys[0].hex()}]
        report = await (await client.post("/v1/check", json={"fix": True}, headers=AUTH)).json()
        assert report["fixed"] and report["counts"]["missing"] == 1
        assert (await (await client.post("/v1/check", json={"fix": False}, headers=AUTH)).json())["ok"]


async def test_internal_errors_are_generic_json(tmp_path, monkeypatch, caplog):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        def broken() -> None:
            raise RuntimeError("secret internal detail")

        monkeypatch.setattr(ctx.store, "gauges", broken)  # fault injection: the store fails unexpectedly
        with caplog.at_level(logging.ERROR):
            resp = await client.get("/v1/tiers")
            assert await error_of(resp, 500) == "internal"
        assert "secret internal detail" not in await resp.text()
        assert any("secret internal detail" in r.exc_text for r in caplog.records if r.exc_text)


async def read_sse(resp, *, data: int = 0, comment: str | None = None) -> tuple[list[dict], list[str]]:
    """Read until ``data`` events arrived and (if given) a comment starting with ``comment``."""
    events, comments = [], []
    async with asyncio.timeout(5):
        while len(events) < data or (comment is not None and not any(c.startswith(comment) for c in comments)):
            line = (await resp.content.readline()).decode().rstrip("\n")
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
            elif line.startswith(":"):
                comments.append(line)
    return events, comments


async def test_events_stream_and_unsubscribe_on_disconnect(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx, heartbeat_s=0.05) as client:
        resp = await client.get("/v1/events")
        assert resp.status == 200 and resp.headers["Content-Type"].startswith("text/event-stream")
        await read_sse(resp, comment=": kvtier events")  # written once subscribed
        assert ctx.events.num_subscribers == 1
        keys = await put_tokens(ctx.store, tokens_for(2))
        assert ctx.events.publish(ctx.store.take_events(), {NS.ns_id: NS}) > 0
        events, _ = await read_sse(resp, data=2)
        assert [e["chain_hash"] for e in events] == [k.hex() for k in keys]
        assert all(e["ns"] == NS_HEX and e["tier"] == "host" and e["type"] == "BlockStored" for e in events)
        await read_sse(resp, comment=": heartbeat")
        resp.close()  # the client goes away: the server notices at its next write and unsubscribes
        async with asyncio.timeout(5):
            while ctx.events.num_subscribers:
                await asyncio.sleep(0.02)


async def test_shutdown_ends_event_streams(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:  # 15 s heartbeat: only shutdown ends it
        resp = await client.get("/v1/events")
        await resp.content.readline()
        async with asyncio.timeout(5):
            await client.app.shutdown()
            assert await resp.content.read() in (b"\n", b"")  # the stream ends
        assert ctx.events.num_subscribers == 0


async def test_metrics_endpoint_parses_and_moves(tmp_path):
    async with open_ctx(tmp_path) as ctx, rest_client(ctx) as client:
        def scrape(body: str) -> dict:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for f in text_string_to_metric_families(body) for s in f.samples}

        resp = await client.get("/metrics")
        assert resp.headers["Content-Type"].startswith("text/plain")
        before = scrape(await resp.text())
        await put_tokens(ctx.store, tokens_for(3))
        await client.get("/v1/stats")
        after = scrape(await (await client.get("/metrics")).text())
        default = (("tenant", ""),)  # the default store's label (no tenants here)
        assert after[("kvtier_commits_total", default)] == before[("kvtier_commits_total", default)] + 3
        assert after[("kvtier_tier_blocks", (("tenant", ""), ("tier", "host")))] == 3
        assert after[("kvtier_requests_total", (("op", "rest_metrics"), ("status", "ok")))] == 1
        assert after[("kvtier_requests_total", (("op", "rest_stats"), ("status", "ok")))] == 1
        assert after[("kvtier_request_duration_seconds_count", (("op", "rest_stats"),))] == 1
