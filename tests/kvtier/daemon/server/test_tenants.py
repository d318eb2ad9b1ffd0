"""Tenant isolation, end to end: a real ``kvtier serve`` with two tenants configured in a TOML file.

Tenant B (bob, token B) must neither read, probe, list, watch, delete nor evict tenant A's (alice's)
blocks, through any door: the unix socket (shared memory and its descriptors), TCP, REST, SSE,
ZMQ. The admin token sees both in REST; no token appears in the log, a REST body or /metrics.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import re
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvtier_protocol.events import BlockStored, decode_batch
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from kvtier_protocol.keys import event_hash
from kvtier_protocol.namespace import Namespace

from kvtier.client import Client
from kvtier.commands.admin import register
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.daemon.server.planekit import RawClient
from tests.kvtier.waitkit import PATIENCE_S, wait_until

TOKEN_A, TOKEN_B = (f"{who}-{secrets.token_urlsafe(24)}" for who in ("alice", "bob"))
MARKER = secrets.token_bytes(64)  # in every payload of A: must never be readable by B
BLOCK_BYTES = 4096  # [1 layer, 2, 1 head, 16 tokens, 64] float16


def namespace(salt: str, model: str = "tenants/model") -> Namespace:
    return Namespace(model=model, revision="r1", attention="mha", num_layers=1, num_kv_heads=1, head_dim=64,
                     kv_dtype="float16", block_tokens=16, hash_tokens=16, tenant_salt=salt)


NS_A, NS_B = namespace("salt-of-alice"), namespace("salt-of-bob")


def records(ns: Namespace, n: int, seed: int, marker: bytes = b"") -> list[tuple[bytes, bytes, list[int]]]:
    """``n`` chained blocks of ``ns``: ``(chain hash, record, token ids)``; ``marker`` opens each payload."""
    rng = random.Random(seed)
    tokens = [rng.randrange(50_000) for _ in range(n * ns.block_tokens)]
    out, parent = [], None
    for i, key in enumerate(ns.block_keys(tokens)):
        payload = marker + rng.randbytes(BLOCK_BYTES - len(marker))
        h = BlockHeader(ns_id=ns.ns_id, chain_hash=key, parent_hash=parent, num_tokens=16, layout="canonical",
                        shape=(1, 2, 1, 16, 64), dtype="float16", codec="raw",
                        sections=(Section("payload", 0, BLOCK_BYTES),), payload_len=BLOCK_BYTES,
                        checksum=payload_checksum(payload), ns_fields=ns.to_wire())
        out.append((key, encode_header(h) + payload, tokens[i * 16:(i + 1) * 16]))
        parent = key
    return out


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierDaemon]:
    tmp = tmp_path_factory.mktemp("tenants")
    toml = tmp / "kvtier.toml"
    toml.write_text(f'''
[events]
endpoint = "tcp://127.0.0.1:*"
[tenants.alice]
host_bytes = "1MiB"
disk_bytes = "4MiB"
token = "{TOKEN_A}"
events_endpoint = "tcp://127.0.0.1:*"
[tenants.bob]
host_bytes = "256KiB"
disk_bytes = 0
token = "{TOKEN_B}"
''')
    d = KvtierDaemon(tmp, extra_args=("--config", str(toml), "--rest", "127.0.0.1:0", "--listen", "127.0.0.1:0"))
    try:
        d.start()
        yield d
    finally:
        d.cleanup()


@pytest.fixture(scope="module")
def rest(daemon: KvtierDaemon) -> str:
    return re.findall(r"kvtierd rest (\S+)", daemon.log())[-1]


@pytest.fixture(scope="module")
def saved_a(daemon: KvtierDaemon) -> list[tuple[bytes, bytes, list[int]]]:
    """A's blocks, saved over shared memory with A's token (A's own SSE/ZMQ tests add more)."""
    recs = records(NS_A, 8, seed=1, marker=MARKER)
    with Client(daemon.address, token=TOKEN_A) as a:
        assert a.save(NS_A.ns_id, [(k, r) for k, r, _ in recs], tokens=[t for _, _, t in recs]) == ["stored"] * 8
    return recs


BODIES: list[str] = []  # every REST body the tests read, checked for tokens at the end


def http(base: str, method: str, path: str, token: str | None = None, body: Any = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={**headers, "Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    BODIES.append(raw.decode())
    return status, json.loads(raw)


def hello(daemon: KvtierDaemon, token: str | None, tenant: str | None = None) -> tuple[dict, list[int], RawClient]:
    raw = RawClient.connect(f"unix:{daemon.socket}")
    header: dict[str, Any] = {"op": "hello", "version": 1, "client": "tenants-test"}
    if tenant is not None:
        header["tenant"] = tenant
    if token is not None:
        header["token"] = token
    raw.send(header)
    data, fds, _, _ = socket.recv_fds(raw.sock, 1 << 16, 64)
    raw.frames.extend(raw.decoder.feed(data))
    frame = raw.recv()
    assert frame is not None
    return frame.header, fds, raw


def mapped_bytes(fds: list[int], sizes: list[int]) -> bytes:
    out = []
    for fd, size in zip(fds, sizes):
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as mm:
            out.append(mm[:])
    return b"".join(out)


# --- data plane ---------------------------------------------------------------------------------


def test_each_hello_receives_only_its_own_segments(daemon: KvtierDaemon, saved_a: list) -> None:
    inodes: dict[str, set[int]] = {}
    for who, token in (("alice", TOKEN_A), ("bob", TOKEN_B), ("default", None)):
        header, fds, raw = hello(daemon, token)
        try:
            assert header["ok"] and header["fds"] == len(fds) == len(header["segments"]) > 0
            names = [s["name"] for s in header["segments"]]
            tag = f"{daemon.prefix}-t-{who}-" if who != "default" else f"{daemon.prefix}-{daemon.process.pid}-"
            assert all(n.startswith(tag) for n in names), names
            inodes[who] = {os.fstat(fd).st_ino for fd in fds}
            assert inodes[who] == {os.stat(f"/dev/shm/{n}").st_ino for n in names}
            data = mapped_bytes(fds, [s["size"] for s in header["segments"]])
            # Mapping everything this client received shows A's payload bytes only to A.
            assert (MARKER in data) == (who == "alice")
        finally:
            for fd in fds:
                os.close(fd)
            raw.close()
    assert not inodes["alice"] & inodes["bob"] and not inodes["alice"] & inodes["default"]
    assert not inodes["bob"] & inodes["default"]


@pytest.mark.parametrize("token, tenant", [
    (TOKEN_B, "alice"),  # B's token claiming A
    (None, "alice"),  # no token claiming A
    (TOKEN_A, "carol"),  # a tenant that does not exist: the same answer, no probing
    ("not-a-token-0123456789", None),  # a wrong token
], ids=["b-claims-a", "none-claims-a", "a-claims-unknown", "wrong-token"])
def test_hello_claiming_what_the_token_does_not_allow_is_refused(daemon: KvtierDaemon, token: str | None,
                                                                 tenant: str | None) -> None:
    header, fds, raw = hello(daemon, token, tenant)
    raw.close()
    assert not fds and not header["ok"] and header["err"]["code"] == "unauthorized"


def test_tcp_needs_a_valid_token(daemon: KvtierDaemon) -> None:
    for token in (None, "wrong-token-0123456789"):
        raw = RawClient.connect(daemon.tcp_address().replace("tcp://", "tcp:"))
        frame, _ = raw.hello(token)
        raw.close()
        assert frame.header["err"]["code"] == "unauthorized"


def test_b_can_neither_read_probe_nor_remove_a_blocks(daemon: KvtierDaemon, saved_a: list) -> None:
    keys = [k for k, _, _ in saved_a]
    for address in (daemon.address, daemon.tcp_address()):
        with Client(address, token=TOKEN_B) as b:
            assert b.lookup(NS_A.ns_id, keys, degrade=False).num_hits == 0
            assert b.load(NS_A.ns_id, keys, degrade=False) == []
            assert b.delete(NS_A.ns_id, keys) == 0
            assert b.clear(NS_A.ns_id) == 0
    with Client(daemon.address) as anonymous:  # the default store holds none of them either
        assert anonymous.lookup(NS_A.ns_id, keys, degrade=False).num_hits == 0
    with Client(daemon.address, token=TOKEN_A) as a:
        assert a.load(NS_A.ns_id, keys, degrade=False) == [r for _, r, _ in saved_a]


def test_b_filling_its_own_pool_evicts_none_of_a(daemon: KvtierDaemon, saved_a: list) -> None:
    flood = records(NS_B, 200, seed=2)  # 800 KiB into B's 256 KiB host tier, no disk: B evicts B
    with Client(daemon.address, token=TOKEN_B) as b:
        for i in range(0, len(flood), 25):
            b.save(NS_B.ns_id, [(k, r) for k, r, _ in flood[i:i + 25]])
        assert b.lookup(NS_B.ns_id, [k for k, _, _ in flood]).num_hits < len(flood)  # B's pool did overflow
    with Client(daemon.address, token=TOKEN_A) as a:
        keys = [k for k, _, _ in saved_a]
        assert a.lookup(NS_A.ns_id, keys).num_hits == len(keys)
        assert a.load(NS_A.ns_id, keys) == [r for _, r, _ in saved_a]


# --- REST ---------------------------------------------------------------------------------------


def test_rest_scopes_every_store_route_to_the_token(daemon: KvtierDaemon, rest: str, saved_a: list) -> None:
    key = saved_a[0][0].hex()
    ns_a = NS_A.ns_id.hex()
    block = f"/v1/blocks/{ns_a}/{key}"
    # B sees nothing of A: listing, block view, namespaces, lookup, another tenant's name.
    status, page = http(rest, "GET", "/v1/blocks?limit=1000", TOKEN_B)
    assert status == 200 and all(b["ns"] != ns_a for b in page["blocks"])
    assert http(rest, "GET", block, TOKEN_B)[0] == 404
    assert ns_a not in {n["ns_id"] for n in http(rest, "GET", "/v1/namespaces", TOKEN_B)[1]["namespaces"]}
    assert http(rest, "GET", "/v1/stats", TOKEN_B)[1]["tenant"] == "bob"
    assert http(rest, "POST", "/v1/lookup", TOKEN_B, {"ns": ns_a, "token_ids": saved_a[0][2]})[0] == 404
    for path in ("/v1/blocks?tenant=alice", "/v1/stats?tenant=alice", f"{block}?tenant=alice",
                 "/v1/blocks?tenant=carol"):
        assert http(rest, "GET", path, TOKEN_B)[0] == 404
    # ... nor removes anything of A.
    assert http(rest, "DELETE", block, TOKEN_B)[0] == 404
    assert http(rest, "POST", "/v1/clear", TOKEN_B, {"ns": ns_a}) == (200, {"cleared": 0})
    assert http(rest, "POST", "/v1/clear?tenant=alice", TOKEN_B, {"ns": ns_a})[0] == 404
    # Anonymous: no store at all (reads need a token unless rest.public_reads); wrong tokens: 401 everywhere.
    for path in ("/v1/blocks?limit=1000", block, "/v1/blocks?tenant=alice", "/v1/stats", "/v1/namespaces"):
        assert http(rest, "GET", path)[0] == 401
    for method, path in (("GET", "/v1/blocks"), ("GET", "/v1/stats"), ("GET", "/v1/tenants"), ("DELETE", block)):
        assert http(rest, method, path, "wrong-token-0123456789")[0] == 401
    # A and the admin see A's blocks.
    admin = daemon.token
    for token, path in ((TOKEN_A, block), (admin, f"{block}?tenant=alice")):
        status, info = http(rest, "GET", path, token)
        assert status == 200 and info["hash"] == key and "salt-of-alice" not in json.dumps(info)
    assert http(rest, "GET", block, admin)[0] == 404  # the admin's default: the default store
    listed = {b["hash"] for b in http(rest, "GET", "/v1/blocks?tenant=alice&limit=1000", admin)[1]["blocks"]}
    assert {k.hex() for k, _, _ in saved_a} <= listed
    hits = http(rest, "POST", "/v1/lookup", TOKEN_A, {"ns": ns_a, "token_ids": saved_a[0][2] + saved_a[1][2]})[1]
    assert hits["hit_blocks"] == 2
    assert [t["name"] for t in http(rest, "GET", "/v1/tenants", admin)[1]["tenants"]] == ["alice", "bob"]
    assert [t["name"] for t in http(rest, "GET", "/v1/tenants", TOKEN_B)[1]["tenants"]] == ["bob"]


def _sse(base: str, token: str, query: str, got: list[dict], stop: threading.Event,
         subscribed: threading.Event) -> None:
    req = urllib.request.Request(base + "/v1/events" + query, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=PATIENCE_S) as resp:
        while not stop.is_set():
            line = resp.readline()
            if line.startswith(b": kvtier events"):  # the daemon writes it once it has subscribed us
                subscribed.set()
            elif line.startswith(b"data: "):
                got.append(json.loads(line[6:]))


def _zmq_hashes(frames: list[bytes]) -> set[int]:
    return {h for e in decode_batch(frames[2]).events for h in e.block_hashes}


def _zmq_joined(sub: zmq.Socket, client: Client, ns: Namespace, seed: int) -> set[int]:
    """Save probe blocks of ``ns`` with ``client`` until ``sub`` has an event, and return the probes'
    event hashes. A PUB drops what it sends before a subscriber's subscription reaches it (ZMQ's
    slow joiner), and only a message received tells that it has."""
    probes: set[int] = set()
    deadline = time.monotonic() + PATIENCE_S
    while not sub.poll(100):
        assert time.monotonic() < deadline, "the subscription never reached the daemon's publisher"
        ((key, rec, tokens),) = records(ns, 1, seed=seed + len(probes))
        assert client.save(ns.ns_id, [(key, rec)], tokens=[tokens]) == ["stored"]
        probes.add(event_hash(key))
    return probes


def _zmq_until(sub: zmq.Socket, hashes: set[int]) -> list[list[bytes]]:
    """Every message ``sub`` receives until their events have named all of ``hashes``."""
    got: list[list[bytes]] = []
    seen: set[int] = set()
    deadline = time.monotonic() + PATIENCE_S
    while not hashes <= seen:
        left = deadline - time.monotonic()
        assert left > 0 and sub.poll(int(left * 1000)), f"{len(hashes - seen)} block events never came"
        got.append(sub.recv_multipart())
        seen |= _zmq_hashes(got[-1])
    return got


def test_events_reach_only_the_tenants_own_streams(daemon: KvtierDaemon, rest: str, saved_a: list) -> None:
    log = daemon.log()
    alice_pub = re.findall(r"kvtierd tenant alice events (\S+)", log)[-1]
    default_pub = re.findall(r"kvtierd events (\S+)", log)[-1]
    ctx = zmq.Context.instance()
    subs = {}
    for name, endpoint in (("alice", alice_pub), ("default", default_pub)):
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(endpoint)
        subs[name] = sub
    streams: dict[str, list[dict]] = {"bob": [], "alice-admin": []}
    stop = threading.Event()
    subscribed = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_sse, args=(rest, TOKEN_B, "", streams["bob"], stop, subscribed[0]),
                                daemon=True),
               threading.Thread(target=_sse, args=(rest, daemon.token, "?tenant=alice", streams["alice-admin"],
                                                   stop, subscribed[1]), daemon=True)]
    for t in threads:
        t.start()
    default_ns = namespace("salt-of-the-default-store", model="tenants/default")
    with Client(daemon.address, token=TOKEN_A) as a, Client(daemon.address, token=daemon.token) as admin:
        # ZMQ subscriptions: probes until each publisher has delivered one (alice's probes are
        # A's blocks too; the default store's are the admin's, in its own namespace).
        probes = {"alice": _zmq_joined(subs["alice"], a, NS_A, seed=100),
                  "default": _zmq_joined(subs["default"], admin, default_ns, seed=200)}
        for ev in subscribed:
            assert ev.wait(PATIENCE_S), "an SSE stream never opened"
        new_a, new_b = records(NS_A, 2, seed=3, marker=MARKER), records(NS_B, 1, seed=4)
        a.save(NS_A.ns_id, [(k, r) for k, r, _ in new_a], tokens=[t for _, _, t in new_a])
        with Client(daemon.address, token=TOKEN_B) as b:
            b.save(NS_B.ns_id, [(k, r) for k, r, _ in new_b])
        # Then one more block in the default store: its publisher sends in order, so once this
        # one's event has arrived, a tenant's event that went astray would have arrived before it.
        ((end_key, end_rec, end_tokens),) = records(default_ns, 1, seed=300)
        assert admin.save(default_ns.ns_id, [(end_key, end_rec)], tokens=[end_tokens]) == ["stored"]
    a_hashes = {k.hex() for k, _, _ in new_a}
    wait_until(lambda: streams["bob"] and a_hashes <= {e["chain_hash"] for e in streams["alice-admin"]},
               what="the SSE events of A's and B's saves")
    stop.set()
    assert streams["bob"] and all(e["ns"] == NS_B.ns_id.hex() for e in streams["bob"])
    zmq_got = {"alice": _zmq_until(subs["alice"], {event_hash(k) for k, _, _ in new_a}),
               "default": _zmq_until(subs["default"], {event_hash(end_key)})}
    for sub in subs.values():
        sub.close()
    assert zmq_got["alice"] and all(m[0].endswith(b"/alice") for m in zmq_got["alice"])
    stored = [e for m in zmq_got["alice"] for e in decode_batch(m[2]).events if isinstance(e, BlockStored)]
    assert {event_hash(k) for k, _, _ in new_a} <= {h for e in stored for h in e.block_hashes}
    # Tenants' events never reach the shared publisher: it sent the default store's blocks only.
    assert set().union(*map(_zmq_hashes, zmq_got["default"])) <= probes["default"] | {event_hash(end_key)}


# --- secrets ------------------------------------------------------------------------------------


def _metrics(rest: str, token: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(rest + "/metrics", headers=headers)
    return urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req).read().decode()


def test_metrics_show_tenants_only_to_their_tokens(daemon: KvtierDaemon, rest: str, saved_a: list) -> None:
    """Anonymous /metrics: the default store's series, no tenant name; the admin: all; a tenant: its own."""
    anonymous, admin, alice = _metrics(rest), _metrics(rest, daemon.token), _metrics(rest, TOKEN_A)
    assert "kvtier_blocks " in anonymous or 'kvtier_blocks{tenant=""}' in anonymous
    assert "alice" not in anonymous and "bob" not in anonymous
    assert 'kvtier_blocks{tenant="alice"}' in admin and 'kvtier_tier_blocks{tenant="bob",tier="host"}' in admin
    assert 'kvtier_blocks{tenant="alice"}' in alice and "bob" not in alice


def test_no_token_in_log_rest_or_metrics(daemon: KvtierDaemon, rest: str, saved_a: list) -> None:
    metrics = _metrics(rest, daemon.token)
    assert 'kvtier_blocks{tenant="alice"}' in metrics and 'kvtier_tier_blocks{tenant="bob",tier="host"}' in metrics
    for status, body in (http(rest, "GET", "/v1/stats", TOKEN_A), http(rest, "GET", "/v1/tenants", daemon.token)):
        assert status == 200
    texts = [daemon.log(), Path(daemon.log_path).read_text(errors="replace"), metrics, *BODIES]
    for secret in (TOKEN_A, TOKEN_B, daemon.token, "salt-of-alice", "salt-of-bob"):
        assert not any(secret in text for text in texts)


def test_admin_commands_take_a_tenant(daemon: KvtierDaemon, rest: str, saved_a: list, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    files = {}
    for who, token in (("admin", daemon.token), ("bob", TOKEN_B)):
        files[who] = tmp_path / f"{who}.token"
        files[who].write_text(token + "\n")
        files[who].chmod(0o600)

    def kvtier(*argv: str) -> tuple[int, str]:
        parser = argparse.ArgumentParser(prog="kvtier")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args([*argv, "--rest", rest])
        rc = args.func(args)
        out, err = capsys.readouterr()
        return rc, out + err

    rc, out = kvtier("ls", "--blocks", "--all", "--json", "--tenant", "alice", "--token-file", str(files["admin"]))
    assert rc == 0 and {k.hex() for k, _, _ in saved_a} <= {b["hash"] for b in json.loads(out)["blocks"]}
    rc, out = kvtier("ls", "--blocks", "--all", "--json", "--token-file", str(files["bob"]))  # B's own store
    assert rc == 0 and all(b["ns"] == NS_B.ns_id.hex() for b in json.loads(out)["blocks"])
    rc, out = kvtier("ls", "--blocks", "--tenant", "alice", "--token-file", str(files["bob"]))
    assert rc == 2 and "not_found" in out  # refused (HTTP 404): a user error
    rc, out = kvtier("clear", "--ns", NS_A.ns_id.hex(), "--token-file", str(files["bob"]))
    assert rc == 0 and "cleared 0 blocks" in out
    rc, out = kvtier("status", "--tenant", "alice", "--token-file", str(files["admin"]))
    assert rc == 0 and "host" in out
    assert all(t not in out for t in (TOKEN_A, TOKEN_B, daemon.token))
