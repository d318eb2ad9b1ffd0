"""`kvtier bench`: suites that measure kvtier next to its reference in one run.

Each suite is a module exposing::

    DESCRIPTION: str
    def add_arguments(parser: argparse.ArgumentParser) -> None   # suite-specific flags
    def run(args: argparse.Namespace) -> SuiteResult             # measure, return rows

Common flags (added by the CLI for every suite): ``--quick`` (CI-sized), ``--repetitions N``,
``--json FILE``. Suites are imported lazily so one suite's dependencies never slow another.
"""

from __future__ import annotations

SUITES: dict[str, str] = {
    "codecs": "kvtier.bench.codecs",
    "store": "kvtier.bench.store",
}
