"""The loop of `kvtier bench fuzz`: generate inputs for a target, run each under a time bound,
classify the outcome.

Outcomes of one input:

* **typed**: the decoder raised a :class:`~kvtier_protocol.errors.KVTierError` (the contract for
  bad input);
* **accepted**: it returned normally;
* **crash**: any other exception (a ``TypeError``, ``RecursionError``, ``OverflowError`` ... that
  would reach a connection handler or the CLI as a bug);
* **hang**: the input ran longer than the bound. A ``SIGALRM`` timer interrupts a Python loop at
  the bound; a C call that ignores signals is caught by its elapsed time when it returns.

The generator mixes random bytes, seed-prefixed random bytes, byte-level mutations of seeds and
structure-aware mutations (:mod:`kvtier.bench.fuzz.mutate`), all from one seeded RNG.
"""

from __future__ import annotations

import random
import signal
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import FrameType

from kvtier_protocol.errors import KVTierError

from kvtier.bench.fuzz import mutate as mut
from kvtier.bench.fuzz.targets import NotAnInput, Target

MAX_FINDINGS = 10  # reproducers kept per target


class Hang(BaseException):
    """Raised by the SIGALRM handler at the time bound (a BaseException: ``except Exception`` in
    the code under test must not swallow it)."""


@dataclass(slots=True)
class Finding:
    """One crash or hang, with what reproduces it."""

    kind: str  # "crash" or "hang"
    error: str
    trace: str
    data: bytes


@dataclass(slots=True)
class TargetStats:
    """Outcome counts of one target's run."""

    name: str
    inputs: int = 0
    typed: int = 0
    accepted: int = 0
    crashes: int = 0
    hangs: int = 0
    skipped: int = 0  # bytes the harness could not shape into the decoder's input type
    slowest_s: float = 0.0
    seconds: float = 0.0
    findings: list[Finding] = field(default_factory=list)  # one per distinct signature
    signatures: dict[str, int] = field(default_factory=dict)  # exception type @ place -> count
    errors: dict[str, int] = field(default_factory=dict)  # typed error code -> count

    def add_finding(self, kind: str, exc: BaseException | None, data: bytes, elapsed: float) -> None:
        if kind == "crash":
            self.crashes += 1
        else:
            self.hangs += 1
        sig = signature(kind, exc)
        self.signatures[sig] = self.signatures.get(sig, 0) + 1
        if self.signatures[sig] == 1 and len(self.findings) < MAX_FINDINGS:
            error = f"{type(exc).__name__}: {exc}"[:500] if exc is not None else f"took {elapsed:.3f} s"
            trace = "".join(traceback.format_exception(exc)) if exc is not None else ""
            self.findings.append(Finding(kind, error, trace, data))


def signature(kind: str, exc: BaseException | None) -> str:
    """``kind: ExcType at file:line`` of the innermost frame: crashes of one bug share it."""
    if exc is None or exc.__traceback__ is None:
        return f"{kind}: {type(exc).__name__ if exc else 'slow'}"
    last = traceback.extract_tb(exc.__traceback__)[-1]
    return f"{kind}: {type(exc).__name__} at {last.filename.rsplit('/', 1)[-1]}:{last.lineno}"


def _on_alarm(signum: int, frame: FrameType | None) -> None:
    raise Hang


def next_input(target: Target, rng: random.Random) -> bytes:
    """One input: random, seed-prefixed random, byte-mutated or structure-mutated seed."""
    seeds = target.seeds
    r = rng.random()
    if not seeds or r < 0.08:
        return mut.random_bytes(rng)
    seed = rng.choice(seeds)
    if r < 0.15:
        return seed[:rng.choice((4, 8, 12, 20, 24))] + mut.random_bytes(rng)
    if target.structured is None or r < 0.15 + target.raw_share * 0.85:
        return mut.mutate_bytes(rng, seed, rng.choice(seeds))
    data = target.structured(rng, seed)
    if rng.random() < 0.1:
        data = mut.mutate_bytes(rng, data)
    return data


class Runner:
    """Runs inputs under a per-input time bound (SIGALRM in the main thread, elapsed time always)."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s
        self._alarm = threading.current_thread() is threading.main_thread()
        self._previous = signal.signal(signal.SIGALRM, _on_alarm) if self._alarm else None

    def close(self) -> None:
        if self._alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self._previous)

    def feed(self, target: Target, data: bytes, stats: TargetStats) -> None:
        """Run one input and count its outcome in ``stats``."""
        exc: BaseException | None = None
        t0 = time.perf_counter()
        try:
            if self._alarm:
                signal.setitimer(signal.ITIMER_REAL, self.bound_s)
            try:
                target.run(data)
            finally:
                if self._alarm:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except NotAnInput:
            stats.skipped += 1
            return
        except Hang as e:
            exc = e
        except KVTierError as e:
            stats.typed += 1
            stats.errors[e.code] = stats.errors.get(e.code, 0) + 1
        except Exception as e:  # noqa: BLE001 - every other exception is what we look for
            exc = e
        else:
            stats.accepted += 1
        elapsed = time.perf_counter() - t0
        stats.inputs += 1
        stats.slowest_s = max(stats.slowest_s, elapsed)
        if isinstance(exc, Hang) or (exc is None and elapsed > self.bound_s):
            stats.add_finding("hang", exc if isinstance(exc, Hang) else None, data, elapsed)
        elif exc is not None:
            stats.add_finding("crash", exc, data, elapsed)


def fuzz_target(target: Target, inputs: int, *, seed: int = 0, bound_s: float = 2.0,
                max_skips: int | None = None) -> TargetStats:
    """Feed ``inputs`` counted inputs (those that reach the decoder) to ``target``.

    Args:
        target: the decoder.
        inputs: how many inputs must reach it.
        seed: the RNG seed (the run is reproducible from it and the target name).
        bound_s: per-input time bound; longer is a hang.
        max_skips: stop after this many skipped inputs (default: ``inputs``), so a target whose
            harness rejects everything cannot loop forever.
    """
    rng = random.Random(f"{seed}:{target.name}")
    stats = TargetStats(target.name)
    runner = Runner(bound_s)
    limit = 3 * inputs if max_skips is None else max_skips
    t0 = time.perf_counter()
    try:
        for data in target.seeds:  # every seed must decode or fail typed too
            runner.feed(target, data, stats)
        while stats.inputs < inputs and stats.skipped <= limit:
            runner.feed(target, next_input(target, rng), stats)
    finally:
        runner.close()
    stats.seconds = time.perf_counter() - t0
    return stats
