"""One client process of `kvtier bench peers`: saves and loads its own blocks through one engine.

Run as ``python -m kvtier.bench.peers.worker`` by :mod:`kvtier.bench.peers.pool`; it speaks
JSON lines: one command per line on stdin, one answer per line on stdout (binary fields as hex).
JSON, not multiprocessing's pickled pipes, because nothing in kvtier unpickles.

Commands::

    {"cmd": "open", "engines": {"shm": {...}, "tcp": {...}, "redis": {...}}, "ns_id": hex, "client": int}
    {"cmd": "prepare", "size": int, "blocks": int, "per_call": int}   # build records, untimed
    {"cmd": "run", "engine": str, "op": "save"|"load", "start_at": float}
    {"cmd": "delete", "engine": str}                                   # untimed clean-up
    {"cmd": "stop"}

``run`` sleeps until ``start_at`` (time.monotonic, one clock for every process on the machine) so
every client starts together, then answers ``{"t0", "t1", "lat_ms": [...], "bytes"}``: its window
and the latency of each call. Loaded bytes are compared with what was saved after ``t1``.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum


class Engine(Protocol):
    """What every engine offers a worker: one call saves or loads one batch of blocks."""

    def save(self, keys: list[bytes], records: list[bytearray]) -> None: ...
    def load(self, keys: list[bytes], records: list[bytearray], dsts: list[bytearray]) -> list[Any]: ...
    def delete(self, keys: list[bytes]) -> None: ...
    def close(self) -> None: ...


class KvtierEngine:
    """kvtier's blocking client: shared memory over the unix socket, frames over TCP."""

    def __init__(self, address: str, token: str, ns_id: bytes) -> None:
        from kvtier.client import Client

        self.ns_id = ns_id
        self.client = Client.connect(address, token=token or None, timeout_s=120.0)

    def save(self, keys: list[bytes], records: list[bytearray]) -> None:
        out = self.client.save(self.ns_id, list(zip(keys, records)))
        if out != ["stored"] * len(keys):
            raise RuntimeError(f"kvtier save answered {sorted(set(out))}")

    def load(self, keys: list[bytes], records: list[bytearray], dsts: list[bytearray]) -> list[Any]:
        # load_into: the engine's own path (verified copy into buffers it owns, no allocation).
        got = self.client.load_into(self.ns_id, keys, dsts, degrade=False)
        if len(got) != len(keys):
            raise RuntimeError(f"kvtier load found {len(got)} of {len(keys)} blocks")
        return dsts

    def delete(self, keys: list[bytes]) -> None:
        self.client.delete(self.ns_id, keys)

    def close(self) -> None:
        self.client.close()


class RedisEngine:
    """redis-py, one pipeline (no MULTI) per call: one round trip for the whole batch."""

    def __init__(self, host: str, port: int, ns_id: bytes) -> None:
        import redis

        self.prefix = ns_id
        self.r = redis.Redis(host=host, port=port, socket_timeout=120.0)

    def save(self, keys: list[bytes], records: list[bytearray]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for k, rec in zip(keys, records):
            pipe.set(self.prefix + k, rec)
        if not all(pipe.execute()):
            raise RuntimeError("redis SET failed")

    def load(self, keys: list[bytes], records: list[bytearray], dsts: list[bytearray]) -> list[Any]:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.get(self.prefix + k)
        values = pipe.execute()
        if any(v is None or len(v) != len(rec) for v, rec in zip(values, records)):
            raise RuntimeError("redis GET missed a block or returned another length")
        return values

    def delete(self, keys: list[bytes]) -> None:
        self.r.delete(*[self.prefix + k for k in keys])

    def close(self) -> None:
        self.r.close()


def make_record(ns_id: bytes, key: bytes, parent: bytes | None, payload: bytes) -> bytearray:
    """One whole kvtier block record: header (checksummed), then ``payload``."""
    n = len(payload)
    h = BlockHeader(ns_id=ns_id, chain_hash=key, parent_hash=parent, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return bytearray(encode_header(h) + payload)


@dataclass(slots=True)
class Blocks:
    """This client's blocks of one size: keys, records, load destinations, grouped per call."""

    size: int
    per_call: int
    keys: list[bytes] = field(default_factory=list)
    records: list[bytearray] = field(default_factory=list)
    dsts: list[bytearray] = field(default_factory=list)

    @classmethod
    def build(cls, ns_id: bytes, client: int, size: int, blocks: int, per_call: int) -> Blocks:
        rng = random.Random(client * 1_000_003 + size)
        out = cls(size, per_call)
        parent = None
        for i in range(blocks):
            key = hashlib.sha256(ns_id + b"peers" + client.to_bytes(4, "little") + size.to_bytes(8, "little")
                                 + i.to_bytes(8, "little")).digest()
            out.keys.append(key)
            out.records.append(make_record(ns_id, key, parent, rng.randbytes(size)))
            out.dsts.append(bytearray(size))
            parent = key
        return out

    def calls(self) -> list[range]:
        return [range(i, min(len(self.keys), i + self.per_call)) for i in range(0, len(self.keys), self.per_call)]

    def check(self, call: range, loaded: list[Any]) -> None:
        """Loaded blocks equal saved ones: payloads (kvtier destinations) or whole records (Redis)."""
        for i, got in zip(call, loaded):
            rec = self.records[i]
            want = memoryview(rec)[len(rec) - self.size:] if len(got) == self.size else memoryview(rec)
            if got != want:
                raise RuntimeError(f"block {i} of {self.size} bytes came back different")


def _open(name: str, spec: dict[str, Any], ns_id: bytes) -> Engine:
    if spec["kind"] == "kvtier":
        return KvtierEngine(spec["address"], spec.get("token", ""), ns_id)
    if spec["kind"] == "redis":
        return RedisEngine(spec["host"], int(spec["port"]), ns_id)
    raise ValueError(f"unknown engine kind {spec['kind']!r} for {name}")


def _run(engine: Engine, op: str, blocks: Blocks, start_at: float) -> dict[str, Any]:
    calls = blocks.calls()
    keys, records, dsts = blocks.keys, blocks.records, blocks.dsts
    clock = time.monotonic
    lat: list[float] = []
    last: list[Any] = []
    fn: Callable[[range], Any]
    if op == "save":
        def fn(c: range) -> Any:
            return engine.save(keys[c.start:c.stop], records[c.start:c.stop])
    else:
        def fn(c: range) -> Any:
            return engine.load(keys[c.start:c.stop], records[c.start:c.stop], dsts[c.start:c.stop])
    delay = start_at - clock()
    if delay > 0:
        time.sleep(delay)
    t0 = clock()
    for c in calls:
        s = clock()
        last = fn(c)
        lat.append((clock() - s) * 1e3)
    t1 = clock()
    if op == "load":
        blocks.check(calls[-1], last)
    return {"t0": t0, "t1": t1, "lat_ms": lat, "bytes": blocks.size * len(keys)}


def main() -> int:
    engines: dict[str, Engine] = {}
    blocks: Blocks | None = None
    ns_id = b""
    client = 0
    out = sys.stdout
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            cmd = msg["cmd"]
            if cmd == "open":
                ns_id, client = bytes.fromhex(msg["ns_id"]), int(msg["client"])
                engines = {name: _open(name, spec, ns_id) for name, spec in msg["engines"].items()}
                reply: dict[str, Any] = {"ok": True}
            elif cmd == "prepare":
                blocks = None  # free the previous size's buffers first
                blocks = Blocks.build(ns_id, client, int(msg["size"]), int(msg["blocks"]), int(msg["per_call"]))
                reply = {"ok": True}
            elif cmd == "run":
                assert blocks is not None, "prepare comes before run"
                reply = {"ok": True, **_run(engines[msg["engine"]], msg["op"], blocks, float(msg["start_at"]))}
            elif cmd == "delete":
                assert blocks is not None, "prepare comes before delete"
                engines[msg["engine"]].delete(blocks.keys)
                reply = {"ok": True}
            elif cmd == "stop":
                break
            else:
                reply = {"ok": False, "error": f"unknown command {cmd!r}"}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for engine in engines.values():
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
