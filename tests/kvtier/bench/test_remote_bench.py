"""`kvtier bench remote` runs against a loopback cluster it starts and writes the JSON form (speed is
printed, never asserted)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtier.cli import main


@pytest.mark.skipif(shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
                    reason="needs Debian's redis-server and redis-cli (the README's test command installs them)")
def test_bench_remote_quick_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "remote.json"
    assert main(["bench", "remote", "--quick", "--repetitions", "1", "--sizes-mib", "1", "--working-set-mib", "4",
                 "--clients", "1", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "remote"
    rows = {r["metric"]: r for r in doc["rows"]}
    assert set(rows) == {"upload", "fetch (verified)"}
    for row in rows.values():
        assert row["case"] == "1 MiB blocks, 4 MiB, 1 clients" and row["unit"] == "GB/s"
        assert row["kvtier"] > 0 and row["baseline"] > 0
        assert row["baseline_name"].startswith("redis-py RedisCluster pipeline")
