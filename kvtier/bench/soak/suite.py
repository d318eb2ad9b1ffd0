"""`kvtier bench soak`: many clients of mixed lookup/save/load against one daemon at full capacity.

A real ``kvtier serve`` subprocess with small tiers (host ``--host-mib`` in segments of 64 MiB,
disk ``--disk-mib``; REST and TCP on 127.0.0.1) is first filled past both tiers, so that from
the first measured second every new block evicts one from host memory and every demotion evicts
one from disk. Then ``--clients`` clients run for ``--seconds`` in a closed loop (no think time)
over a working set ``--working-set`` times the two tiers together: lookup, save, load,
load_into, ping, delete and reconnect on 4-block prefixes (64-256 KiB blocks), hot prefixes more
often than cold ones (mix and data: :mod:`kvtier.bench.soak.worker`, :mod:`kvtier.bench.soak.data`);
1 in 8 clients over TCP (payloads inline), the others on the unix socket (payloads through the
host tier's shared memory, under leases).

Clients: ``--processes`` worker processes (default: one per CPU, at most 4), each running its
share of the clients as asyncio clients on one event loop (:mod:`kvtier.bench.soak.worker`).
The daemon is one asyncio process (plus its disk threads); a worker process's clients share one
interpreter and so one core at most. Threads would add GIL hand-offs without adding cores, and a
process per client (64 interpreters on 2 cores) would measure the scheduler. One asyncio process
per core gives each of the 64 clients its own connection, segment mappings and leases, keeps one
request in flight per client as an engine does, and lets the clients' side (building records,
checking every loaded byte) take what the daemon leaves of the cores, without starving it. The
latencies are what the caller sees: they include waiting for the worker's own event loop.

Rows (the JSON form of kvtier.bench.report). Invariants have the baseline ``must be 0`` and
ratio 1.0 when they hold, 0.0 when they do not; bounds have ratio bound / value (>= 1 holds);
count rows have ratio kvtier / baseline.

* per operation (lookup, save, load, load_into, ping, delete, reconnect): operations and errors;
  ops/s (baseline: all operations); p50/p99 latency next to a ping under the same load (ping
  itself: next to a ping of the idle daemon); blocks hit of blocks asked (lookup, load,
  load_into); blocks stored / exists / full (save).
* errors of all operations (a wrong byte, a raised call, a client warning), daemon checksum
  failures, storage errors, ERROR lines in its log, lease expiries, leases and reservations still
  open afterwards, daemon descriptors leaked (sockets, shm, pipes, anon inodes, deleted files;
  the disk tier's RocksDB files follow compactions and are shown, not compared), client
  descriptors and mappings leaked, /dev/shm segments left after the daemon stopped, its exit status.
* daemon RSS peak (``VmHWM``, see :mod:`kvtier.bench.soak.proc` for what it includes) against
  its idle private RSS + 1.1 x the RAM tiers + the disk tier's RAM + one request's payload per
  client (:meth:`kvtier.bench.soak.rows.Figures.rss_bound`); its shared-memory part against the
  host tier.
* eviction: seconds of the window with host / disk evictions, and blocks evicted per tier.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.daemon import BenchDaemon, child_env
from kvtier.bench.report import SuiteResult, progress
from kvtier.bench.soak.data import NS_ID, SIZES, Workload
from kvtier.bench.soak.proc import Sampler, fd_census, memory, rest_stats, shm_segments
from kvtier.bench.soak.rows import Figures, rows, violations
from kvtier.bench.soak.worker import WorkerConfig
from kvtier.client import Client
from kvtier.daemon.store.disk_ram import ram_budget

DESCRIPTION = "many clients of mixed lookup/save/load at full capacity: errors, RSS, leaks"
MIB = 1 << 20
SEGMENT_MIB = 64
_REST = re.compile(r"kvtierd rest (?P<url>http://\S+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, default=None, help="concurrent clients (default 64; --quick 8)")
    parser.add_argument("--seconds", type=float, default=None, help="measured seconds (default 60; --quick 5)")
    parser.add_argument("--processes", type=int, default=None,
                        help="client processes (default: CPUs, at most 4, at most --clients)")
    parser.add_argument("--tcp-clients", type=int, default=None, help="clients over TCP (default clients/8)")
    parser.add_argument("--host-mib", type=int, default=None,
                        help="host tier MiB (default 1024; --quick 64). The RSS bound counts the disk "
                             "tier's buffers and one request's payload per client by name; 10 %% of the "
                             "tier covers the rest of the daemon's working memory only from ~64 MiB up")
    parser.add_argument("--disk-mib", type=int, default=None, help="disk tier MiB (default 512; --quick 128)")
    parser.add_argument("--working-set", type=float, default=2.0,
                        help="working set as a multiple of host + disk tiers (default 2)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="client call timeout (default 10)")
    parser.add_argument("--seed", type=int, default=1, help="workload seed (default 1)")
    parser.add_argument("--work-dir", default=None, help="parent of the daemon's temp dir (default $TMPDIR)")
    parser.add_argument("--daemon-profile", metavar="FILE", default=None,
                        help="run the daemon under cProfile and write its stats to FILE")


@dataclass(slots=True)
class Plan:
    """The sizes of one soak run, resolved from the flags."""

    clients: int
    seconds: float
    processes: int
    tcp_clients: int
    host_bytes: int
    disk_bytes: int
    work: Workload
    timeout_s: float
    profile: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Plan:
        clients = args.clients or (8 if args.quick else 64)
        host = (args.host_mib or (64 if args.quick else 1024)) * MIB
        disk = (args.disk_mib or (128 if args.quick else 512)) * MIB
        processes = args.processes or min(4, os.cpu_count() or 1)
        tcp = args.tcp_clients if args.tcp_clients is not None else clients // 8
        if clients < 1 or not 0 <= tcp <= clients or args.working_set <= 1:
            raise SystemExit("soak: need --clients >= 1, 0 <= --tcp-clients <= --clients, --working-set > 1")
        return cls(clients, args.seconds or (5.0 if args.quick else 60.0), min(processes, clients), tcp,
                   host, disk, Workload.covering(int(args.working_set * (host + disk)), seed=args.seed),
                   args.timeout_s, args.daemon_profile)


@dataclass(slots=True)
class Run:
    """One soak in progress: the daemon, its work dir and what was measured around the clients."""

    plan: Plan
    work_dir: Path
    prefix: str = field(default_factory=lambda: f"kvsoak{secrets.token_hex(4)}")
    daemon: BenchDaemon | None = None
    rest: str = ""
    fig: Figures = field(default_factory=Figures)

    def start(self) -> None:
        plan = self.plan
        config = self.work_dir / "kvtier.toml"
        config.write_text(f'[store]\nhost_name_prefix = "{self.prefix}"\n'
                          f"host_segment_bytes = {min(plan.host_bytes, SEGMENT_MIB * MIB)}\n")
        flags = ["--config", str(config), "--listen", "127.0.0.1:0", "--rest", "127.0.0.1:0",
                 "--host-bytes", str(plan.host_bytes), "--disk-bytes", str(plan.disk_bytes),
                 "--token-file", str(self.work_dir / "token")]
        self.daemon = BenchDaemon(self.work_dir, flags, suite="soak", profile=plan.profile)
        self.daemon.start()
        m = _REST.search(self.daemon.log_path.read_text(errors="replace"))
        if m is None:
            raise RuntimeError(f"soak: the daemon logged no REST address:\n{self.daemon.log_tail()}")
        self.rest = m["url"]
        mem = memory(self.pid)
        self.fig.idle_private = mem["RssAnon"] + mem["RssFile"]
        write_buffer, _, buffer_pool = ram_budget(plan.host_bytes)
        self.fig.disk_tier_ram = 3 * write_buffer + buffer_pool  # two memtables, the block cache, the pool
        self.fig.in_flight = plan.clients * plan.work.blocks * max(SIZES)
        self.fig.idle_memory = mem

    def stats(self) -> dict[str, Any]:
        """The daemon's ``/v1/stats``, read with its token."""
        assert self.daemon is not None, "the daemon runs"
        return rest_stats(self.rest, self.daemon.token())

    @property
    def pid(self) -> int:
        assert self.daemon is not None and self.daemon.proc is not None, "the daemon runs"
        return self.daemon.proc.pid

    def prefill(self) -> None:
        """Save cold prefixes until both tiers are full and the disk tier has evicted."""
        plan, work = self.plan, self.plan.work
        target = plan.host_bytes + plan.disk_bytes
        saved, start = 0, time.monotonic()
        with Client.connect(self.daemon.address, timeout_s=60.0) as c:  # type: ignore[union-attr]
            self.fig.idle_ping_ms = [c.ping() * 1e3 for _ in range(200)]
            for p in range(work.prefixes - 1, -1, -1):
                out = c.save(NS_ID, work.blocks_of(p))
                saved += sum(work.size(p, j) for j, o in enumerate(out) if o == "stored")
                if saved > target and p % 16 == 0 and _evictions(self.stats())[1] > 0:
                    break
        progress(f"soak: pre-filled {saved / MIB:.0f} MiB in {time.monotonic() - start:.1f} s "
                 f"(tiers {target / MIB:.0f} MiB)")

    def clients(self) -> None:
        """Run the worker processes for the measured window, sampling the daemon meanwhile."""
        plan, daemon = self.plan, self.daemon
        assert daemon is not None, "started"
        self.fig.stats_before = self.stats()
        self.fig.fds_before = fd_census(self.pid, self.work_dir)
        procs = [self._spawn(i) for i in range(plan.processes)]
        try:
            for proc in procs:
                line = proc.stdout.readline()  # type: ignore[union-attr]
                if line.strip() != b"ready":
                    raise RuntimeError(f"soak: a worker did not connect:\n{self._worker_log(procs.index(proc))}")
            sampler = Sampler(self.pid, lambda: self.stats())
            sampler.start()
            progress(f"soak: {plan.clients} clients ({plan.tcp_clients} over TCP) in {plan.processes} "
                     f"processes for {plan.seconds:g} s; working set {plan.work.prefixes} prefixes")
            for proc in procs:
                proc.stdin.write(f"go {plan.seconds}\n".encode())  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
            start = time.monotonic()
            for i, proc in enumerate(procs):
                if proc.wait(plan.seconds + 120) != 0:
                    raise RuntimeError(f"soak: worker {i} exited with {proc.returncode}:\n{self._worker_log(i)}")
            self.fig.elapsed = time.monotonic() - start
            sampler.stop()
            self.fig.sampler = sampler
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                for pipe in (proc.stdin, proc.stdout):
                    if pipe is not None:
                        pipe.close()
        self.fig.workers = [json.loads((self.work_dir / f"worker-{i}.json").read_text())
                            for i in range(plan.processes)]

    def afterwards(self) -> None:
        """Leases, reservations and descriptors once every client has gone; then stop the daemon."""
        deadline = time.monotonic() + 60.0  # far beyond what a loaded machine takes
        while True:  # the daemon releases a connection's leases when it notices the close
            stats = self.stats()
            fds = fd_census(self.pid, self.work_dir)
            settled = stats["gauges"]["leases"] == 0 and fds.get("socket", 0) <= self.fig.fds_before.get("socket", 0)
            if settled or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        self.fig.stats_after, self.fig.fds_after = stats, fds
        self.fig.memory_end = memory(self.pid)
        assert self.daemon is not None and self.daemon.proc is not None, "running"
        proc = self.daemon.proc
        self.daemon.stop()
        self.fig.exit_status = proc.returncode
        self.fig.shm_left = shm_segments(self.prefix)
        log = self.daemon.log_path.read_text(errors="replace")
        self.fig.log_errors = [ln for ln in log.splitlines() if " ERROR " in ln or " CRITICAL " in ln
                               or ln.startswith("Traceback")]
        self.fig.log_checksums = [ln for ln in log.splitlines() if "checksum" in ln and " WARNING " in ln]

    def _spawn(self, i: int) -> subprocess.Popen[bytes]:
        plan, daemon = self.plan, self.daemon
        assert daemon is not None, "started"
        share = _share(plan.clients, plan.processes, i)
        cfg = WorkerConfig(index=i, unix=daemon.address, tcp=daemon.tcp, token=daemon.token(), clients=share,
                           tcp_clients=_share(plan.tcp_clients, plan.processes, i), prefixes=plan.work.prefixes,
                           blocks=plan.work.blocks, seed=plan.work.seed, timeout_s=plan.timeout_s,
                           result=str(self.work_dir / f"worker-{i}.json"))
        env = child_env()
        with open(self.work_dir / f"worker-{i}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.soak.worker"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=log, env=env)
        proc.stdin.write((json.dumps(asdict(cfg)) + "\n").encode())  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        return proc

    def _worker_log(self, i: int) -> str:
        path = self.work_dir / f"worker-{i}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""


def _share(total: int, parts: int, i: int) -> int:
    """Process ``i``'s share of ``total`` split as evenly as possible over ``parts``."""
    return total // parts + (1 if i < total % parts else 0)


def _evictions(stats: dict[str, Any]) -> tuple[int, int]:
    tiers = stats["counters"]["tiers"]
    return tiers["host"]["evictions"], tiers["disk"]["evictions"]


def run(args: argparse.Namespace) -> SuiteResult:
    plan = Plan.from_args(args)
    work_dir = Path(tempfile.mkdtemp(prefix="kvtier-bench-soak-", dir=args.work_dir))
    soak = Run(plan, work_dir)
    try:
        soak.start()
        soak.prefill()
        soak.clients()
        soak.afterwards()
    except Exception:
        if soak.daemon is not None:
            progress(f"soak: failed; the daemon's log ends with:\n{soak.daemon.log_tail()}")
        raise
    finally:
        if soak.daemon is not None:
            soak.daemon.stop()
        for name in shm_segments(soak.prefix):  # a daemon that died leaves its segments behind
            os.unlink(os.path.join("/dev/shm", name))
        shutil.rmtree(work_dir, ignore_errors=True)
    result = SuiteResult("soak", rows(plan.clients, plan.seconds, plan.host_bytes, soak.fig))
    for line in soak.fig.summary():
        progress(f"soak: {line}")
    bad = violations(result)
    progress("soak: every invariant holds" if not bad else f"soak: INVARIANTS VIOLATED: {'; '.join(bad)}")
    return result


__all__ = ["DESCRIPTION", "add_arguments", "run"]
