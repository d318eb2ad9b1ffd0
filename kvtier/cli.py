"""The `kvtier` command line."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from kvtier import __version__
from kvtier.bench import SUITES

COMMANDS: tuple[str, ...] = (
    "kvtier.commands.serve",
    "kvtier.commands.size",
    "kvtier.commands.admin",
    "kvtier.commands.engine",
)
"""Modules under kvtier/commands/ that each expose ``register(subparsers)``: it adds its
subcommands with ``set_defaults(func=...)``; func(args) -> exit status. Keep their top-level
imports light (argparse only): heavy imports belong inside func."""


def _common_bench_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="CI-sized run: small sizes, few repetitions")
    p.add_argument("--repetitions", type=int, default=None, help="repetitions per figure (median reported)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the rows as JSON")
    p.add_argument("--plot", metavar="DIR", default=None,
                   help="also draw PNG bar charts of kvtier vs baseline into DIR (needs matplotlib)")


def _add_bench(sub: argparse._SubParsersAction, argv: Sequence[str]) -> None:
    bench = sub.add_parser("bench", help="measure kvtier next to its baselines")
    suites = bench.add_subparsers(dest="suite", required=True, metavar="SUITE")
    # Import only the suite named on the command line: its flags are needed to parse, the others'
    # are not, and their imports (torch, RocksDB, ...) would only cost time.
    chosen = argv[1] if len(argv) > 1 and argv[0] == "bench" else None
    for name, (module_path, help_text) in SUITES.items():
        p = suites.add_parser(name, help=help_text, description=help_text)
        _common_bench_flags(p)
        if name == chosen:
            mod = importlib.import_module(module_path)
            mod.add_arguments(p)
            p.set_defaults(func=_run_bench, module=mod)
    from kvtier.bench import all as bench_all  # light: imports no suite until it runs

    p = suites.add_parser("all", help=bench_all.DESCRIPTION, description=bench_all.DESCRIPTION)
    _common_bench_flags(p)
    bench_all.add_arguments(p)
    p.set_defaults(func=_run_bench_all)


def _check_plot(args: argparse.Namespace) -> bool:
    """Fail before a long run, not after it, when --plot cannot be honoured."""
    if not args.plot:
        return True
    from kvtier.bench.plot import PlotUnavailable, require_matplotlib

    try:
        require_matplotlib()
    except PlotUnavailable as exc:
        print(f"kvtier bench: {exc}", file=sys.stderr)
        return False
    return True


def _plot(results: Sequence[object], out_dir: str) -> None:
    from kvtier.bench.plot import plot_results
    from kvtier.bench.report import progress

    for path in plot_results(results, out_dir):  # type: ignore[arg-type]
        progress(f"chart: {path}")


def _run_bench(args: argparse.Namespace) -> int:
    from kvtier.bench.report import emit

    if not _check_plot(args):
        return 2
    result = args.module.run(args)
    emit([result], json_path=args.json)
    if args.plot:
        _plot([result], args.plot)
    return 0


def _run_bench_all(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from kvtier.bench.all import run_all, summary

    if not _check_plot(args):
        return 2
    out = run_all(args)
    print(summary(out))
    if args.json:  # always a list here, one object per suite that ran
        Path(args.json).write_text(json.dumps([r.to_json() for r in out.results], indent=2) + "\n")
    if args.plot:
        _plot(out.results, args.plot)
    return 1 if out.failed else 0


def _add_selftest(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="round-trip blocks through every tier and codec on this machine")
    p.add_argument("--data-dir", default=None, help="where the disk tier goes (default: a temp dir)")
    p.set_defaults(func=_run_selftest)


def _run_selftest(args: argparse.Namespace) -> int:
    from kvtier.commands.selftest import run

    return run(args)


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtier", description="kvtier KV-cache store")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_bench(sub, argv)
    _add_selftest(sub)
    for module_path in COMMANDS:
        importlib.import_module(module_path).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    from kvtier_protocol.errors import KVTierError

    try:
        return int(args.func(args) or 0)
    except (KVTierError, OSError) as exc:
        # What escapes a command here is the user's to fix (a path that cannot be used, a request
        # the daemon refused): one line and the usage-error status, as argparse gives, never a
        # traceback. Commands with their own reporting (serve, admin, engine) answer before this.
        print(f"kvtier {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
