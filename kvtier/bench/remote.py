"""`kvtier bench remote`: the remote tier's upload and fetch vs plain redis-py on the same cluster.

The same workload both ways, alternating in one run: ``--clients`` processes each own a share of
a ``--working-set-mib`` working set of whole block records of ``--sizes-mib`` (2 and 8 MiB), and
upload it all, then fetch it all, at once:

* **kvtier**: :class:`~kvtier.daemon.remote.redis_cluster.RedisClusterBlocks`, what each daemon's
  store uses (keys sorted by slot, pipelines of ``batch_keys``, ``parallel`` of them in flight,
  one deadline per call, GETs read by :mod:`kvtier.daemon.remote.resp_get` straight into each
  value's buffer), and every fetched record verified as the daemon does
  (:func:`~kvtier.daemon.remote.verify.verify_record`: header, key, payload xxh3);
* **baseline**: redis-py's asyncio ``RedisCluster``, one pipeline of plain ``SET`` / ``GET`` per
  client (redis-py splits it per node and sends to the nodes concurrently), nothing verified.

A row's figure is the working set's bytes over the wall time from the first client's start to
the last one's end (GB/s, decimal).

Precision by tier (``--codecs``, default ``int8,int8+lz4``; ``none`` skips it): the same clients
upload and fetch KV-like bfloat16 records (Llama-3-8B-shaped: 32 layers, 8 KV heads of 128, the
block size's tokens; the values of :func:`kvtier.bench.precision._kv`) through kvtier's cluster
client, once raw and once with a lossy remote tier's work added: **upload** = the re-encode a
daemon's remote link runs before it uploads
(:func:`~kvtier.daemon.store.transfers.recode_verified`: verified copy, encode, verified payload)
then the put; **fetch** = get, verify, and decode every record to bfloat16 as an engine's
connector does (:func:`kvtier_protocol.block.decode_block`; for raw records a view). Rows
``upload <codec>`` and ``fetch + decode <codec>`` (GB/s of the raw KV moved) next to the raw
records' same path, and ``record bytes <codec>`` (bytes that crossed the network per raw byte).
So lz4's worth on the remote tier is its row next to int8's.

Cross-host TTFT (``--ttft-tokens``, 4096; 0 skips it): two daemons share only the cluster ("host A"
and "host B": separate processes, sockets and local tiers, on this machine); the reference
engine on A prefills a prompt's prefix (a fresh one per repetition), A uploads it, and the
reference engine on B answers the whole prompt loading that prefix from the remote tier (B's
local tiers never held it), next to the same engine computing every token. The row's ratio is
prefill / hit; a ``bytes per token`` row reports what crossed the network per stored token
(record bytes fetched by B) next to the model's raw bf16 KV bytes per token (its ratio: raw /
fetched, below 1 by the headers' share). The checkpoint is ttft's random one (8 layers, hidden 1024;
``--quick``: 2 layers, hidden 128). The cluster is ``--cluster URL`` (seed nodes, as ``--remote``),
or a private one this suite starts on loopback: 3 masters + 3 replicas of Debian's
``redis-server`` (persistence off, ``allkeys-lru``), stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.bench.report import Row, Samples, SuiteResult, alternate, gbps, progress, throughput_row

DESCRIPTION = "remote tier (Redis Cluster): kvtier's upload/fetch vs plain redis-py RedisCluster pipelines"
MiB = 1 << 20
TIER_CODECS: dict[str, tuple[str, str | None]] = {
    "int8": ("int8", None),
    "int8/token": ("int8", None),
    "int8+lz4": ("int8", "lz4"),
}
"""``--codecs`` names: (codec, compression) of a remote tier; ``/token``: ``k_axis = "token"``."""
KV_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2
"""Bytes of one token of the precision rows' KV (Llama-3-8B-shaped, bfloat16): 128 KiB."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="URL", default=None,
                        help="redis+cluster://HOST:PORT[,...] to use (default: start 3 masters + 3 replicas on "
                             "loopback)")
    parser.add_argument("--sizes-mib", default=None, help="block sizes in MiB, comma-separated (default 2,8; "
                                                          "--quick 2)")
    parser.add_argument("--working-set-mib", type=int, default=None, help="bytes of records per size "
                                                                         "(default 256; --quick 16)")
    parser.add_argument("--clients", type=int, default=None, help="client processes (default 4; --quick 2)")
    parser.add_argument("--batch", type=int, default=8, help="kvtier's commands per pipeline (default 8)")
    parser.add_argument("--codecs", default=None,
                        help="lossy remote tiers measured against raw records, comma-separated, of "
                             + ", ".join(TIER_CODECS) + " (default int8,int8+lz4; --quick int8; none: skip)")
    parser.add_argument("--ttft-tokens", type=int, default=None,
                        help="prompt tokens of the cross-host TTFT rows (default 4096; --quick 256; 0: skip them)")


# --- a private cluster on loopback -----------------------------------------------------------------


class LoopbackCluster:
    """3 masters + 3 replicas of ``redis-server`` on free loopback ports, persistence off."""

    def __init__(self, nodes: int = 6) -> None:
        self.ports: list[int] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.work = Path(tempfile.mkdtemp(prefix="kvtier-bench-cluster-"))
        self.nodes = nodes

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self, timeout_s: float = 60.0) -> None:
        """Raises RuntimeError when redis-server / redis-cli are missing or the cluster does not form."""
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise RuntimeError("redis-server and redis-cli are needed (Debian: apt-get install redis-server)")
        try:
            self._start(server, cli, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, server: str, cli: str, timeout_s: float) -> None:
        for _ in range(self.nodes):
            port = _free_pair()
            d = self.work / str(port)
            d.mkdir()
            self.ports.append(port)
            self.procs.append(subprocess.Popen(
                [server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "2000",
                 "--dir", str(d), "--save", "", "--appendonly", "no", "--maxmemory", "2gb",
                 "--maxmemory-policy", "allkeys-lru", "--repl-diskless-sync-delay", "0",
                 "--cluster-require-full-coverage", "no", "--logfile", str(d / "redis.log")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        for port, proc in zip(self.ports, self.procs):
            while subprocess.run([cli, "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
                if proc.poll() is not None or time.monotonic() > deadline:
                    log = self.work / str(port) / "redis.log"
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server on port {port} did not start:\n{tail}")
                time.sleep(0.05)
        subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
                        "1", "--cluster-yes"], capture_output=True, check=True, timeout=timeout_s)
        while not all(self._ok(cli, p) for p in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the bench cluster did not reach cluster_state:ok with every replica synced")
            time.sleep(0.1)

    @staticmethod
    def _ok(cli: str, port: int) -> bool:
        info = subprocess.run([cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout
        repl = subprocess.run([cli, "-p", str(port), "info", "replication"], capture_output=True, text=True).stdout
        return "cluster_state:ok" in info and ("role:master" in repl or "master_link_status:up" in repl)

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        self.procs = []
        shutil.rmtree(self.work, ignore_errors=True)


def _free_pair() -> int:
    """A loopback port that is free, and whose cluster-bus port (+10000) is free too."""
    for _ in range(200):
        port = random.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
            return port
        except OSError:
            continue
    raise RuntimeError("no free loopback port pair for a cluster node")


# --- the client processes --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Job:
    """One phase of one client: ``kind`` kvtier or plain, ``op`` upload or fetch."""

    kind: str
    op: str
    url: str
    size: int
    blocks: int
    client: int
    batch: int
    codec: str = ""
    """``kind == "kvtier-kv"`` only: ``"raw"`` or a :data:`TIER_CODECS` name."""


_LOOP: asyncio.AbstractEventLoop | None = None
_CLIENTS: dict[tuple[str, str], Any] = {}
_DATA: dict[tuple[int, int, int], list[tuple[Any, bytes]]] = {}


def _records(size: int, blocks: int, client: int) -> list[tuple[Any, bytes]]:
    """This client's records of ``size`` payload bytes: (RemoteKey, whole record), made once."""
    key = (size, blocks, client)
    if key not in _DATA:
        from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum
        from kvtier_protocol.namespace import Namespace

        from kvtier.daemon.remote.backend import RemoteKey

        head_dim = size // (4 * 2 * 16 * 2)
        ns = Namespace(model="bench-remote", revision="r1", attention="mha", num_layers=4, num_kv_heads=1,
                       head_dim=head_dim, block_tokens=16, hash_tokens=16)
        rng = random.Random(client * 7919 + size)
        out = []
        for i in range(blocks):
            chain = rng.randbytes(32)
            payload = os.urandom(size)
            header = BlockHeader(ns_id=ns.ns_id, chain_hash=chain, parent_hash=None, num_tokens=16,
                                 layout="canonical", shape=(4, 2, 1, 16, head_dim), dtype=ns.kv_dtype, codec="raw",
                                 sections=(Section("payload", 0, size),), payload_len=size,
                                 checksum=payload_checksum(payload))
            out.append((RemoteKey("bench", ns.ns_id, chain), encode_header(header) + payload))
        _DATA[key] = out
    return _DATA[key]


def _kv_records(size: int, blocks: int, client: int) -> list[tuple[Any, bytes, memoryview]]:
    """This client's raw bfloat16 KV records of ``size`` payload bytes, Llama-3-8B-shaped
    ``[32, 2, 8, T, 128]``: (RemoteKey, header, payload), made once."""
    key = (-size, blocks, client)
    if key not in _DATA:
        from kvtier_protocol.block import encode_block
        from kvtier_protocol.header import split_record
        from kvtier_protocol.namespace import Namespace

        from kvtier.bench.precision import _kv
        from kvtier.daemon.remote.backend import RemoteKey

        tokens = size // (32 * 2 * 8 * 128 * 2)
        assert tokens * 32 * 2 * 8 * 128 * 2 == size, "checked by run(): a whole number of tokens"
        ns = Namespace(model="bench-remote-kv", revision="r1", attention="mha", num_layers=32, num_kv_heads=8,
                       head_dim=128, block_tokens=tokens, hash_tokens=tokens)
        rng = random.Random(client * 7919 + size)
        values = [_kv((32, 2, 8, tokens, 128), seed=client * 8 + i) for i in range(4)]  # shared, as in precision
        out = []
        for i in range(blocks):
            chain = rng.randbytes(32)
            record = encode_block(values[i % len(values)], ns_id=ns.ns_id, chain_hash=chain, parent_hash=None,
                                  layout="canonical", codec="raw")
            h, payload = split_record(record)
            out.append((RemoteKey("bench", ns.ns_id, chain), bytes(record[:len(record) - h.payload_len]), payload))
        _DATA[key] = out  # type: ignore[assignment]
    return _DATA[key]  # type: ignore[return-value]


def _client(job: Job) -> Any:
    found = _CLIENTS.get((job.kind, job.url))
    if found is None:
        if job.kind in ("kvtier", "kvtier-kv"):
            from kvtier.daemon.remote.redis_cluster import RedisClusterBlocks, RedisClusterSettings

            found = RedisClusterBlocks(RedisClusterSettings(job.url, timeout_s=120.0, prefix="kvtbench",
                                                            batch_keys=job.batch))
        else:
            from redis.asyncio.cluster import ClusterNode, RedisCluster

            from kvtier.daemon.remote.address import parse_cluster_url

            nodes = [ClusterNode(h, p) for h, p in parse_cluster_url(job.url).nodes]
            found = RedisCluster(startup_nodes=nodes, decode_responses=False, socket_timeout=120.0)
        _CLIENTS[(job.kind, job.url)] = found
    return found


def run_job(job: Job) -> tuple[float, float]:
    """Run one phase in this worker process; its (start, end) wall-clock times."""
    global _LOOP
    if _LOOP is None:
        _LOOP = asyncio.new_event_loop()
    client = _LOOP.run_until_complete(_connected(job))
    if job.kind == "kvtier-kv":
        kv = _kv_records(job.size, job.blocks, job.client)
        start = time.time()
        _LOOP.run_until_complete(_kv_phase(job, client, kv))
        return start, time.time()
    items = _records(job.size, job.blocks, job.client)
    start = time.time()
    _LOOP.run_until_complete(_phase(job, client, items))
    return start, time.time()


_SENT: dict[tuple[int, str], int] = {}
"""Record bytes the last ``kvtier-kv`` upload of (size, codec) put, in this worker."""


def record_bytes(size: int, codec: str) -> int:
    """Record bytes this worker's last upload of ``size`` blocks with ``codec`` put (a pool job)."""
    return _SENT[(size, codec)]


async def _kv_phase(job: Job, client: Any, kv: list[tuple[Any, bytes, memoryview]]) -> None:
    """Upload (re-encoding first unless raw) or fetch + verify + decode of this client's KV records."""
    from kvtier_protocol.block import decode_block
    from kvtier_protocol.header import decode_header

    from kvtier.daemon.remote.verify import verify_record
    from kvtier.daemon.store.disk_io import BufferPool
    from kvtier.daemon.store.transfers import recode_verified

    if job.op == "upload":
        if job.codec == "raw":
            records = [header + bytes(payload) for _, header, payload in kv]
        else:
            codec, compression = TIER_CODECS[job.codec]
            k_axis = "token" if job.codec.endswith("/token") else "channel"
            pool = BufferPool()
            # what the daemon's remote link runs on its I/O pool before an upload
            items = [(header, payload, decode_header(header)[0].checksum, 0, codec) for _, header, payload in kv]
            recoded = await asyncio.to_thread(recode_verified, items, k_axis, compression, pool)
            records = []
            for rec in recoded:
                assert rec is not None and rec.lossy, "KV-like values re-encode"
                records.append(rec.header + bytes(rec.payload))
                pool.give_back(rec.payload)
        ok = await client.put([(key, record) for (key, _, _), record in zip(kv, records)])
        if not all(ok):
            raise RuntimeError(f"kvtier: {ok.count(False)} uploads not acknowledged")
        _SENT[(job.size, job.codec)] = sum(len(r) for r in records)
        return
    got = await client.get([key for key, _, _ in kv])
    for (key, _, _), value in zip(kv, got):
        if value is None:
            raise RuntimeError(f"kvtier: a fetched record missing (errors: {client.counters.errors})")
        verdict = verify_record(key, value)
        if not verdict.ok:
            raise RuntimeError(f"kvtier: a fetched record not the block asked for: {verdict.reason} {verdict.detail}")
        decode_block(value, verify=False)  # verified above; the tensor an engine's connector gets


def _codec_rows(pool: ProcessPoolExecutor, url: str, size: int, clients: int, batch: int, reps: int,
                codecs: list[str], working_set: int) -> list[Any]:
    """Rows of the precision-by-tier part for one block size (see the module docstring)."""
    per_client = max(1, working_set // size // clients)
    nbytes = per_client * clients * size

    def phase(op: str, codec: str) -> float:
        jobs = [Job("kvtier-kv", op, url, size, per_client, c, batch, codec) for c in range(clients)]
        spans = list(pool.map(run_job, jobs))
        return gbps(nbytes, max(e for _, e in spans) - min(s for s, _ in spans))

    def sent(codec: str) -> int:
        return sum(pool.map(record_bytes, [size] * clients, [codec] * clients))

    case = f"{size // MiB} MiB KV blocks, {nbytes // MiB} MiB, {clients} clients"
    rows: list[Any] = []
    for codec in codecs:
        progress(f"remote: {case}: upload and fetch, {codec} vs raw")
        # Raw and lossy records of a block share its key: each fetch reads what the upload just
        # before it put, so the two ways take turns, upload then fetch, after one warm-up round.
        timed: dict[tuple[str, str], list[float]] = {}
        for r in range(reps + 1):
            for way in ((codec, "raw") if r % 2 else ("raw", codec)):
                for op in ("upload", "fetch"):
                    figure = phase(op, way)
                    if r:
                        timed.setdefault((op, way), []).append(figure)
        raw_bytes, coded_bytes = sent("raw"), sent(codec)
        rows.append(throughput_row(case, f"upload {codec}", "GB/s", Samples(timed[("upload", codec)]),
                                   "raw records, same path", Samples(timed[("upload", "raw")])))
        rows.append(throughput_row(case, f"fetch + decode {codec}", "GB/s", Samples(timed[("fetch", codec)]),
                                   "raw records, same path", Samples(timed[("fetch", "raw")])))
        rows.append(Row(case, f"record bytes {codec}", "bytes/raw byte", coded_bytes / nbytes, "raw records",
                        raw_bytes / nbytes, raw_bytes / coded_bytes))
    return rows


async def _connected(job: Job) -> Any:
    client = _client(job)
    if job.kind == "plain":
        await client.initialize()
    return client


async def _phase(job: Job, client: Any, items: list[tuple[Any, bytes]]) -> None:
    if job.kind == "kvtier":
        from kvtier.daemon.remote.verify import verify_record

        if job.op == "upload":
            ok = await client.put(items)
            if not all(ok):
                raise RuntimeError(f"kvtier: {ok.count(False)} uploads not acknowledged")
        else:
            got = await client.get([k for k, _ in items])
            for (key, _), value in zip(items, got):
                if value is None:
                    raise RuntimeError(f"kvtier: a fetched record missing (errors: {client.counters.errors})")
                verdict = verify_record(key, value)
                if not verdict.ok:
                    raise RuntimeError(f"kvtier: a fetched record not the block asked for: {verdict.reason} "
                                       f"{verdict.detail}")
        return
    keys = [f"plainbench:{job.client}:{i}".encode() for i in range(len(items))]
    pipe = client.pipeline()
    for key, (_, record) in zip(keys, items):
        if job.op == "upload":
            pipe.set(key, record)
        else:
            pipe.get(key)
    replies = await pipe.execute()
    if job.op == "fetch" and any(r is None for r in replies):
        raise RuntimeError("plain: a GET came back empty")


# --- the suite -------------------------------------------------------------------------------------


def _ttft_rows(url: str, tokens: int, reps: int, *, quick: bool) -> list[Any]:
    """Cross-host TTFT rows: a hit on B through the remote tier vs B computing every token."""
    import torch

    from kvtier.bench.daemon import BenchDaemon
    from kvtier.bench.report import Samples, latency_row
    from kvtier.bench.ttft import BENCH_MODEL, ONE, QUICK_MODEL, _engine_ttft
    from kvtier.client import Client
    from kvtier.engine.checkpoint import make_random_checkpoint
    from kvtier.engine.engine import Engine

    cfg = QUICK_MODEL if quick else BENCH_MODEL
    work = Path(tempfile.mkdtemp(prefix="kvr-"))  # short: unix socket paths
    try:
        make_random_checkpoint(work / "model", cfg, seed=0, dtype=torch.bfloat16)
        # A generous lookup budget: this figure is about loading, and a loaded bench machine
        # answers a lookup of thousands of keys slower than the 10 ms default.
        (work / "remote.toml").write_text("[remote]\nlookup_budget_ms = 500.0\n")
        flags = ["--config", str(work / "remote.toml"), "--remote", url, "--disk-bytes", "0", "--rest", "off",
                 "--host-bytes", "1GiB"]
        a = BenchDaemon(work / "a", flags, suite="remote")
        b = BenchDaemon(work / "b", flags, suite="remote")
        (work / "a").mkdir()
        (work / "b").mkdir()
        stored = (tokens - 1) // 16 * 16
        kw: dict[str, Any] = dict(dtype=torch.bfloat16, max_step_tokens=tokens)
        hits: list[float] = []
        fulls: list[float] = []
        crossed = 0
        with a.running(), b.running(), Client(a.address) as ca, Client(b.address) as cb:
            with Engine(work / "model", kvtier_address=a.address, **kw) as ea, \
                    Engine(work / "model", kvtier_address=b.address, **kw) as eb, Engine(work / "model", **kw) as plain:
                for k in range(reps + 1):  # the first round warms up both engines
                    prompt = torch.randint(0, cfg.vocab_size, (tokens,),
                                           generator=torch.Generator().manual_seed(1000 + k)).tolist()
                    progress(f"remote: TTFT {tokens} tokens, round {k}: prefill on A, upload")
                    ea.generate([prompt[:stored]], ONE)
                    ea.flush()
                    want = stored // 16
                    while True:  # A's uploads acknowledged (the engine saved every full block)
                        r = ca.stats()["remote"]
                        if r["uploaded"] >= want * (k + 1) and r["queue_blocks"] == 0:
                            break
                        time.sleep(0.05)
                    down = cb.stats()["remote"]["bytes_down"]
                    eb.reset_prefix_cache()
                    t_hit, out = _engine_ttft(eb, prompt)
                    if out.loaded_tokens != stored:
                        raise RuntimeError(f"the hit on B loaded {out.loaded_tokens} of {stored} tokens: "
                                           f"{cb.stats()['remote']}")
                    plain.reset_prefix_cache()
                    t_full, ref = _engine_ttft(plain, prompt)
                    if not torch.equal(out.first_logits, ref.first_logits):
                        raise RuntimeError("the hit on B gave other logits than a full prefill")
                    if k:
                        hits.append(t_hit)
                        fulls.append(t_full)
                        crossed = cb.stats()["remote"]["bytes_down"] - down
    finally:
        shutil.rmtree(work, ignore_errors=True)
    case = f"cross-host TTFT {tokens} tokens ({stored} on the remote tier)"
    rows = [latency_row(case, "TTFT", "ms", Samples(hits), "engine prefill on B (no kvtier)", Samples(fulls))]
    raw = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V of one token
    rows.append(latency_row(case, "bytes per token fetched", "B", Samples([crossed / stored]),
                            "raw bf16 KV bytes per token", Samples([float(raw)])))
    return rows


def run(args: argparse.Namespace) -> SuiteResult:
    sizes = [int(float(s) * MiB) for s in (args.sizes_mib or ("2" if args.quick else "2,8")).split(",")]
    working_set = (args.working_set_mib or (16 if args.quick else 256)) * MiB
    clients = args.clients or (2 if args.quick else 4)
    reps = args.repetitions or (1 if args.quick else 5)
    spec = args.codecs or ("int8" if args.quick else "int8,int8+lz4")
    codecs = [] if spec == "none" else [c.strip() for c in spec.split(",") if c.strip()]
    for c in codecs:
        if c not in TIER_CODECS:
            raise SystemExit(f"unknown codec {c!r}; choose from {', '.join(TIER_CODECS)} or none")
    cluster = None
    url = args.cluster
    if url is None:
        cluster = LoopbackCluster()
        progress("remote: starting a loopback cluster of 3 masters + 3 replicas")
        cluster.start()
        url = cluster.url
    result = SuiteResult("remote")
    pool = ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn"))
    try:
        for size in sizes:
            per_client = max(1, working_set // size // clients)
            nbytes = per_client * clients * size

            def phase(kind: str, op: str, size: int = size, per_client: int = per_client, nbytes: int = nbytes) -> float:
                jobs = [Job(kind, op, url, size, per_client, c, args.batch) for c in range(clients)]
                spans = list(pool.map(run_job, jobs))
                return gbps(nbytes, max(e for _, e in spans) - min(s for s, _ in spans))

            case = f"{size // MiB} MiB blocks, {nbytes // MiB} MiB, {clients} clients"
            base = f"redis-py RedisCluster pipeline SET/GET, {clients} clients"
            progress(f"remote: {case}: upload")
            up_k, up_b = alternate(lambda: phase("kvtier", "upload"), lambda: phase("plain", "upload"),
                                   repetitions=reps)
            progress(f"remote: {case}: fetch")
            down_k, down_b = alternate(lambda: phase("kvtier", "fetch"), lambda: phase("plain", "fetch"),
                                       repetitions=reps)
            result.rows.append(throughput_row(case, "upload", "GB/s", up_k, base, up_b))
            result.rows.append(throughput_row(case, "fetch (verified)", "GB/s", down_k, base, down_b))
            if codecs and size % KV_TOKEN_BYTES == 0:
                result.rows += _codec_rows(pool, url, size, clients, args.batch, reps, codecs, working_set)
            elif codecs:
                progress(f"remote: {size} B is not a whole number of Llama-3-8B tokens "
                         f"({KV_TOKEN_BYTES} B): no precision rows at this size")
        tokens = args.ttft_tokens if args.ttft_tokens is not None else (256 if args.quick else 4096)
        if tokens:
            result.rows += _ttft_rows(url, tokens, reps, quick=args.quick)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if cluster is not None:
            cluster.stop()
    return result
