"""One client process of ``kvtier bench soak``: many asyncio clients of mixed lookup/save/load.

Run by the suite as ``python -m kvtier.bench.soak.worker`` with one JSON line on stdin (the
:class:`WorkerConfig` fields). It connects its clients, prints ``ready``, waits for a ``go``
line, runs every client in a closed loop (next call as soon as the last one returned, no think
time) until the time is up, closes them and writes its :class:`KindStats` per operation as JSON
to ``result``. Exit status 0 whatever the errors: they are in the result.

Every load is checked byte for byte against :mod:`kvtier.bench.soak.data`; a wrong byte, a
record of another key, a malformed answer, any raised call, or any warning the client library
logs (it logs a block that failed its checksum before treating it as a miss) is an error. A
shorter prefix than asked is a miss: eviction is expected to take blocks away.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier_protocol.header import split_record

from kvtier.bench.soak.data import NS_ID, SIZES, Workload
from kvtier.client import AsyncClient

OPS = ("lookup", "save", "load", "load_into", "ping", "delete", "reconnect")
WEIGHTS = (34, 25, 20, 14, 3, 3, 1)
"""The mix, as engines call: lookups most, a save per prefill, loads on hits; a ping now and then
(the bare round trip under the same load, the floor of every other call); deletes of prefixes
other clients may be loading (a leased block must still read right after its delete); and
reconnects (close, connect again: hello, descriptors, mappings), so that anything a connection
leaks in the daemon or the client is multiplied over the run."""
TIERS = frozenset(("gpu", "host", "disk", "remote"))
MAX_SAMPLES = 5  # error messages kept per operation


@dataclass(slots=True)
class WorkerConfig:
    """What one worker process runs (the suite sends it as JSON)."""

    index: int
    unix: str  # "unix:/path" of the daemon
    tcp: str  # "tcp://host:port", for the TCP clients
    token: str
    clients: int  # clients in this process
    tcp_clients: int  # of which this many connect over TCP (payloads inline)
    prefixes: int
    blocks: int
    seed: int
    timeout_s: float
    result: str  # path of the JSON result


@dataclass(slots=True)
class KindStats:
    """What one operation did across this process's clients."""

    ops: int = 0
    errors: int = 0
    samples: list[str] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    blocks_asked: int = 0  # lookup / load / load_into: keys asked
    blocks_hit: int = 0  # ... and found (misses: the difference)
    stored: int = 0  # save outcomes
    exists: int = 0
    full: int = 0

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(what[:300])


class _Warnings(logging.Handler):
    """Counts what the client library warns about (checksum failures, reconnects, degraded calls)."""

    def __init__(self, stats: KindStats) -> None:
        super().__init__(logging.WARNING)
        self.stats = stats

    def emit(self, record: logging.LogRecord) -> None:
        self.stats.error(record.getMessage())


class Soak:
    """The clients of one process and the statistics they share."""

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.work = Workload(cfg.prefixes, cfg.blocks, cfg.seed)
        self.stats = {op: KindStats() for op in (*OPS, "client warnings")}

    async def _open(self, i: int) -> AsyncClient:
        cfg = self.cfg
        tcp = i < cfg.tcp_clients
        return await AsyncClient.connect(cfg.tcp if tcp else cfg.unix, token=cfg.token if tcp else None,
                                         client_name=f"soak-{cfg.index}-{i}", timeout_s=cfg.timeout_s)

    async def connect(self) -> list[AsyncClient]:
        return [await self._open(i) for i in range(self.cfg.clients)]

    async def run(self, clients: list[AsyncClient], seconds: float) -> list[AsyncClient]:
        """Run every client until ``seconds`` have passed; returns them (reconnects replace some)."""
        deadline = time.monotonic() + seconds
        return list(await asyncio.gather(*(self._loop(c, i, deadline) for i, c in enumerate(clients))))

    async def _loop(self, client: AsyncClient, i: int, deadline: float) -> AsyncClient:
        rng = random.Random(self.cfg.seed * 1_000_003 + self.cfg.index * 1009 + i)
        buffers = [bytearray(max(SIZES)) for _ in range(self.cfg.blocks)]
        clock = time.perf_counter
        while time.monotonic() < deadline:
            op = rng.choices(OPS, WEIGHTS)[0]
            p = self.work.pick(rng)
            stats = self.stats[op]
            blocks = self.work.blocks_of(p) if op == "save" else []  # the engine's data, built untimed
            start = clock()
            try:
                if op == "reconnect":
                    await client.close()
                    client = await self._open(i)
                    check = _no_check
                else:
                    check = await self._call(client, op, p, blocks, buffers)
                elapsed = clock() - start
                problem = check(stats)
            except Exception as exc:  # every failure of a call is what the soak counts
                stats.error(f"{type(exc).__name__}: {exc}")
                continue
            if problem:
                stats.error(problem)
                continue
            stats.ops += 1
            stats.latencies_ms.append(round(elapsed * 1e3, 4))
        return client

    async def _call(self, client: AsyncClient, op: str, p: int, blocks: list[tuple[bytes, bytes]],
                    buffers: list[bytearray]) -> Any:
        """Run one call; returns the check of its answer (run outside the timed span)."""
        keys = self.work.chain(p)
        if op == "lookup":
            r = await client.lookup(NS_ID, keys, degrade=False)
            return lambda st: _lookup_problem(st, r, len(keys))
        if op == "save":
            out = await client.save(NS_ID, blocks)
            return lambda st: _save_problem(st, out, len(keys))
        if op == "load":
            records = await client.load(NS_ID, keys, degrade=False)
            return lambda st: self._load_problem(st, p, keys, records)
        if op == "load_into":
            headers = await client.load_into(NS_ID, keys, buffers, degrade=False)
            return lambda st: self._into_problem(st, p, keys, headers, buffers)
        if op == "delete":
            deleted = await client.delete(NS_ID, keys)
            return lambda st: None if 0 <= deleted <= len(keys) else f"delete of {len(keys)} keys answered {deleted}"
        await client.ping()
        return _no_check

    def _load_problem(self, st: KindStats, p: int, keys: list[bytes], records: list[bytes]) -> str | None:
        st.blocks_asked += len(keys)
        if len(records) > len(keys):
            return f"load of {len(keys)} keys returned {len(records)} records"
        st.blocks_hit += len(records)
        for j, rec in enumerate(records):
            h, payload = split_record(rec)
            if h.chain_hash != keys[j] or not self.work.payload_ok(p, j, payload):
                return f"load: wrong bytes for block {j} of prefix {p} ({keys[j].hex()[:16]})"
        return None

    def _into_problem(self, st: KindStats, p: int, keys: list[bytes], headers: list[Any],
                      buffers: list[bytearray]) -> str | None:
        st.blocks_asked += len(keys)
        if len(headers) > len(keys):
            return f"load_into of {len(keys)} keys returned {len(headers)} headers"
        st.blocks_hit += len(headers)
        for j, h in enumerate(headers):
            view = memoryview(buffers[j])[:h.payload_len]
            if h.chain_hash != keys[j] or not self.work.payload_ok(p, j, view):
                return f"load_into: wrong bytes for block {j} of prefix {p} ({keys[j].hex()[:16]})"
        return None


def _no_check(st: KindStats) -> None:
    return None


def _lookup_problem(st: KindStats, r: Any, asked: int) -> str | None:
    st.blocks_asked += asked
    if not 0 <= r.num_hits <= asked or len(r.tiers) != r.num_hits or not set(r.tiers) <= TIERS:
        return f"lookup of {asked} keys answered {r}"
    st.blocks_hit += r.num_hits
    return None


def _save_problem(st: KindStats, out: list[str], asked: int) -> str | None:
    if len(out) != asked or not set(out) <= {"stored", "exists", "full"}:
        return f"save of {asked} blocks answered {out}"
    st.stored += out.count("stored")
    st.exists += out.count("exists")
    st.full += out.count("full")
    return None


def open_fds() -> int:
    """Descriptors this process holds now."""
    return len(os.listdir("/proc/self/fd"))


def shm_mappings() -> int:
    """Mappings of /dev/shm files in this process (the daemon's segments, while clients are open)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if " /dev/shm/" in line)


async def _main(cfg: WorkerConfig) -> dict[str, Any]:
    soak = Soak(cfg)
    logging.getLogger("kvtier.client").addHandler(_Warnings(soak.stats["client warnings"]))
    fds_before, maps_before = open_fds(), shm_mappings()
    clients = await soak.connect()
    print("ready", flush=True)
    go = sys.stdin.readline().split()  # "go SECONDS"; nothing else runs on this loop meanwhile
    seconds = float(go[1]) if len(go) == 2 and go[0] == "go" else 0.0
    clients = await soak.run(clients, seconds)
    for c in clients:
        await c.close()
    # Transports close on the loop's next iterations: wait until the descriptors and mappings are
    # back, or long enough that what is still open is a leak (the rows report it then).
    deadline = time.monotonic() + 30.0
    while (open_fds() > fds_before or shm_mappings() > maps_before) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return {"index": cfg.index, "kinds": {k: asdict(v) for k, v in soak.stats.items()},
            "fds_before": fds_before, "fds_after": open_fds(),
            "shm_maps_before": maps_before, "shm_maps_after": shm_mappings()}


def main() -> int:
    cfg = WorkerConfig(**json.loads(sys.stdin.readline()))
    result = asyncio.run(_main(cfg))
    with open(cfg.result, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
