"""kvtier.bench.daemon.BenchDaemon.running: a real ``kvtier serve``, stopped and cleaned up however
the block ends; its CPU time read while it runs."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from kvtier.bench.daemon import BenchDaemon
from kvtier.client import Client


def test_running_serves_then_stops_and_removes_its_dir_even_on_failure(capsys: pytest.CaptureFixture[str]) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvb-", dir="/tmp"))  # short: the socket path must fit
    daemon = BenchDaemon(work, ["--rest", "off", "--host-bytes", str(64 << 20), "--disk-bytes", "0"], suite="t")
    assert daemon.cpu_seconds() is None  # not started
    with pytest.raises(ZeroDivisionError), daemon.running() as running:
        assert running is daemon
        before = daemon.cpu_seconds()
        assert before is not None and before > 0  # starting took CPU (Linux /proc)
        with Client.connect(daemon.address, timeout_s=10.0) as client:
            for _ in range(200):
                assert client.ping() >= 0
        after = daemon.cpu_seconds()
        assert after is not None and after > before  # answering the pings took more
        proc = daemon.proc
        1 / 0
    assert proc is not None and proc.poll() is not None, "the daemon was stopped"
    assert daemon.proc is None and not work.exists()
    assert "t: failed; the daemon's log ends with:" in capsys.readouterr().err
