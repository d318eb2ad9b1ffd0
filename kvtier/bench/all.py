"""`kvtier bench all`: every registered suite in turn, one table, one JSON list.

Each suite runs with its own defaults (``--quick`` and ``--repetitions`` passed through, plus any
flags given with ``--suite-args SUITE=FLAGS``). A suite that cannot run here is skipped with a
line saying why: ``gpu`` without CUDA, a suite whose module is not in this installation. A suite
that fails is reported (its traceback on stderr) and the others still run; the exit status is
then 1.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import ModuleType

from kvtier.bench import SUITES
from kvtier.bench.report import Row, SuiteResult, format_table, progress

DESCRIPTION = "every suite in turn (gpu only where CUDA exists): one table, --json a list of suite results"
WORK_DIR_SUITES_FLAG = "--work-dir"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--suites", default=None, help=f"comma-separated suites to run (default: all of {','.join(SUITES)})")
    parser.add_argument("--skip", default="", help="comma-separated suites to leave out")
    parser.add_argument("--suite-args", action="append", default=[], metavar="SUITE=FLAGS",
                        help="extra flags for one suite, e.g. --suite-args 'lookup=--stored 1K,100K' (repeatable)")
    parser.add_argument("--work-dir", default=None,
                        help="parent of the temp dirs of the suites that take --work-dir (default $TMPDIR)")


@dataclass(slots=True)
class AllResult:
    """What ``bench all`` ran: results in order, and the suites skipped or failed (with why)."""

    results: list[SuiteResult] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


def selected(args: argparse.Namespace) -> list[str]:
    """The suites to run, in registry order.

    Raises:
        SystemExit: an unknown suite name.
    """
    names = [s.strip() for s in (args.suites or ",".join(SUITES)).split(",") if s.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = sorted((set(names) | skip) - set(SUITES))
    if unknown:
        raise SystemExit(f"kvtier bench all: unknown suite(s) {', '.join(unknown)}; known: {', '.join(SUITES)}")
    return [s for s in SUITES if s in names and s not in skip]


def suite_flags(args: argparse.Namespace) -> dict[str, list[str]]:
    """``--suite-args`` as flags per suite.

    Raises:
        SystemExit: an entry without ``SUITE=`` or naming an unknown suite.
    """
    out: dict[str, list[str]] = {}
    for entry in args.suite_args:
        name, sep, flags = entry.partition("=")
        if not sep or name.strip() not in SUITES:
            raise SystemExit(f"kvtier bench all: --suite-args takes SUITE=FLAGS with a known suite, got {entry!r}")
        out.setdefault(name.strip(), []).extend(shlex.split(flags))
    return out


def suite_namespace(name: str, module: ModuleType, args: argparse.Namespace, extra: Sequence[str]) -> argparse.Namespace:
    """The arguments ``kvtier bench NAME`` would parse: the suite's defaults, the common flags of
    ``all``, ``--work-dir`` where the suite takes it, then ``extra``."""
    parser = argparse.ArgumentParser(prog=f"kvtier bench all ({name})")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repetitions", type=int, default=None)
    module.add_arguments(parser)
    argv = [*(["--quick"] if args.quick else []),
            *(["--repetitions", str(args.repetitions)] if args.repetitions else [])]
    if args.work_dir and hasattr(parser.parse_args([]), "work_dir"):  # the suite takes --work-dir
        argv += [WORK_DIR_SUITES_FLAG, args.work_dir]
    ns = parser.parse_args([*argv, *extra])
    ns.json = None
    ns.plot = None
    return ns


def run_all(args: argparse.Namespace) -> AllResult:
    """Run the selected suites one after the other, with progress lines on stderr."""
    names = selected(args)
    flags = suite_flags(args)
    out = AllResult()
    start = time.monotonic()
    for i, name in enumerate(names, start=1):
        module_path, _ = SUITES[name]
        progress(f"all: [{i}/{len(names)}] {name}{' (quick)' if args.quick else ''}")
        try:
            module = importlib.import_module(module_path)
        except ModuleNotFoundError as exc:
            if exc.name != module_path:
                raise
            out.skipped[name] = f"{module_path} is not in this installation"
            progress(f"all: {name} skipped: {out.skipped[name]}")
            continue
        why = _cannot_run(name, module, args, flags.get(name, []))
        if why is not None:
            out.skipped[name] = why
            progress(f"all: {name} skipped: {why}")
            continue
        t0 = time.monotonic()
        try:
            result = module.run(suite_namespace(name, module, args, flags.get(name, [])))
        except Exception as exc:  # one broken suite must not hide every other suite's figures
            out.failed[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
            progress(f"all: {name} FAILED after {time.monotonic() - t0:.0f} s: {out.failed[name]}")
            continue
        out.results.append(result)
        progress(f"all: {name} done in {time.monotonic() - t0:.0f} s ({len(result.rows)} rows); "
                 f"{time.monotonic() - start:.0f} s so far")
    return out


def _cannot_run(name: str, module: ModuleType, args: argparse.Namespace, extra: Sequence[str]) -> str | None:
    """Why a suite is skipped on this machine (only ``gpu`` has a precondition), or None."""
    if name != "gpu" or not hasattr(module, "cuda_missing"):
        return None
    return module.cuda_missing(suite_namespace(name, module, args, extra).device)


def combined(results: Sequence[SuiteResult]) -> SuiteResult:
    """Every row of every suite in one table, each case prefixed with its suite."""
    rows = [Row(f"{res.suite}: {r.case}", r.metric, r.unit, r.kvtier, r.baseline_name, r.baseline, r.ratio,
                r.kvtier_spread, r.baseline_spread) for res in results for r in res.rows]
    return SuiteResult("all", rows)


def summary(out: AllResult) -> str:
    """The table of every row, then one line per skipped or failed suite."""
    lines = [format_table(combined(out.results))]
    lines += [f"skipped {name}: {why}" for name, why in out.skipped.items()]
    lines += [f"FAILED {name}: {why}" for name, why in out.failed.items()]
    return "\n".join(lines)


__all__ = ["DESCRIPTION", "AllResult", "add_arguments", "combined", "run_all", "selected", "suite_flags",
           "suite_namespace", "summary"]
