"""`kvtier bench crash`: SIGKILL a real daemon under a durable writer, restart it, check what survived.

One run is a loop of daemon lives on one data directory. Each life: start ``kvtier serve``, check
it (below), start a writer process (:mod:`kvtier.bench.crash.writer`) that saves blocks over the
unix socket, and SIGKILL the daemon at a moment aimed at one step of the store, in turn:

===========  ============  =====================================================================
step         store mode    how the kill is timed
===========  ============  =====================================================================
reserve      write-through the writer's timer fires inside a reserve round trip
copy         write-through the writer kills after copying part of a batch into shared memory
commit       write-through the writer's timer fires inside a commit round trip (RocksDB write)
demotion     write-back    host tier full, so every reserve demotes: timer inside a reserve
flush        write-back    SIGTERM with host-only blocks, SIGKILL a random fraction of the learnt
                           close time later (during the flush to disk and RocksDB's memtable flush)
compaction   write-through each recovery writes one L0 file per column family, and 4 make RocksDB
                           compact, mostly right at open: every start is watched through /proc
                           and SIGKILLed the moment the compaction thread (``rocksdb:low``) runs;
                           while none shows, the life ends with a kill inside a commit (one more
                           L0 file) and the next start is watched; the 4th life also watches
                           while the writer saves and deletes
===========  ============  =====================================================================

Then the **host-tier phase** (``--host-kills``, 50; ``--quick`` 5): write-back (the default), a
host tier large enough that nothing is evicted, a writer saving batches; the daemon is SIGKILLed
after a random number of commits, at a random moment (inside a commit, a reserve or a copy).
Blocks whose commit returned live only in host memory; the next daemon adopts the dead one's
shared-memory segments and must serve >= 99 % of them again, byte-identical (a block the dead
daemon had committed but whose answer the writer never read is not counted either way).

The step each kill actually landed in is recorded (the writer reads its own step under the lock
it kills under; /proc is read just before the kill) and reported next to the one aimed at.

After every restart, and once more at the end:

* the daemon must start (ready line) on the data directory the killed one left;
* ``POST /v1/check`` (what ``kvtier check`` sends; the real command runs once at the end) must
  find index and storage consistent;
* every block acknowledged as durable (a write-through commit returned; a write-back block a
  lookup found on disk; every block held in memory when a SIGTERM ended in a clean exit) must be
  served, byte for byte as written;
* every block ever attempted that is served at all must be byte-identical to what was written
  (acquire over shared memory, compared with the record regenerated from its key): a block that
  fails verification is never served.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvtier.bench.crash.daemon import COMPACTION_THREAD, FLUSH_THREAD, CrashDaemon
from kvtier.bench.crash.data import Link
from kvtier.bench.crash.tally import PHASES, Tally, hit, rows
from kvtier.bench.daemon import child_env
from kvtier.bench.report import SuiteResult, progress
from kvtier.commands.rest_client import CommandError, RestClient

DESCRIPTION = "SIGKILL the daemon under a durable writer; count recovered blocks"
KIB, MIB = 1 << 10, 1 << 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kills", type=int, default=None, help="SIGKILLs to deliver (default 50; --quick 6)")
    parser.add_argument("--host-kills", type=int, default=None,
                        help="SIGKILLs of the host-tier phase (default 50; --quick 5; 0 skips it)")
    parser.add_argument("--phases", default=",".join(PHASES),
                        help=f"steps to aim the kills at, in turn (default {','.join(PHASES)})")
    parser.add_argument("--block-kib", type=int, default=64, help="payload KiB per block (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="blocks per save (default 8)")
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: random, printed)")
    parser.add_argument("--compaction-wait", type=float, default=None,
                        help="seconds to wait for a compaction before killing anyway (default 20; --quick 8)")
    parser.add_argument("--work-dir", default=None, help="parent of the run's temp dir (default $TMPDIR)")
    parser.add_argument("--keep", action="store_true", help="keep the data directory and logs")


class CrashRun:
    """The kill loop (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args = args
        self.work = work
        self.seed = args.seed if args.seed is not None else secrets.randbelow(1 << 31)
        self.rng = random.Random(self.seed)
        self.nbytes = args.block_kib * KIB
        self.daemon = CrashDaemon(work, f"kvcrash{secrets.token_hex(3)}", disk_bytes=8 << 30)
        self.acked: set[tuple[int, int]] = set()
        self.attempted: set[tuple[int, int]] = set()
        self.tally = Tally()
        self.cycle = 0
        self.close_estimate_s = 0.3
        self.unjudged = 0  # kills since the last checks; the next checks decide whether they were survived
        self.host_held: list[tuple[int, int]] = []  # committed into host by the life just killed: check next
        self.broken = False  # the daemon did not start: the run ends

    # --- the loop ------------------------------------------------------------------------------

    def run(self, kills: int, phases: list[str], host_kills: int = 0) -> Tally:
        t = self.tally
        progress(f"crash: seed {self.seed}, {kills} kills aimed at {', '.join(phases)} in turn, "
                 f"{host_kills} at the host tier, in {self.work}")
        turn = 0
        while t.kills < kills and not self.broken and phases:
            phase = phases[turn % len(phases)]
            turn += 1
            if phase == "compaction":
                self.aim_at_compaction()
            elif phase == "flush":
                self.aim_at_flush()
            else:
                self.aim_with_writer(phase)
            if turn > 3 * kills + 10:
                t.anomalies.append("too many lives ended without a kill")
                break
        while t.host_kills < host_kills and not self.broken:
            self.aim_at_host()
        if not self.broken:
            writer = self.begin("final", "through")
            if writer is not None:
                self.dismiss(writer)
                self.cli_check()
                self.daemon.stop()
        return t

    def record(self, aimed: str, step: str) -> None:
        t = self.tally
        t.kills += 1
        t.aimed[aimed] += 1
        t.landed[step] += 1
        t.hit[aimed] += hit(aimed, step)
        self.unjudged += 1
        self.cycle += 1
        progress(f"crash: kill {t.kills} aimed at {aimed}, landed in {step}; "
                 f"{len(self.acked)} blocks acknowledged durable so far")

    def aim_with_writer(self, phase: str) -> None:
        """reserve, copy, commit, place, demotion: the writer kills the daemon itself."""
        mode = "back" if phase == "demotion" else "through"
        warmup = 16 // self.args.batch + 2 if phase == "demotion" else self.rng.randint(1, 4)
        writer = self.begin(phase, mode, target=phase, warmup=warmup)
        if writer is None:
            return
        self.go(writer)
        self.wait(writer)
        steps = [x["kill"] for x in self.collect(writer) if "kill" in x]
        if not steps:
            self.daemon.kill()  # the writer ended first
        self.daemon.reap()
        self.record(phase, steps[0] if steps else "after the writer ended")

    def aim_at_host(self) -> None:
        """Write-back into a host tier that evicts nothing; SIGKILL after a random number of
        committed batches (the next start checks that the committed blocks are served again)."""
        writer = self.begin("host", "back", warmup=0)
        if writer is None:
            return
        self.go(writer)
        out: Path = writer.out  # type: ignore[attr-defined]
        batches = self.rng.randint(1, 6)
        deadline = time.monotonic() + 60.0
        while time.monotonic() < deadline and writer.poll() is None:
            if out.read_text(errors="replace").count('"held"') >= batches:
                break
            time.sleep(0.002)  # the writer's own pace: a few ms a batch
        time.sleep(self.rng.uniform(0.0, 0.02))  # a random moment of the next batch
        self.daemon.kill()
        self.wait(writer)
        lines = self.collect(writer)
        self.host_held = [(self.cycle, i) for x in lines for i in x.get("held", ())]
        if not self.host_held:
            self.tally.anomalies.append(f"the host-tier writer committed nothing before the kill: {lines[-3:]}")
        self.tally.host_kills += 1
        self.record("host", "host (write-back)")

    def aim_at_flush(self) -> None:
        """SIGTERM with host-only blocks, SIGKILL while the close writes them down (up to 3 lives
        end in a clean stop while the close duration is learnt)."""
        for _ in range(3):
            host = self.host_bytes("flush")
            writer = self.begin("flush", "back", target="flush", fill=host // 2)
            if writer is None:
                return
            self.go(writer)
            self.wait(writer)
            lines = self.collect(writer)
            held = [(self.cycle, i) for x in lines for i in x.get("held", ())]
            if not any("filled" in x for x in lines):
                self.tally.anomalies.append(f"the flush writer did not fill the host tier: {lines[-3:]}")
            delay = self.rng.uniform(0.05, 1.0) * self.close_estimate_s
            killed, elapsed, busy = self.daemon.terminate_then_kill(delay)
            if killed:
                self.record("flush", "flush (memtable)" if FLUSH_THREAD in busy else "flush")
                return
            # A clean stop: the close wrote every memory block down (nothing was read, so the
            # admission filter, which admits all here, and the ample disk budget keep them all).
            self.acked.update(held)
            self.close_estimate_s = max(0.02, elapsed)
            self.tally.clean_stops += 1
            self.cycle += 1

    def aim_at_compaction(self) -> None:
        """RocksDB compacts when recoveries (one L0 file per column family each) pile up 4 L0
        files, mostly right at open: watch each start for the compaction thread; while none
        shows, kill inside a commit (one more recovery, one more L0 file) and start again; the
        last round watches while the writer saves and deletes."""
        for last in (False, False, False, True):
            writer = self.begin("compaction", "through", target="none" if last else "commit",
                                warmup=self.rng.randint(1, 3), deletes=last, watch=COMPACTION_THREAD)
            if writer is None:
                return
            if writer is True:
                self.record("compaction", "compaction (at open)")
                return
            self.go(writer)
            if not last:
                self.wait(writer)
                steps = [x["kill"] for x in self.collect(writer) if "kill" in x]
                if not steps:
                    self.daemon.kill()
                self.daemon.reap()
                self.record("commit", steps[0] if steps else "after the writer ended")
                continue
            wait = self.args.compaction_wait or (8.0 if self.args.quick else 20.0)
            caught = self.daemon.kill_when_busy(COMPACTION_THREAD, wait, keep_going=lambda: writer.poll() is None)
            if not caught:
                self.daemon.kill()
            self.wait(writer)
            self.collect(writer)
            self.record("compaction", "compaction" if caught else "no compaction seen")

    # --- a life: start, checks, writer ---------------------------------------------------------

    def begin(self, phase: str, mode: str, *, target: str = "none", warmup: int = 2, fill: int = 0,
              deletes: bool = False, watch: str | None = None) -> subprocess.Popen[bytes] | bool | None:
        """Spawn the writer (it imports while the daemon starts), start the daemon, run the checks.

        Returns:
            The waiting writer; True when ``watch`` killed the daemon during its start; None
            when the daemon did not start (the run ends).
        """
        writer = self.spawn_writer(target, mode, warmup=warmup, fill=fill, deletes=deletes)
        t = self.tally
        t.restarts += 1
        try:
            caught = self.daemon.start(write_through=mode == "through", host_bytes=self.host_bytes(phase),
                                       watch=watch)
        except RuntimeError as exc:
            self.dismiss(writer)
            self.broken = True
            t.anomalies.append(f"the daemon did not start after kill {t.kills}: {str(exc)[-2000:]}")
            return None
        if caught:
            self.dismiss(writer)
            return True
        t.started += 1
        self.check(final=phase == "final")
        return writer

    def check(self, *, final: bool) -> None:
        """The checks after a start (see the module docstring); they judge the kills since the last."""
        t = self.tally
        consistent = self.rest_check()
        t.consistent += consistent
        link = Link(self.daemon.address)
        try:
            acked = sorted(self.acked)
            got = link.check_served(acked, self.nbytes)
            others = link.check_served(sorted(self.attempted - self.acked), self.nbytes)
            host, self.host_held = self.host_held, []
            if host:  # the host-tier phase's life just killed: its committed blocks, again
                back = link.check_served(host, self.nbytes)
                t.host_committed += len(host)
                t.host_recovered += back.intact
                t.bad |= set(back.bad)
        finally:
            link.close()
        lost = set(got.missing) | set(got.bad)
        t.lost |= lost
        t.bad |= set(got.bad) | set(others.bad)
        t.served += got.intact + len(got.bad) + others.intact + len(others.bad)
        if final:
            t.final_acked, t.final_intact = len(acked), got.intact
        if consistent and not lost and not got.bad and not others.bad:
            t.survived += self.unjudged
        else:
            progress(f"crash: after kill {t.kills}: check {'ok' if consistent else 'FAILED'}, "
                     f"{len(got.missing)} acknowledged blocks missing, "
                     f"{len(got.bad) + len(others.bad)} served with wrong bytes")
        self.unjudged = 0

    def rest_check(self) -> bool:
        rest = RestClient(self.daemon.rest, 600.0, self.daemon.token())
        try:
            report = rest.post("/v1/check", {"fix": False}, token=True)
        except CommandError as exc:
            self.tally.anomalies.append(f"check failed: {exc}")
            return False
        if not report.get("ok"):
            self.tally.anomalies.append(f"check after kill {self.tally.kills}: {report.get('counts')}")
        return bool(report.get("ok"))

    def cli_check(self) -> None:
        """``kvtier check`` itself, once, on the final state."""
        done = subprocess.run([sys.executable, "-m", "kvtier", "check", "--rest", self.daemon.rest,
                               "--token-file", str(self.work / "token")], env=child_env(), capture_output=True,
                              text=True, timeout=600)
        self.tally.cli_check_rc = done.returncode
        if done.returncode != 0:
            self.tally.anomalies.append(f"kvtier check exited {done.returncode}: {done.stdout}{done.stderr}")

    def host_bytes(self, phase: str) -> int:
        # "host" and "final" share one size, so the final start adopts the last host-tier life's
        # segments (a life of another size removes them instead).
        if phase == "demotion":
            return 16 * self.nbytes  # full after two batches: every later reserve demotes
        return max(16 * MIB, 64 * self.nbytes)

    def spawn_writer(self, target: str, mode: str, *, warmup: int, fill: int,
                     deletes: bool) -> subprocess.Popen[bytes]:
        a = self.args
        out = self.work / f"writer-{self.cycle:03d}.jsonl"
        cmd = [sys.executable, "-m", "kvtier.bench.crash.writer", "--address", self.daemon.address,
               "--cycle", str(self.cycle), "--mode", mode, "--target", target, "--block-bytes", str(self.nbytes),
               "--batch", str(a.batch), "--warmup", str(warmup), "--fill-bytes", str(fill),
               "--seed", str(self.rng.randrange(1 << 30)), "--max-seconds", "60"]
        if deletes:
            cmd.append("--deletes")
        with open(out, "wb") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.PIPE, env=child_env())
        proc.out = out  # type: ignore[attr-defined]
        return proc

    def go(self, writer: subprocess.Popen[bytes]) -> None:
        assert writer.stdin is not None
        writer.stdin.write(f"go {self.daemon.pid}\n".encode())
        writer.stdin.close()

    def dismiss(self, writer: subprocess.Popen[bytes]) -> None:
        """A writer that will not write: it exits on the closed stdin."""
        assert writer.stdin is not None
        writer.stdin.close()
        self.wait(writer)

    @staticmethod
    def wait(writer: subprocess.Popen[bytes]) -> None:
        try:
            writer.wait(120)
        finally:
            if writer.poll() is None:
                writer.kill()
                writer.wait()

    def collect(self, writer: subprocess.Popen[bytes]) -> list[dict[str, Any]]:
        """Read a writer's lines: record attempts, acknowledgements, deletions and findings."""
        lines = []
        for text in writer.out.read_text(errors="replace").splitlines():  # type: ignore[attr-defined]
            try:
                item = json.loads(text)
            except ValueError:
                self.tally.anomalies.append(f"writer said: {text[:500]}")
                continue
            lines.append(item)
            c = self.cycle
            if "try" in item:
                lo, hi = item["try"]
                self.attempted.update((c, i) for i in range(lo, hi))
            self.acked.update((c, i) for i in item.get("ack", ()))
            self.acked.difference_update((c, i) for i in item.get("deleting", ()))
            self.tally.bad.update((int(x), int(y)) for x, y in item.get("bad", ()))
            if "anomaly" in item:
                self.tally.anomalies.append(f"writer of life {c}: {item['anomaly']}")
        return lines


def run(args: argparse.Namespace) -> SuiteResult:
    kills = args.kills if args.kills is not None else (6 if args.quick else 50)
    host_kills = args.host_kills if args.host_kills is not None else (5 if args.quick else 50)
    phases = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = sorted(set(phases) - set(PHASES))
    if unknown or (not phases and kills):
        raise SystemExit(f"kvtier bench crash: unknown phases {unknown}; choose from {', '.join(PHASES)}")
    work = Path(tempfile.mkdtemp(prefix="kvtier-bench-crash-", dir=args.work_dir))
    crash = CrashRun(args, work)
    try:
        t = crash.run(kills, phases, host_kills)
    finally:
        crash.daemon.cleanup()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for a in t.anomalies:
        progress(f"crash: ANOMALY {a}")
    progress(f"crash: kills landed in: {dict(t.landed)}; clean stops {t.clean_stops}; "
             f"kvtier check exit {t.cli_check_rc}")
    return SuiteResult("crash", rows(t))


__all__ = ["DESCRIPTION", "add_arguments", "run"]
