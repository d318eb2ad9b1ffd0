"""``import kvtier.client`` loads none of the daemon's dependencies and no torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

HEAVY = ("aiohttp", "rocksdict", "prometheus_client", "zmq", "torch", "numpy", "kvtier.daemon.server",
         "kvtier.daemon.store")

CHECK = f"""
import sys
import kvtier.client
from kvtier.client import AsyncClient, Client, ClientOptions, LookupResult, connect, connect_async
Client("unix:/nonexistent.sock", timeout_s=1.0)
loaded = sorted(m for m in {HEAVY!r} if m in sys.modules)
print(",".join(loaded))
"""


def test_import_is_light() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "protocol")])}
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60,
                         cwd=ROOT, env=env, check=True)
    assert out.stdout.strip() == "", f"kvtier.client imported {out.stdout.strip()}"
