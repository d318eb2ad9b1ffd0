"""`kvtier bench peers`: one save/load workload through kvtier and the stores users would pick instead.

Several client processes (``--clients``, see peers_pool for why processes) each save their own
blocks, then load them back, a batch of ``--blocks-per-call`` blocks per call, all starting
together, through:

  * ``shm``: kvtier's blocking client over the unix socket; payloads through the daemon's shared
    memory (reserve -> copy -> commit; acquire -> verified copy into the caller's buffer -> release);
  * ``tcp``: the same client over TCP on loopback (records inline in the frames);
  * ``redis``: Debian's redis-server, started by the bench on a free loopback port with persistence
    off, through redis-py with one pipeline (no MULTI) per call: SET on save, GET on load;
  * ``lmcache``: LMCache's CPU backend, in-process as LMCache runs it, in a subprocess of the venv
    that ``tools/lmcache-env.sh`` builds (found as ``--lmcache-env`` says; see peers_lmcache), so
    its rows come in every run where that venv exists; otherwise a note says how to build it.

Every engine stores the same bytes (a kvtier record: header + random payload). Throughput is
payload bytes of all clients over the window from the first client's start to the last one's end;
latency is per call (p50/p99 pooled over every client's calls). Each repetition runs every engine
in turn, the order rotated (``alternate()`` for more than two sides), after one untimed warm-up;
keys are deleted (untimed) after each run so every save stores new blocks.

Rows: per block size and op (save, load), for kvtier over shm and over TCP: throughput (GB/s),
p50 and p99 latency (ms), each with Redis as the baseline (ratio > 1: kvtier ahead). Without
redis-server or redis-py the kvtier figures still come, the baseline NaN and named for the reason.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.bench.peers import lmcache as peers_lmcache
from kvtier.bench.daemon import BenchDaemon
from kvtier.bench.peers.pool import RunFigures, WorkerPool
from kvtier.bench.redis_server import RedisServer, RedisUnavailable
from kvtier.bench.report import Row, Samples, SuiteResult, latency_row, progress, throughput_row

DESCRIPTION = "save/load workload through kvtier (shm, TCP) vs Redis and LMCache, several clients"
MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench peers").digest()[:16]
HEADER_SLACK = 4096  # per block: record header plus allocator rounding in the daemon
OPS = ("save", "load")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mib", default=None,
                        help="block sizes in MiB (default 0.25,1,8,32; --quick 0.25,8)")
    parser.add_argument("--clients", type=int, default=None,
                        help="concurrent client processes (default 4; --quick 2)")
    parser.add_argument("--blocks-per-call", type=int, default=2,
                        help="blocks per save/load call: one kvtier call, one Redis pipeline (default 2)")
    parser.add_argument("--working-set-mib", type=float, default=None,
                        help="bytes each client saves and loads per run and size (default 64; --quick 8)")
    parser.add_argument("--min-calls", type=int, default=None,
                        help="at least this many calls per client and run (default 6; --quick 2)")
    parser.add_argument("--redis-server", default="redis-server",
                        help="the redis-server executable (default: redis-server on PATH)")
    parser.add_argument("--work-dir", default=None,
                        help="parent of the daemon's and Redis's temp dirs (default $TMPDIR)")
    parser.add_argument("--daemon-profile", metavar="FILE", default=None,
                        help="run the daemon under cProfile and write its stats to FILE")
    parser.add_argument("--lmcache-env", metavar="DIR", default=None,
                        help=f"the venv LMCache runs in (tools/lmcache-env.sh DIR builds it; default "
                             f"${peers_lmcache.ENV_VAR}, else {peers_lmcache.DEFAULT_ENV} in the checkout)")


def _plan(size: int, ws: int, per_call: int, min_calls: int) -> int:
    """Blocks per client for one size: the working set, at least ``min_calls`` whole calls."""
    calls = max(min_calls, math.ceil(ws / (size * per_call)))
    return calls * per_call


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (2 if args.quick else 5)
    sizes = [int(float(x) * MIB) for x in (args.sizes_mib or ("0.25,8" if args.quick else "0.25,1,8,32")).split(",")
             if x.strip()]
    clients = args.clients or (2 if args.quick else 4)
    per_call = args.blocks_per_call
    ws = int((args.working_set_mib or (8 if args.quick else 64)) * MIB)
    min_calls = args.min_calls or (2 if args.quick else 6)
    plan = {size: _plan(size, ws, per_call, min_calls) for size in sizes}
    held = max(clients * n * (size + HEADER_SLACK) for size, n in plan.items())
    result = SuiteResult("peers")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=args.work_dir))
    daemon = BenchDaemon(work, ["--listen", "127.0.0.1:0", "--rest", "off", "--host-bytes", str(2 * held + 64 * MIB),
                                "--disk-bytes", "0", "--token-file", str(work / "token")],
                         suite="peers", profile=args.daemon_profile)
    redis = RedisServer(args.redis_server, args.work_dir)
    pool: WorkerPool | None = None
    lmc: peers_lmcache.LMCachePeer | None = None
    try:
        daemon.start()
        engines: dict[str, dict[str, Any]] = {
            "shm": {"kind": "kvtier", "address": daemon.address},
            "tcp": {"kind": "kvtier", "address": daemon.tcp, "token": daemon.token()},
        }
        base_name = "redis"
        try:
            redis.start()
            engines["redis"] = {"kind": "redis", "host": "127.0.0.1", "port": redis.port}
            base_name = f"redis {redis.server_version()} (redis-py {redis.client_version})"
        except RedisUnavailable as exc:
            base_name = "redis (unavailable)"
            progress(f"peers: NOTE: no Redis baseline: {exc}. The kvtier rows follow with a NaN baseline.")
        lmc = peers_lmcache.open_peer(held, args.lmcache_env)
        if not lmc.usable:
            progress(f"peers: NOTE: no LMCache rows: {lmc.reason}")
        pool = WorkerPool(clients, engines, NS)
        for size in sizes:
            label = f"{size / MIB:g}MiB"
            progress(f"peers: {label} blocks: {clients} clients x {plan[size]} blocks, {per_call} per call, "
                     f"{reps} repetitions of {', '.join(engines)}{', lmcache' if lmc.usable else ''}")
            pool.prepare(size, plan[size], per_call)
            runs = {name: _runner(pool, name) for name in engines}
            if lmc.usable:
                runs["lmcache"] = lmc.runner(NS, clients, size, plan[size], per_call)
            figures = _rotate(runs, reps)
            result.rows += _rows(label, figures, base_name, lmc.name)
    except Exception:
        progress(f"peers: failed; the daemon's log ends with:\n{daemon.log_tail()}")
        raise
    finally:
        if pool is not None:
            pool.close()
        if lmc is not None:
            lmc.close()  # its subprocess and arena (as big as the kvtier working set) go now
        daemon.stop()
        redis.stop()
        shutil.rmtree(work, ignore_errors=True)
    return result


Figures = dict[str, dict[str, list[RunFigures]]]  # engine -> op -> one entry per repetition


def _runner(pool: WorkerPool, engine: str) -> Callable[[], dict[str, RunFigures]]:
    def once() -> dict[str, RunFigures]:
        out = {op: pool.run(engine, op) for op in OPS}
        pool.delete(engine)  # untimed: the next run saves new blocks again
        return out
    return once


def _rotate(runs: dict[str, Callable[[], dict[str, RunFigures]]], reps: int, warmup: int = 1) -> Figures:
    """Every engine once per repetition, the order rotated each time so none always runs first
    (``report.alternate`` generalized to more than two sides); warm-up runs are not kept."""
    names = list(runs)
    for _ in range(warmup):
        for name in names:
            runs[name]()
    figures: Figures = {name: {op: [] for op in OPS} for name in names}
    for i in range(reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            for op, fig in runs[name]().items():
                figures[name][op].append(fig)
    return figures


def _rows(label: str, figures: Figures, base_name: str, lmcache_name: str) -> list[Row]:
    def samples(engine: str, op: str, attr: str) -> Samples:
        return Samples([getattr(f, attr) for f in figures.get(engine, {}).get(op, [])])

    def nan_if_empty(s: Samples) -> Samples:
        return s if s.values else Samples([math.nan])

    rows: list[Row] = []
    pairs = [("shm", "redis", base_name), ("tcp", "redis", base_name)]
    if "lmcache" in figures:
        pairs.append(("shm", "lmcache", lmcache_name))
    for kv, base, name in pairs:
        for op in OPS:
            case = f"{kv} {op} {label}" + (" vs lmcache" if base == "lmcache" else "")
            rows.append(throughput_row(case, "throughput", "GB/s", samples(kv, op, "gbps"), name,
                                       nan_if_empty(samples(base, op, "gbps"))))
            for metric, attr in (("p50", "p50_ms"), ("p99", "p99_ms")):
                rows.append(latency_row(case, metric, "ms", samples(kv, op, attr), name,
                                        nan_if_empty(samples(base, op, attr))))
    return rows


__all__ = ["DESCRIPTION", "add_arguments", "run"]
