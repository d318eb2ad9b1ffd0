"""Security of a live daemon (a real ``kvtier serve`` process): the token on TCP and on every
mutating REST call, private files and segments handed over as descriptors, enforced limits with
typed errors, secrets kept out of logs, REST bodies and /metrics, and no pickle, eval or shell-out
on any input path."""

from __future__ import annotations

import ast
import http.client
import json
import os
import re
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier_protocol import frames as fr

from tests.kvtier.conftest import ROOT, KvtierDaemon
from tests.kvtier.daemon.server.planekit import NS, RawClient, make_recs, raw_tcp

TOKEN = "sEcReT-token-9f8e7d6c5b4a39281706"
WRONG = ["sEcReT-token-9f8e7d6c5b4a3928170", TOKEN + "x", "not-the-token-1234567890"]
MAX_CONNECTIONS, MAX_INFLIGHT, MAX_BATCH, MAX_PAYLOAD = 8, 2, 64, 1 << 20


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvtierDaemon]:
    """A daemon with a configured token, TCP and REST, small limits, logging at debug level."""
    d = KvtierDaemon(tmp_path_factory.mktemp("kvtierd-sec"), host_bytes="32MiB", disk_bytes="0",
                     extra_args=("--listen", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--log-level", "debug"))
    d._env.update(KVTIER_TOKEN=TOKEN, KVTIER_DATAPLANE__MAX_CONNECTIONS=str(MAX_CONNECTIONS),
                  KVTIER_DATAPLANE__MAX_INFLIGHT=str(MAX_INFLIGHT), KVTIER_DATAPLANE__MAX_BATCH=str(MAX_BATCH),
                  KVTIER_DATAPLANE__MAX_PAYLOAD_BYTES=str(MAX_PAYLOAD))
    try:
        yield d.start()
    finally:
        d.cleanup()


def rest(d: KvtierDaemon, method: str, path: str, body: object = None,
         token: str | None = None) -> tuple[int, dict[str, str], bytes]:
    port = int(re.findall(r"kvtierd rest http://127\.0\.0\.1:(\d+)", d._log_since(0))[-1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def error_code(frame: fr.Frame | None) -> str | None:
    assert frame is not None, "the daemon answers before it closes"
    return None if frame.header.get("ok") else frame.header["err"]["code"]


# --- the token ------------------------------------------------------------------------------------


def test_tcp_needs_the_token(daemon: KvtierDaemon) -> None:
    cases = [("ping before hello", None, "ping"), ("no token", None, "hello")] + \
            [(f"wrong token {i}", w, "hello") for i, w in enumerate(WRONG)]
    for what, token, op in cases:
        raw = RawClient.connect(raw_tcp(daemon))
        try:
            if op == "ping":
                assert error_code(raw.call("ping")) == "unauthorized", what
            else:
                frame, fds = raw.hello(token)
                assert error_code(frame) == "unauthorized" and not fds, what
                assert error_code(raw.call("ping")) == "unauthorized", f"{what}: still refused after the hello"
        finally:
            raw.close()
    raw = RawClient.connect(raw_tcp(daemon))
    try:
        frame, fds = raw.hello(TOKEN)
        assert frame.header["ok"] and frame.header["segments"] == [] and frame.header["fds"] == 0 and not fds, \
            "over TCP no shared-memory segment is named or passed"
        assert error_code(raw.call("ping")) is None
        assert error_code(raw.call("delete", ns_id=NS.ns_id, hashes=[b"\x01" * 32])) is None
    finally:
        raw.close()


def test_every_mutating_rest_call_needs_the_token(daemon: KvtierDaemon) -> None:
    status, _, body = rest(daemon, "GET", "/openapi.json")
    assert status == 200
    paths = json.loads(body)["paths"]
    mutating = [(m.upper(), p) for p, ops in paths.items() for m in ops if m in ("post", "put", "patch", "delete")]
    assert ("POST", "/v1/clear") in mutating and ("POST", "/v1/check") in mutating
    sample = {"ns": NS.ns_id.hex(), "hash": "ab" * 32}
    for method, template in mutating:
        path = template.format(**sample)
        if (method, template) == ("POST", "/v1/lookup"):  # read-only: hashing token ids is a lookup
            continue
        for token in (None, *WRONG, ""):
            status, headers, body = rest(daemon, method, path, {"ns": NS.ns_id.hex()}, token)
            assert status == 401, (method, path, token, status, body)
            assert json.loads(body)["error"]["code"] == "unauthorized"
            assert headers.get("WWW-Authenticate", "").startswith("Bearer")
        status, _, body = rest(daemon, method, path, {"ns": NS.ns_id.hex()}, TOKEN)
        assert status != 401, (method, path, body)
    for path in ("/v1/health", "/v1/ready", "/metrics", "/openapi.json"):  # public
        assert rest(daemon, "GET", path)[0] == 200, path
    for path in ("/v1/stats", "/v1/tiers", "/v1/namespaces", "/v1/blocks"):  # reads: a token (rest.public_reads off)
        assert rest(daemon, "GET", path)[0] == 401, path
        assert rest(daemon, "GET", path, token=TOKEN)[0] == 200, path


# --- private files, segments passed as descriptors --------------------------------------------


def _mode(path: str | Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_socket_segments_and_token_file_are_private(kvtier_daemon: KvtierDaemon) -> None:
    d = kvtier_daemon  # no configured token: the daemon generates its token file
    assert _mode(d.socket) == 0o600 and stat.S_ISSOCK(os.stat(d.socket).st_mode)
    assert _mode(d.data_dir / "token") == 0o600 and _mode(d.data_dir) & 0o077 == 0
    segments = sorted(p for p in os.listdir("/dev/shm") if p.startswith(d.prefix))
    assert segments, "the host tier lives in named /dev/shm segments"
    for name in segments:
        assert _mode(f"/dev/shm/{name}") == 0o600, name
    raw = RawClient.connect(d.address)
    try:
        frame, fds = raw.hello()
        named = [s["name"] for s in frame.header["segments"]]
        assert frame.header["fds"] == len(named) == len(fds) > 0, "segments travel as descriptors (SCM_RIGHTS)"
        for fd in fds:
            assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
            os.close(fd)
    finally:
        raw.close()


# --- limits ------------------------------------------------------------------------------------------


def test_frame_size_limits_are_enforced_before_reading(daemon: KvtierDaemon) -> None:
    for header_len, payload_len, flags in ((16, MAX_PAYLOAD + 1, fr.FLAG_PAYLOAD), ((4 << 20) + 1, 0, 0),
                                           (16, (1 << 64) - 1, fr.FLAG_PAYLOAD)):
        raw = RawClient.connect(daemon.address)
        try:
            raw.send_bytes(fr.PREAMBLE.pack(fr.MAGIC, 1, flags, header_len, payload_len))
            frame = raw.recv()
            assert frame is not None and frame.id == fr.CONNECTION_ERROR_ID
            assert error_code(frame) == "limit_exceeded"
            assert raw.recv() is None, "the stream is out of sync: the daemon closes it"
        finally:
            raw.close()


def test_batch_limit(daemon: KvtierDaemon) -> None:
    raw = RawClient.connect(daemon.address)
    try:
        raw.hello()
        hashes = [bytes([i % 256]) * 32 for i in range(MAX_BATCH + 1)]
        assert error_code(raw.call("lookup", ns_id=NS.ns_id, hashes=hashes)) == "limit_exceeded"
        assert error_code(raw.call("lookup", ns_id=NS.ns_id, hashes=hashes[:MAX_BATCH])) is None, \
            "a refused request leaves the connection usable"
    finally:
        raw.close()


def test_inflight_limit_answers_busy(daemon: KvtierDaemon) -> None:
    raw = RawClient.connect(daemon.address)
    try:
        raw.hello()
        # Deletes: each is served in a task of its own (a lookup or a ping is answered in the
        # read loop, before the next frame is read: it never is in flight when one comes).
        hashes = [bytes([i]) * 32 for i in range(MAX_BATCH)]
        burst = b"".join(fr.encode_frame_bytes({"op": "delete", "id": 100 + i, "ns_id": NS.ns_id, "hashes": hashes})
                         for i in range(40))
        raw.send_bytes(burst)
        codes = [error_code(raw.recv()) for _ in range(40)]
        assert set(codes) <= {None, "busy"}, codes
        assert "busy" in codes and None in codes, codes
        assert error_code(raw.call("ping")) is None
    finally:
        raw.close()


def test_connection_limit(daemon: KvtierDaemon) -> None:
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):
            raw = RawClient.connect(daemon.address)
            held.append(raw)
            assert raw.hello()[0].header["ok"]
        extra = RawClient.connect(daemon.address)
        held.append(extra)
        frame = extra.recv()
        assert frame is not None and error_code(frame) == "busy" and extra.recv() is None
    finally:
        for raw in held:
            raw.close()


# --- secrets ------------------------------------------------------------------------------------


def test_secrets_stay_out_of_logs_rest_and_metrics(daemon: KvtierDaemon) -> None:
    recs = make_recs(2, seed=77)
    for token in (TOKEN, *WRONG):  # presented tokens, right or wrong, are never echoed
        raw = RawClient.connect(raw_tcp(daemon))
        try:
            raw.hello(token)
            if token == TOKEN:
                for rec in recs:
                    put = raw.call("put", payload=rec.record, ns_id=NS.ns_id, hashes=[rec.chain_hash],
                                   lens=[len(rec.record)])
                    assert error_code(put) is None
        finally:
            raw.close()
    for token in (None, *WRONG):
        rest(daemon, "POST", "/v1/clear", {"ns": NS.ns_id.hex()}, token)
    bodies = [rest(daemon, "GET", p)[2] for p in ("/v1/health", "/v1/stats", "/v1/tiers", "/v1/namespaces",
                                                   "/v1/blocks", "/metrics", "/openapi.json")]
    bodies.append(rest(daemon, "GET", f"/v1/blocks/{NS.ns_id.hex()}/{recs[0].chain_hash.hex()}")[2])
    log = daemon._log_since(0)
    assert "DEBUG" in log, "the daemon logged at debug level"
    for secret in (TOKEN, *WRONG):
        assert secret not in log, "a token reached the daemon's log"
        for body in bodies:
            assert secret.encode() not in body


# --- no pickle, eval or shell-out on an input path ----------------------------------------------

INPUT_PATHS = [ROOT / "protocol" / "kvtier_protocol", ROOT / "kvtier" / "server", ROOT / "kvtier" / "store",
               ROOT / "kvtier" / "client", ROOT / "kvtier" / "connector", ROOT / "connectors",
               ROOT / "kvtier" / "config.py", ROOT / "kvtier" / "config_sources.py"]
BANNED_CALLS = {("os", "system"), ("os", "popen"), ("os", "execv"), ("os", "execvp"), ("os", "spawnv"),
                ("torch", "load"), ("np", "load"), ("numpy", "load"), ("yaml", "load"), ("pickle", "loads"),
                ("marshal", "loads"), ("shelve", "open")}
BANNED_MODULES = {"subprocess", "pickle", "cPickle", "dill", "marshal", "shelve", "yaml", "pty", "code", "codeop"}


def _sources() -> list[Path]:
    out: list[Path] = []
    for root in INPUT_PATHS:
        if root.is_file():
            out.append(root)
        elif root.exists():
            out.extend(root.rglob("*.py"))
    return out


def test_no_pickle_eval_or_shell_on_input_paths() -> None:
    """Beyond tests/test_packaging.py: no subprocess at all, no torch.load / np.load (pickle
    inside), no compile/__import__, no dynamic import_module, no os.system/popen/exec."""
    files = _sources()
    assert len(files) > 40
    for path in files:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                assert not {a.name.split(".")[0] for a in node.names} & BANNED_MODULES, where
            elif isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in BANNED_MODULES, where
            elif isinstance(node, ast.Call):
                f = node.func
                if isinstance(f, ast.Name):
                    assert f.id not in {"eval", "exec", "compile", "__import__"}, where
                elif isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                    assert (f.value.id, f.attr) not in BANNED_CALLS, f"{where}: {f.value.id}.{f.attr}()"
                    if f.attr == "import_module":
                        assert node.args and isinstance(node.args[0], (ast.Constant, ast.Name)), where
                for kw in node.keywords:
                    assert not (kw.arg == "allow_pickle" and not (isinstance(kw.value, ast.Constant)
                                                                  and kw.value.value is False)), where
                    assert kw.arg != "shell", f"{where}: shell="
