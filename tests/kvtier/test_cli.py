"""The `kvtier` command line: parsing and suite dispatch."""

from __future__ import annotations

import pytest

from kvtier.bench import SUITES
from kvtier.cli import build_parser, main


def test_every_bench_suite_is_listed_without_importing_it() -> None:
    parser = build_parser(["--help"])
    sub = next(a for a in parser._actions if a.dest == "command")
    bench = sub.choices["bench"]
    suites = next(a for a in bench._actions if a.dest == "suite")
    assert set(suites.choices) == set(SUITES) | {"all"}  # `bench all` runs every suite


def test_unknown_suite_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "no-such-suite"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("kvtier ")
