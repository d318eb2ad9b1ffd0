"""`kvtier bench abuse`: a well-behaved client's latency and the daemon's memory while unauthenticated
clients attack a daemon started on its defaults (issue 24, items 1-4).

A real ``kvtier serve`` (unix socket, TCP data plane and REST on 127.0.0.1, every limit at its
default) serves one well-behaved client on the unix socket, an engine: each call saves one new
block and loads it back. An attacker process (spawned, so its work never shares this process's
interpreter) runs, in threads, what the outside attacks were:

  * ``memory``: TCP connections that send a put's preamble and header announcing a 256 MiB
    payload and then nothing (each reconnects when the daemon closes it);
  * ``slots``: idle TCP connections that never say hello (reconnecting when closed);
  * ``slowloris``: REST connections that send one header byte per socket every second;
  * ``lookup``: loops of anonymous ``POST /v1/lookup`` with 200K token ids.

Every loop is bounded in count and in time, and all traffic goes to 127.0.0.1. The attacker runs
niced (+10), so that on a small machine its own CPU does not stand in for the daemon's.

Rows:
  * ``save+load p50`` / ``p99`` (ms): under attack, next to the same client with no attack
    (alternating, so drift hits both; ratio = quiet / attacked: 0.5 is the 2x target);
  * ``daemon private RSS growth`` (MiB): the largest growth of the daemon's anonymous memory
    (``RssAnon``) sampled during the attacks, next to the bound the configuration sets for
    received payloads (``dataplane.max_buffer_bytes``).
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import multiprocessing as mp
import os
import re
import resource
import selectors
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from pathlib import Path

from kvtier.bench.daemon import BenchDaemon
from kvtier.bench.report import Row, Samples, SuiteResult, alternate, latency_row, progress, quantile
from kvtier.client import Client
from kvtier.daemon.config import DataPlaneConfig
from kvtier_protocol import frames as fr
from kvtier_protocol.header import BlockHeader, Section, encode_header, payload_checksum

DESCRIPTION = "a client's save/load p50/p99 and the daemon's RSS under unauthenticated attacks vs none"
MIB = 1 << 20
NS = hashlib.sha256(b"kvtier bench abuse").digest()[:16]
ANNOUNCED = 256 * MIB  # what the memory attack announces: the default max_payload_bytes
LOOKUP_TOKENS = 200_000
ATTACK_LIMIT_S = 300.0  # no attack loop runs longer than this, whatever happens
OP_LIMIT = 1_000_000  # nor does any make more connections or requests than this
REOPEN_S = 1.0  # a connection the daemon closed is opened again this much later (an attacker that
# persists, not a flood of connects: that would measure the machine's CPU, not the daemon)
_REST = re.compile(r"kvtierd rest http://127\.0\.0\.1:(\d+)")


@dataclass(frozen=True, slots=True)
class Attack:
    """How hard each attack pushes (connections or loops)."""

    memory: int
    slots: int
    slowloris: int
    lookups: int


# --quick keeps slowloris under the REST cap (64), so that the anonymous lookups reach the daemon too.
QUICK, FULL = Attack(memory=8, slots=32, slowloris=48, lookups=2), Attack(memory=32, slots=256,
                                                                            slowloris=3000, lookups=4)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calls", type=int, default=None,
                        help="save+load calls per measurement (default 2000; --quick 200)")
    parser.add_argument("--seconds", type=float, default=None,
                        help="each measurement lasts at least this long, so that the attacks' deadlines "
                             "(hello 10 s, REST headers 10 s) come into play (default 30; --quick 4)")
    parser.add_argument("--block-bytes", type=int, default=16 * 1024, help="payload of each saved block")


def run(args: argparse.Namespace) -> SuiteResult:
    reps = args.repetitions or (1 if args.quick else 3)
    calls = args.calls or (200 if args.quick else 2000)
    seconds = args.seconds if args.seconds is not None else (4.0 if args.quick else 30.0)
    attack = QUICK if args.quick else FULL
    result = SuiteResult("abuse")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-abuse-"))
    flags = ["--listen", "127.0.0.1:0", "--rest", "127.0.0.1:0", "--host-bytes", str(64 * MIB), "--disk-bytes", "0"]
    daemon = BenchDaemon(work, flags, suite="abuse")
    ctx = mp.get_context("spawn")
    with daemon.running():
        assert daemon.proc is not None and daemon.tcp, "started with --listen"
        found = _REST.search(daemon.log_path.read_text(errors="replace"))
        assert found is not None, "started with --rest"
        host, port = daemon.tcp.removeprefix("tcp://").rsplit(":", 1)
        targets = {"tcp": (host, int(port)), "rest": ("127.0.0.1", int(found[1]))}
        parent, child = ctx.Pipe()
        attacker = ctx.Process(target=_attacker, args=(child, targets, attack), name="kvtier-bench-abuse",
                               daemon=True)
        attacker.start()
        pid = daemon.proc.pid
        try:
            with Client.connect(daemon.address, timeout_s=60.0) as client:
                idle_anon = _rss_anon(pid)
                peak = [idle_anon]
                runs = [0]
                p50s: dict[str, list[float]] = {"quiet": [], "attacked": []}  # warm-up first

                def quiet() -> float:
                    return _measure(client, calls, seconds, args.block_bytes, runs, p50s["quiet"])

                def attacked() -> float:
                    parent.send(("start",))
                    _expect(parent, "armed")
                    sampler = _Sampler(pid, peak)
                    try:
                        return _measure(client, calls, seconds, args.block_bytes, runs, p50s["attacked"])
                    finally:
                        sampler.stop()
                        parent.send(("stop",))
                        counts = _expect(parent, "stopped")
                        progress(f"abuse: attacks made {json.dumps(counts)}")

                progress(f"abuse: {calls} save+load calls per measurement, {reps} repetitions; attacks {attack}")
                hit, base = alternate(attacked, quiet, repetitions=reps)
        finally:
            parent.send(("exit",))
            attacker.join(30)
            if attacker.is_alive():
                attacker.kill()
    case = (f"unix-socket client, {args.block_bytes // 1024} KiB blocks; attackers: {attack.memory} memory, "
            f"{attack.slots} idle TCP, {attack.slowloris} slowloris, {attack.lookups} lookup loops")
    result.rows.append(latency_row(case, "save+load p50", "ms", Samples(p50s["attacked"][1:] or p50s["attacked"]),
                                   "same client, no attack", Samples(p50s["quiet"][1:] or p50s["quiet"])))
    result.rows.append(latency_row(case, "save+load p99", "ms", hit, "same client, no attack", base))
    bound = next(f.default for f in fields(DataPlaneConfig) if f.name == "max_buffer_bytes")
    growth = max(0.0, (peak[0] - idle_anon) / MIB)
    result.rows.append(latency_row("daemon under the attacks", "daemon private RSS growth", "MiB",
                                   Samples([growth]), "dataplane.max_buffer_bytes (bound)",
                                   Samples([bound / MIB])))
    return result


# --- the well-behaved client --------------------------------------------------------------------


def _record(key: bytes, payload: bytes) -> bytes:
    n = len(payload)
    h = BlockHeader(ns_id=NS, chain_hash=key, parent_hash=None, num_tokens=16, layout="canonical",
                    shape=(1, 2, 1, 16, n // 64), dtype="float16", codec="raw",
                    sections=(Section("payload", 0, n),), payload_len=n, checksum=payload_checksum(payload))
    return encode_header(h) + payload


def _measure(client: Client, calls: int, seconds: float, block_bytes: int, runs: list[int],
             p50s: list[float]) -> float:
    """p99 (ms) of save+load pairs of new blocks: ``calls`` of them, and more until ``seconds``
    have passed (at most 100 times ``calls``); the p50 goes to ``p50s``."""
    runs[0] += 1
    payload = os.urandom(block_bytes)
    out: list[float] = []
    clock = time.perf_counter
    end = clock() + seconds
    for i in range(100 * calls):
        if i >= calls and clock() >= end:
            break
        key = hashlib.sha256(b"%d/%d" % (runs[0], i)).digest()
        rec = _record(key, payload)
        start = clock()
        saved = client.save(NS, [(key, rec)])
        loaded = client.load(NS, [key], degrade=False)
        out.append((clock() - start) * 1e3)
        if saved != ["stored"] or len(loaded) != 1:
            raise RuntimeError(f"abuse: the well-behaved client failed: saved {saved}, loaded {len(loaded)}")
    p50s.append(quantile(out, 0.5))
    return quantile(out, 0.99)


def _rss_anon(pid: int) -> int:
    """The daemon's private (anonymous) resident bytes: its shared-memory tiers are not counted."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


class _Sampler:
    """Samples the daemon's RssAnon every 50 ms into ``peak[0]`` (the largest seen) until stopped."""

    def __init__(self, pid: int, peak: list[int]) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(pid, peak), daemon=True)
        self._thread.start()

    def _run(self, pid: int, peak: list[int]) -> None:
        while not self._stop.wait(0.05):
            peak[0] = max(peak[0], _rss_anon(pid))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _expect(conn: Connection, what: str) -> dict[str, int]:
    if not conn.poll(120.0):
        raise RuntimeError(f"abuse: the attacker did not report {what!r} within 120 s")
    msg = conn.recv()
    if msg[0] != what:
        raise RuntimeError(f"abuse: the attacker reported {msg!r}, expected {what!r}")
    return msg[1]


# --- the attacker (a spawned process) -------------------------------------------------------------


@dataclass(slots=True)
class _Counts:
    connections: dict[str, int] = field(default_factory=dict)
    closed_by_daemon: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    statuses: dict[str, int] = field(default_factory=dict)


def _attacker(conn: Connection, targets: dict[str, tuple[str, int]], attack: Attack) -> None:
    # Niced: on a small machine the attacker's own CPU (sending megabytes of JSON) would slow the
    # measuring client whatever the daemon does; what is measured is the daemon's part.
    os.nice(10)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = attack.memory + attack.slots + attack.slowloris + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    body = json.dumps({"ns": NS.hex(), "token_ids": list(range(LOOKUP_TOKENS))}).encode()
    preamble = _announcement()
    while True:
        msg = conn.recv()
        if msg[0] == "exit":
            return
        assert msg[0] == "start", msg
        stop = threading.Event()
        counts = _Counts()
        lock = threading.Lock()
        deadline = time.monotonic() + ATTACK_LIMIT_S
        armed = threading.Barrier(4 + attack.lookups)
        threads = [
            threading.Thread(target=_hold, args=("memory", targets["tcp"], attack.memory, preamble, 0.0, stop,
                                                 deadline, counts, lock, armed)),
            threading.Thread(target=_hold, args=("slots", targets["tcp"], attack.slots, b"", 0.0, stop, deadline,
                                                 counts, lock, armed)),
            threading.Thread(target=_hold, args=("slowloris", targets["rest"], attack.slowloris,
                                                 b"GET /v1/health HTTP/1.1\r\nHost: x\r\n", 1.0, stop, deadline,
                                                 counts, lock, armed)),
        ] + [threading.Thread(target=_lookups, args=(targets["rest"], body, stop, deadline, counts, lock, armed))
             for _ in range(attack.lookups)]
        for t in threads:
            t.start()
        armed.wait()  # every attack has opened its connections (or sent its first request)
        conn.send(("armed", {}))
        msg = conn.recv()
        stop.set()
        for t in threads:
            t.join()
        conn.send(("stopped", {"connections": counts.connections, "closed_by_daemon": counts.closed_by_daemon,
                               "lookups": counts.requests, "lookup_statuses": counts.statuses}))
        if msg[0] == "exit":
            return


def _announcement() -> bytes:
    """A put's preamble and header announcing :data:`ANNOUNCED` payload bytes (none follow)."""
    whole = fr.encode_frame_bytes({"op": "put", "id": 1, "ns_id": NS, "hashes": [bytes(32)], "lens": [ANNOUNCED]},
                                  b"x")
    _, _, flags, header_len, _ = fr.PREAMBLE.unpack_from(whole, 0)
    return fr.PREAMBLE.pack(fr.MAGIC, fr.FRAME_VERSION, flags, header_len, ANNOUNCED) + \
        whole[fr.PREAMBLE_LEN:fr.PREAMBLE_LEN + header_len]


def _hold(name: str, target: tuple[str, int], n: int, first: bytes, trickle_s: float, stop: threading.Event,
          deadline: float, counts: _Counts, lock: threading.Lock, armed: threading.Barrier) -> None:
    """Keep ``n`` connections to ``target`` open, each sending ``first`` once and then (with
    ``trickle_s``) one byte per ``trickle_s`` seconds; reopen those the daemon closes (or
    refuses) :data:`REOPEN_S` later."""
    sel = selectors.DefaultSelector()
    made = 0
    reopen: list[float] = []  # when each slot closed by the daemon is due again

    def open_one() -> None:
        nonlocal made
        try:
            sock = socket.create_connection(target, timeout=5.0)
            sock.setblocking(False)
            if first:
                sock.send(first)
        except OSError:
            reopen.append(time.monotonic() + REOPEN_S)
            return
        made += 1
        sel.register(sock, selectors.EVENT_READ)

    for _ in range(n):
        open_one()
    armed.wait()
    next_trickle = time.monotonic() + trickle_s
    closed = 0
    while not stop.is_set() and time.monotonic() < deadline and made < OP_LIMIT:
        for key, _ in sel.select(0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            try:
                data = sock.recv(1 << 16)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data or name == "slowloris":  # closed, or answered (a 503 before the close)
                sel.unregister(sock)
                sock.close()
                closed += 1
                reopen.append(time.monotonic() + REOPEN_S)
        now = time.monotonic()
        due = [t for t in reopen if t <= now]
        reopen[:] = [t for t in reopen if t > now]
        for _ in due:
            if stop.is_set() or made >= OP_LIMIT:
                break
            open_one()
        if trickle_s and time.monotonic() >= next_trickle:
            next_trickle += trickle_s
            for key in list(sel.get_map().values()):
                try:
                    key.fileobj.send(b"X")  # type: ignore[union-attr]
                except OSError:
                    pass
    for key in list(sel.get_map().values()):
        key.fileobj.close()  # type: ignore[union-attr]
    sel.close()
    with lock:
        counts.connections[name] = made
        counts.closed_by_daemon[name] = closed


def _lookups(target: tuple[str, int], body: bytes, stop: threading.Event, deadline: float, counts: _Counts,
             lock: threading.Lock, armed: threading.Barrier) -> None:
    """Anonymous ``POST /v1/lookup`` of :data:`LOOKUP_TOKENS` token ids, one after another."""
    armed.wait()
    done = 0
    statuses: dict[str, int] = {}
    while not stop.is_set() and time.monotonic() < deadline and done < OP_LIMIT:
        if done:
            stop.wait(0.01)  # back to back, but not a connect flood when the daemon refuses at once
        conn = http.client.HTTPConnection(*target, timeout=30.0)
        try:
            conn.request("POST", "/v1/lookup", body=body, headers={"Content-Type": "application/json"})
            status = str(conn.getresponse().status)
        except (OSError, http.client.HTTPException) as e:
            status = type(e).__name__
        finally:
            conn.close()
        statuses[status] = statuses.get(status, 0) + 1
        done += 1
    with lock:
        counts.requests += done
        for k, v in statuses.items():
            counts.statuses[k] = counts.statuses.get(k, 0) + v


__all__ = ["DESCRIPTION", "add_arguments", "run"]
