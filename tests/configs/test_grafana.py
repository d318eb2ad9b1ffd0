"""The Grafana dashboard and its provisioning example: usable as provisioned from files, with a
datasource and a tenant variable, and GPU panels that say "no GPU" instead of staying blank.

(That the dashboard queries only metrics the daemon exports is checked against a real metrics
render in tests/kvtier/daemon/server/test_metrics.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from kvtier.daemon.server.metrics import GPU_METRIC_NAMES, STORE_COUNTERS, STORE_GAUGES, TIER_COUNTERS, TIER_GAUGES
from kvtier.daemon.server.remote_views import REMOTE_METRIC_NAMES

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "configs" / "grafana-dashboard.json").read_text())


def _tenant_labelled() -> set[str]:
    """Sample names of the metrics that carry a ``tenant`` label (every store metric)."""
    counters = {e.name if e.name.endswith("_total") else e.name + "_total" for e in (*STORE_COUNTERS, *TIER_COUNTERS)}
    return counters | {e.name for e in (*STORE_GAUGES, *TIER_GAUGES)} | set(REMOTE_METRIC_NAMES)


def _nodes(node: Any) -> list[dict[str, Any]]:
    found = []
    if isinstance(node, dict):
        found.append(node)
        for v in node.values():
            found += _nodes(v)
    elif isinstance(node, list):
        for v in node:
            found += _nodes(v)
    return found


def _variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in DASHBOARD["templating"]["list"]}


def test_no_import_time_input_is_left_unresolved_by_file_provisioning() -> None:
    text = json.dumps(DASHBOARD)
    assert "__inputs" not in DASHBOARD
    assert "${DS_" not in text


def test_every_query_goes_through_the_datasource_variable() -> None:
    var = _variables()["datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    sources = [n["datasource"] for n in _nodes(DASHBOARD) if isinstance(n.get("datasource"), dict)]
    assert len(sources) >= 20
    assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), sources


def test_every_tenant_labelled_metric_is_filtered_by_the_tenant_variable() -> None:
    var = _variables()["tenant"]
    assert var["includeAll"] and var["allValue"] == ".*"  # the default store's label is "": All selects it
    assert "tenant" in var["query"]["query"]
    labelled = _tenant_labelled()
    selectors = [m for n in _nodes(DASHBOARD) if isinstance(n.get("expr"), str)
                 for m in re.finditer(r"\b(kvtier_[a-z0-9_]+)(\{[^}]*\})?", n["expr"])]
    checked = 0
    for sel in selectors:
        if sel.group(1) in labelled:
            assert sel.group(2) and 'tenant=~"$tenant"' in sel.group(2), sel.group(0)
            checked += 1
        else:
            assert "tenant" not in (sel.group(2) or ""), f"{sel.group(0)} has no tenant label"
    assert checked >= 20


def test_gpu_panels_say_no_gpu_when_there_is_none() -> None:
    gpu_panels = [p for p in DASHBOARD["panels"] if any(name in json.dumps(p) for name in GPU_METRIC_NAMES)]
    assert len(gpu_panels) == 2
    for panel in gpu_panels:
        assert panel["fieldConfig"]["defaults"]["noValue"] == "no GPU", panel["title"]


def test_provisioning_example_parses_and_matches_the_dashboard() -> None:
    sources = yaml.safe_load((ROOT / "configs" / "grafana" / "datasources" / "kvtier.yaml").read_text())
    (source,) = sources["datasources"]
    assert sources["apiVersion"] == 1 and source["type"] == "prometheus"
    boards = yaml.safe_load((ROOT / "configs" / "grafana" / "dashboards" / "kvtier.yaml").read_text())
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
