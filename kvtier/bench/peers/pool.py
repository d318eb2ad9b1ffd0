"""The client processes of `kvtier bench peers` and the figures of one timed run across them.

Clients are processes, not threads: every engine worker that saves or loads KV (a vLLM or SGLang
rank) is its own process with its own interpreter, and threads in one process would serialize
redis-py's reply parsing and kvtier's copies on the GIL, measuring the GIL rather than the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from kvtier.bench.daemon import child_env
from kvtier.bench.report import progress, quantile


@dataclass(frozen=True, slots=True)
class RunFigures:
    """One timed run of every client together: aggregate throughput and per-call latencies."""

    gbps: float       # payload bytes of all clients / (last client's end - first client's start)
    p50_ms: float
    p99_ms: float
    calls: int


class WorkerPool:
    """``clients`` worker subprocesses (``python -m kvtier.bench.peers.worker``), each connected
    to every engine in ``engines`` (name -> connection spec, see peers_worker)."""

    def __init__(self, clients: int, engines: dict[str, dict[str, Any]], ns_id: bytes) -> None:
        env = child_env()
        self.procs: list[subprocess.Popen[str]] = []
        try:
            for _ in range(clients):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "kvtier.bench.peers.worker"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, text=True, bufsize=1, env=env))
            self._all([{"cmd": "open", "engines": engines, "ns_id": ns_id.hex(), "client": i}
                       for i in range(clients)])
        except BaseException:
            self.close()
            raise

    def _all(self, msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Send one command to each worker (all before any answer is read), return the answers."""
        for proc, msg in zip(self.procs, msgs):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(msg) + "\n")
            proc.stdin.flush()
        answers = []
        for n, proc in enumerate(self.procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"peers client {n} exited with {proc.wait()} (its stderr is above)")
            answer = json.loads(line)
            if not answer.get("ok"):
                raise RuntimeError(f"peers client {n} failed on {msgs[n]['cmd']}:\n{answer.get('error')}")
            answers.append(answer)
        return answers

    def prepare(self, size: int, blocks: int, per_call: int) -> None:
        """Every client builds ``blocks`` records of ``size`` payload bytes (untimed)."""
        self._all([{"cmd": "prepare", "size": size, "blocks": blocks, "per_call": per_call}] * len(self.procs))

    def run(self, engine: str, op: str) -> RunFigures:
        """Every client saves (or loads) all its blocks through ``engine``, starting together."""
        # Far enough ahead that every client has read the command before the start on a busy
        # 2-core machine; a client that is late anyway widens the window (counted, not hidden).
        start_at = time.monotonic() + 0.05 + 0.01 * len(self.procs)
        answers = self._all([{"cmd": "run", "engine": engine, "op": op, "start_at": start_at}] * len(self.procs))
        t0 = min(a["t0"] for a in answers)
        t1 = max(a["t1"] for a in answers)
        lat = [x for a in answers for x in a["lat_ms"]]
        total = sum(a["bytes"] for a in answers)
        return RunFigures(total / (t1 - t0) / 1e9, quantile(lat, 0.50), quantile(lat, 0.99), len(lat))

    def delete(self, engine: str) -> None:
        self._all([{"cmd": "delete", "engine": engine}] * len(self.procs))

    def close(self) -> None:
        """Stop every worker (asked first, killed if it does not exit). Idempotent."""
        procs, self.procs = self.procs, []
        for proc in procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write(json.dumps({"cmd": "stop"}) + "\n")
                    proc.stdin.close()
            except OSError:
                pass  # it already died: its pipe is gone
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                progress("peers: a client did not stop within 30 s; killing it")
                proc.kill()
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
