"""The live daemon (a real ``kvtier serve`` process) fed garbage on its unix socket, its TCP data
plane and its REST port, all at once, while a well-behaved client keeps saving and loading: every
one of the client's calls succeeds with the right bytes, the daemon stays up, and its log holds
no traceback (no request reached an unhandled exception)."""

from __future__ import annotations

import http.client
import json
import random
import re
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.bench.fuzz.engine import next_input
from kvtier.bench.fuzz.targets import build_targets
from kvtier.client import Client
from kvtier_protocol import frames as fr

from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.daemon.server.planekit import NS, make_recs

GARBAGE_S = 6.0
REST_ROUTES = [("GET", "/v1/health"), ("GET", "/v1/stats"), ("GET", "/v1/blocks"), ("POST", "/v1/lookup"),
               ("POST", "/v1/clear"), ("POST", "/v1/check"), ("DELETE", "/v1/blocks/{ns}/{hash}"),
               ("GET", "/v1/blocks/{ns}/{hash}"), ("GET", "/metrics"), ("PUT", "/v1/lookup"), ("GET", "/nope")]


@pytest.fixture
def daemon(tmp_path: Path) -> KvtierDaemon:
    d = KvtierDaemon(tmp_path, host_bytes="64MiB", disk_bytes="64MiB",
                     extra_args=("--listen", "127.0.0.1:0", "--rest", "127.0.0.1:0"))
    try:
        yield d.start()
    finally:
        d.cleanup()


def rest_port(d: KvtierDaemon) -> int:
    found = re.findall(r"kvtierd rest http://127\.0\.0\.1:(\d+)", d.log())
    assert found, d.log()
    return int(found[-1])


class Garbage:
    """Threads that throw garbage at one endpoint until stopped; they count what they sent."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.sent: dict[str, int] = {}
        self.problems: list[str] = []
        self.threads: list[threading.Thread] = []

    def spawn(self, name: str, fn: Callable[[random.Random], None]) -> None:
        def loop() -> None:
            rng = random.Random(name)
            while not self.stop.is_set():
                try:
                    fn(rng)
                except OSError:
                    pass  # the daemon closing a garbage connection is the expected answer
                self.sent[name] = self.sent.get(name, 0) + 1
        t = threading.Thread(target=loop, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(10)


def stream_garbage(connect: Callable[[], socket.socket], frames_target, hello: bytes | None) -> Callable:
    """One connection: optionally a valid hello, then a fuzzed frame (random, mutated or
    structured) or a half frame; read the answer (an error frame, or the close)."""
    def once(rng: random.Random) -> None:
        with connect() as sock:
            sock.settimeout(2.0)
            if hello is not None and rng.random() < 0.5:
                sock.sendall(hello)
                sock.recv(1 << 16)
            data = next_input(frames_target, rng)
            if rng.random() < 0.2:
                data = data[:rng.randrange(len(data) + 1)]  # a half frame, then the close
            sock.sendall(data)
            if rng.random() < 0.7:
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(1 << 16):
                    pass
    return once


def rest_garbage(port: int, problems: list[str], body_target) -> Callable:
    def once(rng: random.Random) -> None:
        method, path = rng.choice(REST_ROUTES)
        path = path.format(ns=rng.choice([NS.ns_id.hex(), "zz", "ab" * 40]), hash=rng.choice(["cd" * 32, "x", ""]))
        if rng.random() < 0.3:
            path += rng.choice(["?limit=", "?limit=-1", "?tier=%ff", "?cursor=!!!", "?ns=abc", "?limit=99999"])
        body = next_input(body_target, rng)
        headers = {"Content-Type": "application/json"}
        if rng.random() < 0.5:
            headers["Authorization"] = rng.choice(["Bearer wrong-token-0123456789", "Bearer", "Basic x", "Bearer  "])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            text = resp.read()
        finally:
            conn.close()
        if resp.status >= 500 and resp.status != 503:
            problems.append(f"{method} {path} -> {resp.status} {text[:200]!r}")
        elif resp.status >= 400:
            err = json.loads(text)["error"]
            assert isinstance(err["code"], str) and isinstance(err["message"], str)
    return once


def raw_http_garbage(port: int) -> Callable:
    def once(rng: random.Random) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
            sock.sendall(rng.choice([b"GET / HTTP/1.1\r\n", b"\x00" * 64, b"POST /v1/lookup HTTP/1.1\r\nContent-Length: "
                                     b"99999999999\r\n\r\n{", rng.randbytes(200)]))
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(1 << 16):
                pass
    return once


@pytest.fixture
def targets() -> dict:
    built = {t.name: t for t in build_targets()}
    yield built
    for t in built.values():
        t.close()


def unexpected_tracebacks(log: str) -> list[str]:
    """Log records with a traceback, except aiohttp's own for malformed HTTP (fuzz-patch-rest.diff)."""
    records = re.split(r"\n(?=\d{4}-\d\d-\d\d )", log)
    return [r for r in records if "Traceback" in r and not (
        "ERROR aiohttp.server: Error handling request" in r and "BadHttpMessage" in r)]


def test_garbage_everywhere_while_a_client_works(daemon: KvtierDaemon, targets: dict) -> None:
    frames_target = targets["frames.decode_frame"]
    tcp = daemon.tcp_address().removeprefix("tcp://")
    host, _, port = tcp.rpartition(":")
    hello = fr.encode_frame_bytes({"op": "hello", "id": 1, "version": 1, "client": "garbage"})
    garbage = Garbage()
    garbage.spawn("unix", stream_garbage(lambda: _unix(str(daemon.socket)), frames_target, hello))
    garbage.spawn("tcp", stream_garbage(lambda: socket.create_connection((host, int(port))), frames_target, hello))
    garbage.spawn("rest", rest_garbage(rest_port(daemon), garbage.problems, targets["rest.body"]))
    garbage.spawn("http", raw_http_garbage(rest_port(daemon)))

    saved = loaded = 0
    try:
        with Client.connect(daemon.address, timeout_s=10.0) as client:
            deadline, seed = time.monotonic() + GARBAGE_S, 0
            while time.monotonic() < deadline:
                recs = make_recs(3, seed=1000 + seed)
                seed += 1
                keys = [r.chain_hash for r in recs]
                assert client.save(NS.ns_id, [(r.chain_hash, r.record) for r in recs]) == ["stored"] * 3
                assert client.lookup(NS.ns_id, keys, degrade=False).num_hits == 3
                assert client.load(NS.ns_id, keys, degrade=False) == [r.record for r in recs]
                saved, loaded = saved + 3, loaded + 3
    finally:
        garbage.join()
    assert daemon.process is not None and daemon.process.poll() is None, daemon.log()
    assert not garbage.problems, garbage.problems[:5]
    assert min(garbage.sent.values()) >= 5, garbage.sent
    assert saved >= 9, "the well-behaved client made progress under the garbage"
    with Client.connect(daemon.address) as client:  # still serving afterwards
        assert client.ping() < 1.0
    log = daemon._log_since(0)
    assert not unexpected_tracebacks(log), unexpected_tracebacks(log)[:3]
    assert "internal error" not in log


def test_malformed_http_is_one_quiet_line(daemon: KvtierDaemon) -> None:
    port = rest_port(daemon)
    for request in (b"GET / HTTP/1.1\r\n\r\n", b"\x00\x01 garbage\r\n\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(request)
            assert sock.recv(1 << 16).split(b" ")[1] == b"400"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # the daemon logs before answering this
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(1 << 16).split(b" ")[1] == b"200"
    log = daemon._log_since(0)
    assert "Traceback" not in log and "ERROR aiohttp" not in log, log[-2000:]


def _unix(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        raise
    return sock
