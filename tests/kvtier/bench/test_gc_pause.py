"""``python -m kvtier.bench.gc_pause``: the collector's pause over a small index, before and after a freeze."""

from __future__ import annotations

import re
import subprocess
import sys


def test_reports_the_index_and_both_pauses() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier.bench.gc_pause", "--blocks", "500"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.startswith("500 blocks indexed, ")
    assert re.search(r"^full collection: \d+\.\d{3} s$", out, re.M)
    assert re.search(r"^full collection after gc\.freeze\(\): \d+\.\d{3} s$", out, re.M)
