"""What an unauthenticated client can make a live daemon (a real ``kvtier serve`` process) spend:
no memory beyond a hello's worth before its hello, no connection places for longer than the hello
deadline, no REST descriptors beyond the cap and the header deadline, no store reads without a
token, and no short token accepted from a token file (issue 24, items 1-4 and 9)."""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_protocol import frames as fr

from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.daemon.server.planekit import NS, RawClient, make_recs, raw_tcp

TOKEN = "abuse-guards-token-0123456789abcdef"
HELLO_TIMEOUT_S, MAX_UNAUTHENTICATED = 1.0, 4
REST_CAP, HEADER_TIMEOUT_S, BODY_TIMEOUT_S = 6, 1.0, 1.0
BIG = 256 << 20  # the default max_payload_bytes: what an attacker announces


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierDaemon]:
    """Defaults but for short deadlines and small caps (so the tests wait seconds, not minutes)."""
    d = KvtierDaemon(tmp_path_factory.mktemp("kvtierd-abuse"), host_bytes="32MiB", disk_bytes="0",
                     extra_args=("--listen", "127.0.0.1:0", "--rest", "127.0.0.1:0"))
    d._env.update(KVTIER_TOKEN=TOKEN, KVTIER_DATAPLANE__HELLO_TIMEOUT_S=str(HELLO_TIMEOUT_S),
                  KVTIER_DATAPLANE__MAX_UNAUTHENTICATED=str(MAX_UNAUTHENTICATED),
                  KVTIER_REST__MAX_CONNECTIONS=str(REST_CAP), KVTIER_REST__HEADER_TIMEOUT_S=str(HEADER_TIMEOUT_S),
                  KVTIER_REST__BODY_TIMEOUT_S=str(BODY_TIMEOUT_S))
    try:
        yield d.start()
    finally:
        d.cleanup()


def rest_port(d: KvtierDaemon) -> int:
    return int(re.findall(r"kvtierd rest http://127\.0\.0\.1:(\d+)", d._log_since(0))[-1])


def rss_bytes(d: KvtierDaemon) -> int:
    assert d.process is not None
    with open(f"/proc/{d.process.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def error_code(frame: fr.Frame | None) -> str | None:
    assert frame is not None, "the daemon answers before it closes"
    return None if frame.header.get("ok") else frame.header["err"]["code"]


def announce(payload_len: int, sent: bytes = b"") -> bytes:
    """A put's preamble and header announcing ``payload_len`` bytes, then ``sent`` of them."""
    rec = make_recs(1, seed=3)[0]
    whole = fr.encode_frame_bytes({"op": "put", "id": 9, "ns_id": NS.ns_id, "hashes": [rec.chain_hash],
                                   "lens": [payload_len]}, b"x")
    _, _, flags, header_len, _ = fr.PREAMBLE.unpack_from(whole, 0)
    head = whole[fr.PREAMBLE_LEN:fr.PREAMBLE_LEN + header_len]
    return fr.PREAMBLE.pack(fr.MAGIC, fr.FRAME_VERSION, flags, header_len, payload_len) + head + sent


def wait_closed(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (the socket's 10 s timeout fails the test)."""
    sock.settimeout(10.0)
    out = b""
    while chunk := sock.recv(1 << 16):
        out += chunk
    return out


def pinged(d: KvtierDaemon) -> None:
    """A unix-socket client's hello and ping: the daemon has handled what came before."""
    raw = RawClient.connect(d.address)
    try:
        assert raw.hello()[0].header["ok"] and error_code(raw.call("ping")) is None
    finally:
        raw.close()


# --- item 1: memory before authentication ----------------------------------------------------------


def test_a_stranger_announcing_a_huge_payload_is_closed_without_memory(daemon: KvtierDaemon) -> None:
    before = rss_bytes(daemon)
    strangers = [RawClient.connect(raw_tcp(daemon)) for _ in range(MAX_UNAUTHENTICATED)]
    try:
        for raw in strangers:
            raw.send_bytes(announce(BIG))
        for raw in strangers:  # refused at the preamble: nothing larger than a hello before hello
            frame = raw.recv()
            assert frame is not None and frame.id == fr.CONNECTION_ERROR_ID
            assert error_code(frame) == "limit_exceeded" and raw.recv() is None
    finally:
        for raw in strangers:
            raw.close()
    pinged(daemon)
    assert rss_bytes(daemon) - before < 32 << 20, "the announced payloads were not allocated"


def test_payload_memory_grows_with_the_bytes_that_arrive(daemon: KvtierDaemon) -> None:
    raw = RawClient.connect(raw_tcp(daemon))
    try:
        assert raw.hello(TOKEN)[0].header["ok"]
        before = rss_bytes(daemon)
        raw.send_bytes(announce(BIG, b"\0" * (1 << 20)))  # 256 MiB announced, 1 MiB sent
        pinged(daemon)
        assert rss_bytes(daemon) - before < 64 << 20, "memory for bytes that never came"
    finally:
        raw.close()


# --- item 2: connection places before authentication ---------------------------------------------


def test_idle_strangers_neither_keep_places_nor_starve_the_unix_socket(daemon: KvtierDaemon) -> None:
    idle = [socket.create_connection(tuple(raw_tcp(daemon).removeprefix("tcp:").rsplit(":", 1))) for _ in
            range(MAX_UNAUTHENTICATED)]
    try:
        pinged(daemon)  # the daemon has accepted them all by now
        extra = RawClient.connect(raw_tcp(daemon))
        try:
            assert error_code(extra.recv()) == "busy" and extra.recv() is None
        finally:
            extra.close()
        pinged(daemon)  # the unix socket's clients are never kept out by TCP strangers
        for sock in idle:  # closed at the hello deadline (else the socket timeout fails the test)
            assert wait_closed(sock) == b""
    finally:
        for sock in idle:
            sock.close()
    raw = RawClient.connect(raw_tcp(daemon))  # the places are free again
    try:
        assert raw.hello(TOKEN)[0].header["ok"]
    finally:
        raw.close()
    assert f"no hello within {HELLO_TIMEOUT_S:.1f} s" in daemon._log_since(0)


# --- item 3: REST slowloris ------------------------------------------------------------------------


def _rest_socket(d: KvtierDaemon) -> socket.socket:
    return socket.create_connection(("127.0.0.1", rest_port(d)), timeout=10.0)


def test_rest_connections_are_capped_and_trickled_headers_time_out(daemon: KvtierDaemon) -> None:
    slow = [_rest_socket(daemon) for _ in range(REST_CAP)]
    try:
        for sock in slow:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        extra = _rest_socket(daemon)
        try:
            answer = wait_closed(extra)
            assert answer.startswith(b"HTTP/1.1 503") and b'"busy"' in answer
        finally:
            extra.close()
        pinged(daemon)  # the data plane is served meanwhile
        for sock in slow:
            sock.sendall(b"X")  # a byte now and then does not extend the deadline
        for sock in slow:
            assert not wait_closed(sock).startswith(b"HTTP/1.1 200"), "closed without an answer"
    finally:
        for sock in slow:
            sock.close()
    sock = _rest_socket(daemon)  # room again
    try:
        sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert wait_closed(sock).startswith(b"HTTP/1.1 200")
    finally:
        sock.close()


@pytest.mark.parametrize("framing", ["length", "chunked"])
def test_a_rest_body_that_never_arrives_times_out(daemon: KvtierDaemon, framing: str) -> None:
    sock = _rest_socket(daemon)
    try:
        head = f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n" \
               "Content-Type: application/json\r\n"
        head += "Content-Length: 1000\r\n\r\n{\"ns\"" if framing == "length" else \
            "Transfer-Encoding: chunked\r\n\r\n5\r\n{\"ns\"\r\n"
        sock.sendall(head.encode())
        answer = wait_closed(sock)  # answered, then closed: the rest of the body may still come
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    finally:
        sock.close()


def test_a_huge_content_length_is_refused_before_its_body(daemon: KvtierDaemon) -> None:
    sock = _rest_socket(daemon)
    try:
        sock.sendall(f"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                     f"Content-Length: {1 << 40}\r\n\r\n".encode())
        answer = wait_closed(sock)
        assert answer.startswith(b"HTTP/1.1 413") and b"limit_exceeded" in answer
    finally:
        sock.close()


# --- item 4: what REST does without a token --------------------------------------------------------


def _http(d: KvtierDaemon, method: str, path: str, body: object = None, token: str | None = None) -> int:
    sock = _rest_socket(d)
    try:
        data = b"" if body is None else json.dumps(body).encode()
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Connection: close\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
        return int(wait_closed(sock).split(b" ", 2)[1])
    finally:
        sock.close()


def test_anonymous_rest_serves_health_and_metrics_but_no_reads(daemon: KvtierDaemon) -> None:
    for path in ("/v1/health", "/v1/ready", "/metrics", "/openapi.json"):
        assert _http(daemon, "GET", path) == 200, path
    lookup = {"ns": NS.ns_id.hex(), "token_ids": list(range(4096))}
    for method, path, body in (("GET", "/v1/stats", None), ("GET", "/v1/namespaces", None),
                               ("GET", "/v1/blocks", None), ("POST", "/v1/lookup", lookup)):
        assert _http(daemon, method, path, body) == 401, path
        assert _http(daemon, method, path, body, TOKEN) in (200, 404), path  # 404: NS is not registered


def test_public_reads_is_an_explicit_choice(tmp_path: Path) -> None:
    d = KvtierDaemon(tmp_path, host_bytes="16MiB", disk_bytes="0", extra_args=("--rest", "127.0.0.1:0"))
    d._env.update(KVTIER_REST__PUBLIC_READS="true")
    try:
        d.start()
        assert _http(d, "GET", "/v1/stats") == 200
    finally:
        d.cleanup()


# --- item 9: one token rule for every source -------------------------------------------------------


def test_a_one_character_token_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "short.token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"x\n")
    os.close(fd)
    d = KvtierDaemon(tmp_path, host_bytes="16MiB", disk_bytes="0")
    d._env.update(KVTIER_TOKEN_FILE=str(path))
    try:
        with pytest.raises(RuntimeError, match="shorter than 16 characters"):
            d.start()
    finally:
        d.cleanup()
