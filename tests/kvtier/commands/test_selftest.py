"""`kvtier selftest` — what the README's set-up section offers as a first check — passes on this machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_selftest_command_passes(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier", "selftest", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines and all(line.startswith("[ok]") for line in lines), out.stdout
    assert any("flipped on disk" in line for line in lines)
    assert any(line.startswith("[ok] payload copies into and out of host slots: ") for line in lines)
    assert (tmp_path / "CURRENT").exists() or any(tmp_path.iterdir()), "the disk tier wrote to --data-dir"


def test_an_unusable_data_dir_is_one_line_and_status_2() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier", "selftest", "--data-dir", "/proc/kvtier-no-such-dir"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith("kvtier selftest: ") and "/proc/kvtier-no-such-dir" in line
