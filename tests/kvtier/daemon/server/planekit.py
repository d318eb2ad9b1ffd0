"""Helpers of the data-plane tests: an in-process DataPlane on a real store, and a raw frame client.

The client speaks bytes on a blocking socket (so the tests see exactly what the daemon sends,
descriptors included); async tests drive it through :class:`Peer`, which runs each call in a
thread while the daemon keeps serving on the event loop.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier_protocol import frames as fr
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
from kvtier_protocol.keys import chain_hashes
from kvtier_protocol.namespace import Namespace

from kvtier.daemon.config import AuthConfig, DaemonConfig, DataPlaneConfig, EventsConfig, RestConfig
from kvtier.daemon.server.auth import Auth
from kvtier.daemon.server.context import DaemonContext
from kvtier.daemon.server.dataplane import DataPlane
from kvtier.daemon.server.events import EventHub
from kvtier.daemon.server.metrics import Metrics
from kvtier.daemon.store.config import StoreConfig
from kvtier.daemon.store.store import TieredStore
from tests.kvtier.conftest import KvtierDaemon
from tests.kvtier.waitkit import PATIENCE_S

TOKEN = "dataplane-test-token-0123456789"
NS = Namespace(model="test/model", revision="r1", attention="mha", num_layers=1, num_kv_heads=1,
               head_dim=64, kv_dtype="float16", block_tokens=32, hash_tokens=16)
BLOCK = NS.block_payload_bytes()  # 8192: canonical [1, 2, 1, 32, 64] float16
CLIENT_LIMITS = fr.Limits(max_payload_len=1 << 30)


def tokens_for(num_blocks: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(num_blocks * NS.block_tokens)]


@dataclass(frozen=True, slots=True)
class Rec:
    """One block of :data:`NS`: key, encoded header, payload, and what produced the key."""

    chain_hash: bytes
    header: bytes
    payload: bytes
    tokens: tuple[int, ...]
    unit_hashes: tuple[bytes, ...]

    @property
    def record(self) -> bytes:
        return self.header + self.payload


def make_recs(num_blocks: int, seed: int = 0, *, ns_fields: bool = True) -> list[Rec]:
    """A chain of real blocks whose keys are NS.block_keys of random token ids."""
    tokens = tokens_for(num_blocks, seed)
    units = chain_hashes(tokens, NS.hash_tokens, scheme=NS.hash_scheme)
    per = NS.units_per_block
    out, parent = [], None
    for b in range(num_blocks):
        key = units[(b + 1) * per - 1]
        payload = random.Random(key).randbytes(BLOCK)
        h = BlockHeader(ns_id=NS.ns_id, chain_hash=key, parent_hash=parent, num_tokens=NS.block_tokens,
                        layout="canonical", shape=(1, 2, 1, NS.block_tokens, 64), dtype="float16", codec="raw",
                        sections=(Section("payload", 0, BLOCK),), payload_len=BLOCK,
                        checksum=payload_checksum(payload), ns_fields=NS.to_wire() if ns_fields else None)
        toks = tuple(tokens[b * NS.block_tokens:(b + 1) * NS.block_tokens])
        out.append(Rec(key, encode_header(h), payload, toks, tuple(units[b * per:(b + 1) * per])))
        parent = key
    return out


BIG_NS_ID = b"\xab" * 16  # big test blocks have no registered namespace (their geometry is free)


def big_record(payload_len: int, seed: int = 1) -> tuple[bytes, bytes]:
    """``(chain hash, record)`` of one block of ``payload_len`` bytes (a multiple of 128) in BIG_NS_ID."""
    payload = random.Random(seed).randbytes(payload_len)
    key = random.Random(seed).randbytes(32)
    h = BlockHeader(ns_id=BIG_NS_ID, chain_hash=key, parent_hash=None, num_tokens=32, layout="canonical",
                    shape=(1, 2, 1, 32, payload_len // 128), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, payload_len),), payload_len=payload_len,
                    checksum=payload_checksum(payload))
    return key, encode_header(h) + payload


class RawClient:
    """A blocking frame client: send headers (and payloads), receive decoded frames."""

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(10.0)
        self.sock = sock
        self.unix = sock.family == socket.AF_UNIX
        self.decoder = fr.FrameDecoder(CLIENT_LIMITS)
        self.frames: deque[fr.Frame] = deque()
        self.next_id = 1

    @classmethod
    def connect(cls, endpoint: str) -> RawClient:
        """``unix:/path`` or ``tcp:HOST:PORT`` as DataPlane.start() reports them."""
        kind, _, where = endpoint.partition(":")
        if kind == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(where)
        else:
            host, _, port = where.rpartition(":")
            sock = socket.create_connection((host, int(port)))
        return cls(sock)

    def send(self, header: dict[str, Any], payload: Any = None) -> int:
        if "id" not in header:
            header = {**header, "id": self.next_id}
            self.next_id += 1
        self.sock.sendall(fr.encode_frame_bytes(header, payload, limits=CLIENT_LIMITS))
        return header["id"]

    def send_bytes(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> fr.Frame | None:
        """The next frame; None at a clean end of stream."""
        while not self.frames:
            data = self.sock.recv(1 << 20)
            if not data:
                return None
            self.frames.extend(self.decoder.feed(data))
        return self.frames.popleft()

    def call(self, op: str, payload: Any = None, **keys: Any) -> fr.Frame:
        ident = self.send({"op": op, **keys}, payload)
        frame = self.recv()
        assert frame is not None and frame.id == ident, frame
        return frame

    def hello(self, token: str | None = None, version: int = 1) -> tuple[fr.Frame, list[int]]:
        """Send hello; on a unix socket read the response with recvmsg to take its descriptors."""
        header: dict[str, Any] = {"op": "hello", "version": version, "client": "planekit"}
        if token is not None:
            header["token"] = token
        self.send(header)
        fds: list[int] = []
        if self.unix:
            data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 64)
            self.frames.extend(self.decoder.feed(data))
        frame = self.recv()
        assert frame is not None
        return frame, fds

    def close(self) -> None:
        self.sock.close()


class Peer:
    """A RawClient for async tests: every method runs in a worker thread."""

    def __init__(self, raw: RawClient) -> None:
        self.raw = raw

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.raw, name)

        async def run(*args: Any, **kwargs: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return run


@dataclass(slots=True)
class Plane:
    """A started DataPlane and what the tests need around it."""

    ctx: DaemonContext
    plane: DataPlane
    unix: str  # "unix:/path"
    tcp: str  # "tcp:127.0.0.1:PORT"
    peers: list[RawClient] = field(default_factory=list)  # closed at teardown

    @property
    def store(self) -> TieredStore:
        return self.ctx.store

    @property
    def socket_path(self) -> str:
        return self.unix.partition(":")[2]

    async def connect(self, endpoint: str, *, hello: bool = True, token: str | None = None) -> Peer:
        raw = await asyncio.to_thread(RawClient.connect, endpoint)
        self.peers.append(raw)
        peer = Peer(raw)
        if hello:
            frame, _ = await peer.hello(token)
            assert frame.header["ok"], frame.header
        return peer


@asynccontextmanager
async def open_plane(tmp_path: Path, *, token: str | None = TOKEN, host_bytes: int = 64 * BLOCK,
                     store: dict[str, Any] | None = None, **dataplane: Any) -> AsyncIterator[Plane]:
    """A real store (host + disk) on ``tmp_path`` served by a DataPlane on a unix socket and TCP;
    ``store``: StoreConfig settings over the defaults."""
    sockdir = tempfile.mkdtemp(prefix="kvt-")  # short: unix socket paths are limited to 107 bytes
    store_cfg = StoreConfig(host_bytes=host_bytes, host_name_prefix=f"kvtier-dp-{os.getpid()}",
                            host_prefault=False, host_pin=False, disk_path=str(tmp_path / "disk"),
                            disk_bytes=1 << 26, **(store or {}))
    settings: dict[str, Any] = {"socket": os.path.join(sockdir, "run", "kvtier.sock"), "listen": "127.0.0.1:0"}
    settings.update(dataplane)
    cfg = DaemonConfig(store=store_cfg, dataplane=DataPlaneConfig(**settings), rest=RestConfig(),
                       events=EventsConfig(), auth=AuthConfig(token=token), data_dir=str(tmp_path))
    tiered = TieredStore(store_cfg)
    await tiered.start()
    metrics = Metrics()
    auth = Auth.from_config(cfg.auth, str(tmp_path)) if token is not None else Auth(None)
    ctx = DaemonContext(cfg, tiered, auth, metrics, EventHub(cfg.events, metrics), time.time())
    metrics.bind(ctx)
    plane = DataPlane(ctx)
    p: Plane | None = None
    try:
        endpoints = await plane.start()
        unix = next((e for e in endpoints if e.startswith("unix:")), "")
        tcp = next((e for e in endpoints if e.startswith("tcp:")), "")
        p = Plane(ctx, plane, unix, tcp)
        yield p
    finally:
        for raw in p.peers if p is not None else ():
            raw.close()
        await plane.stop(2.0)
        await tiered.close()
        shutil.rmtree(sockdir, ignore_errors=True)


async def eventually(predicate: Callable[[], bool], timeout: float = PATIENCE_S) -> None:
    """Wait until ``predicate()`` holds (the daemon reacts to a client's close asynchronously)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def raw_tcp(daemon: KvtierDaemon) -> str:
    """The daemon's TCP data plane as :meth:`RawClient.connect` takes it: ``"tcp:HOST:PORT"``."""
    return "tcp:" + daemon.tcp_address().removeprefix("tcp://")
