"""The writer process of `kvtier bench crash`: saves blocks into a live daemon until the daemon dies.

Run by the bench as ``python -m kvtier.bench.crash.writer ...`` (one process per daemon life),
started while the daemon starts; it begins when it reads ``go <daemon pid>`` on stdin. It
saves batches of blocks step by step over the unix socket (reserve, copy into shared memory,
commit; or grant, copy, place), and prints one JSON object per line (its stdout is a file the bench reads afterwards)::

    {"try": [lo, hi]}        blocks lo..hi-1 are about to be reserved
    {"ack": [i, ...]}        blocks acknowledged as durable: a write-through commit returned, or
                             (write-back) a lookup found them on disk
    {"held": [i, ...]}       (write-back) committed into host memory, not yet durable
    {"deleting": [i, ...]}   a delete of these blocks is about to be sent
    {"bad": [[c, i], ...]}   a read-back was served other bytes than were written
    {"anomaly": "..."}       something a live daemon should not do (a miss of a stored block, an error)
    {"kill": phase}          this process SIGKILLed the daemon; ``phase`` is the step it was in
    {"filled": n}            (flush target) n bytes are committed into host memory; exiting
    {"end": reason}

Kill targets (``--target``), armed after ``--warmup`` batches whose step durations they use. The
writer kills from its own thread, so the step it reports is exact:

* ``reserve`` / ``demotion``: once the reserve request is sent, spin for a random fraction of the
  median reserve round trip, then SIGKILL (write-back with a full host tier: every reserve demotes
  blocks to disk, so the daemon dies inside a demotion).
* ``copy``: SIGKILL after copying a random number of the batch's payloads into their slots,
  before the commit is sent.
* ``commit``: once the commit is sent, spin for a random fraction of the median commit round trip,
  then SIGKILL (write-through: inside the RocksDB write, or just before or after it).
* ``place``: the writer saves into granted slots instead (grant, copy, place: the client's usual
  path, SPEC §7.4); once the place is sent, spin for a random fraction of the median place round
  trip, then SIGKILL.

A reserve, commit or place whose answer was already waiting in the socket at the kill is reported as
``"<step> (answered)"``: the daemon died just after that step, not inside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from kvtier.bench.crash.data import Link, block_key, block_parts
from kvtier.client.errors import ConnectionLost
from kvtier_protocol.errors import KVTierError, Unavailable
from kvtier_protocol.frames import EXISTS

KILL_TARGETS = ("reserve", "copy", "commit", "place", "demotion")
_AIMED = {"reserve": ("reserve", "demotion"), "commit": ("commit",), "place": ("place",)}  # kills inside each call


def emit(**item: object) -> None:
    print(json.dumps(item), flush=True)


class Killer:
    """SIGKILLs the daemon from the writer's own thread, between sending a request and reading
    its answer (or between two payload copies), after a random fraction of that step's usual time."""

    def __init__(self, pid: int, link: Link) -> None:
        self.pid = pid
        self.link = link
        self.fired = False

    def after(self, step: str, delay_s: float) -> None:
        """Wait ``delay_s`` (spinning: a sleep could overshoot a sub-millisecond step), then kill."""
        end = time.perf_counter() + delay_s
        while time.perf_counter() < end:
            pass
        self.kill(step)

    def kill(self, step: str) -> None:
        if self.fired:
            return
        self.fired = True
        if step in ("reserve", "commit", "place") and self.link.conn.answered():
            step += " (answered)"  # the daemon had replied already: it died after the step
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            emit(anomaly="the daemon was gone before the kill")
            return
        emit(kill=step)


class Writer:
    """Saves batches of blocks of one cycle, killing the daemon once at the armed step."""

    def __init__(self, args: argparse.Namespace, daemon_pid: int) -> None:
        self.args = args
        self.link = Link(args.address)
        self.killer = Killer(daemon_pid, self.link)
        self.rng = random.Random(args.seed)
        self.times: dict[str, list[float]] = {"reserve": [], "copy": [], "commit": [], "place": []}
        self.stored: list[int] = []  # committed (acked or held) and not deleted, in order
        self.acked: set[int] = set()
        self.next_index = 0

    def run(self) -> str:
        a = self.args
        deadline = time.monotonic() + a.max_seconds
        held_bytes = 0
        batches = 0
        while time.monotonic() < deadline:
            armed = a.target in KILL_TARGETS and batches >= a.warmup and not self.killer.fired
            stored = self.save(a.target if armed else None)
            batches += 1
            if a.mode == "through":
                emit(ack=stored)
                self.acked.update(stored)
            else:
                emit(held=stored)
                held_bytes += len(stored) * a.block_bytes
                self.ack_on_disk()
            self.stored += stored
            if self.killer.fired:
                continue  # the next call finds the daemon dead
            if a.target == "flush" and held_bytes >= a.fill_bytes:
                emit(filled=held_bytes)
                return "filled"
            if a.deletes and batches % 3 == 0 and len(self.stored) > 2 * a.batch:
                self.delete_some()
            if batches % 4 == 0 and self.stored:
                self.read_back()
        return "time"

    def save(self, target: str | None) -> list[int]:
        """One batch: reserve, copy, commit (or, for a writer aimed at place, grant, copy,
        place); returns the indices the commit or place made visible."""
        a, killer, rng = self.args, self.killer, self.rng
        lo = self.next_index
        self.next_index += a.batch
        emit(**{"try": [lo, self.next_index]})
        parts = [block_parts(a.cycle, i, a.block_bytes) for i in range(lo, self.next_index)]

        def step(name: str) -> Callable[[], None]:
            if target not in _AIMED[name]:
                return _nothing
            # Reserve answers in well under a millisecond: aim at the first half of its round trip.
            share = 0.5 if name == "reserve" else 1.0
            return lambda: killer.after(name, rng.random() * share * _median(self.times[name]))

        if a.target == "place":
            return self._save_granted(lo, parts, step("place"))

        t0 = time.perf_counter()
        r = self.link.reserve([k for k, _, _ in parts], [len(p) for _, _, p in parts], step("reserve"))
        t1 = time.perf_counter()
        stop_at = rng.randrange(len(parts)) if target == "copy" else -1
        headers: list[bytes | None] = []
        for n, ((_, header, payload), slot) in enumerate(zip(parts, r.slots)):
            if n == stop_at:
                killer.kill("copy")
            if slot is None or slot == EXISTS:
                headers.append(None)
                continue
            self.link.shm.write(slot, payload)
            headers.append(header)
        t2 = time.perf_counter()
        done: list[int] = []
        if any(h is not None for h in headers):
            committed = self.link.commit(r.lease, headers, step("commit"))
            done = [lo + n for n, h in enumerate(headers) if h is not None]
            if committed != len(done):
                emit(anomaly=f"commit made {committed} of {len(done)} blocks visible")
        elif r.lease:
            self.link.call("release", lease=r.lease)
        for name, dt in (("reserve", t1 - t0), ("copy", t2 - t1), ("commit", time.perf_counter() - t2)):
            self.times[name].append(dt)
        return done

    def _save_granted(self, lo: int, parts: list[tuple[bytes, bytes, bytes]], between: Callable[[], None]) -> list[int]:
        """grant (not aimed at: a daemon killed there only loses slots) → copy → place."""
        g = self.link.grant([len(p) for _, _, p in parts])
        given = [n for n, slot in enumerate(g.slots) if slot is not None]  # a prefix: the rest got no room
        for n in given:
            self.link.shm.write(g.slots[n], parts[n][2])
        t0 = time.perf_counter()
        done: list[int] = []
        if given:
            results = self.link.place(g.lease, [parts[n][0] for n in given], given,
                                      [parts[n][1] for n in given], between)
            done = [lo + n for n, r in zip(given, results) if r == "stored"]
            if len(done) != len(given):
                emit(anomaly=f"place stored {len(done)} of {len(given)} new blocks")
        self.times["place"].append(time.perf_counter() - t0)
        return done

    def ack_on_disk(self) -> None:
        """Write-back: acknowledge the blocks a lookup reports on disk (demoted, hence durable)."""
        a = self.args
        keys = [block_key(a.cycle, i) for i in self.stored]
        tiers = self.link.lookup_tiers(keys)
        new = [i for i, t in zip(self.stored, tiers) if t == "disk" and i not in self.acked]
        if len(tiers) < len(keys):
            emit(anomaly=f"lookup found {len(tiers)} of {len(keys)} committed blocks")
        if new:
            self.acked.update(new)
            emit(ack=new)

    def delete_some(self) -> None:
        a = self.args
        start = self.rng.randrange(len(self.stored) - a.batch)
        gone = self.stored[start:start + a.batch]
        emit(deleting=gone)  # before the request: a kill may land while it is in flight
        self.stored = self.stored[:start] + self.stored[start + a.batch:]
        self.acked.difference_update(gone)
        self.link.delete([block_key(a.cycle, i) for i in gone])

    def read_back(self) -> None:
        a = self.args
        start = self.rng.randrange(len(self.stored))
        blocks = [(a.cycle, i) for i in self.stored[start:start + a.batch]]
        served = self.link.check_served(blocks, a.block_bytes)
        if served.bad:
            emit(bad=served.bad)
        if served.missing and not self.killer.fired:
            emit(anomaly=f"read-back missed {len(served.missing)} stored blocks")


def _nothing() -> None:
    return None


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else 0.001


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.bench.crash.writer")
    p.add_argument("--address", required=True)
    p.add_argument("--cycle", type=int, required=True)
    p.add_argument("--mode", choices=("through", "back"), required=True)
    p.add_argument("--target", choices=(*KILL_TARGETS, "flush", "none"), required=True)
    p.add_argument("--block-bytes", type=int, default=64 << 10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--fill-bytes", type=int, default=4 << 20)
    p.add_argument("--deletes", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-seconds", type=float, default=30.0)
    args = p.parse_args(argv)
    sys.setswitchinterval(0.0002)  # the kill timer must get the GIL while the writer copies
    # Started while the daemon starts (its imports overlap the daemon's): wait for "go <daemon pid>".
    go = sys.stdin.readline().split()
    if len(go) != 2 or go[0] != "go":
        emit(end="not started")
        return 0
    try:
        writer = Writer(args, int(go[1]))
    except Unavailable as exc:
        emit(end=f"no daemon: {exc}")
        return 0
    try:
        emit(end=writer.run())
        return 0
    except (ConnectionLost, Unavailable) as exc:
        if not writer.killer.fired and args.target in KILL_TARGETS + ("flush",):
            emit(anomaly=f"connection lost before the kill: {exc}")
        emit(end=f"daemon gone: {type(exc).__name__}")
        return 0
    except KVTierError as exc:
        if writer.killer.fired:  # whatever a dying daemon's last bytes made of the response
            emit(end=f"daemon gone: {type(exc).__name__}")
            return 0
        emit(anomaly=f"{type(exc).__name__}: {exc}")
        emit(end="error")
        return 2
    finally:
        writer.link.close()


if __name__ == "__main__":
    sys.exit(main())
