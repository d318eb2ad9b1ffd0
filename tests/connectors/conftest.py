"""Connector tests: with ``KVTIER_REQUIRE_ENGINES=1`` (tools/conformance.sh, inside the engine-interface
environment) a test module skipped because vLLM or SGLang does not import is a failure: there,
every conformance test must run."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("KVTIER_REQUIRE_ENGINES") == "1" and report.skipped:
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid}: skipped, but KVTIER_REQUIRE_ENGINES=1 needs it to run ({report.longrepr})"
