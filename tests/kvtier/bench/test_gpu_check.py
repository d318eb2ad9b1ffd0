"""tools/gpu-check.sh --dry-run: the GPU check's every step on the CPU with tiny sizes, in the current
venv (--no-venv), one JSON document to $OUT that says what it skipped for want of CUDA."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_the_dry_run_runs_every_step_and_says_what_it_skipped(tmp_path: Path) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="gc-", dir="/tmp"))  # short: the daemons' socket paths live under it
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable, "TMPDIR": str(scratch)}
    try:
        proc = subprocess.run([str(REPO / "tools" / "gpu-check.sh"), "--dry-run", "--no-venv"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=300)
        assert not list(scratch.iterdir()), "its temporary directory is removed"
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "gpu-check.json").read_text())
    assert doc["mode"] == "dry-run (CPU)" and doc["ok"] is True
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == ["venv", "install", "cuda", "gpu", "ttft"]
    assert "CUDA" in steps["cuda"]["skipped"] and any("cuda tests" in s for s in doc["skipped"])
    assert all(steps[n]["rc"] == 0 and "skipped" not in steps[n] for n in ("gpu", "ttft"))
    gpu_cases = {r["case"].rsplit(",", 1)[0] for r in steps["gpu"]["result"]["rows"]}
    assert "connector layer-wise load (daemon→device)" in gpu_cases
    partial = [r for r in steps["ttft"]["result"]["rows"] if "partial hit" in r["case"]]
    assert [r["metric"] for r in partial] == ["TTFT layer-wise vs load-then-compute"]
    assert all(c["passed"] for c in doc["checks"]) and len(doc["checks"]) == 2


def test_without_a_destination_it_refuses(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([str(REPO / "tools" / "gpu-check.sh"), "--dry-run", "--no-venv"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "set $OUT or give a path" in proc.stderr
