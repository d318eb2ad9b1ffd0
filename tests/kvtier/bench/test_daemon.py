"""kvtier.bench.daemon.BenchDaemon.running: a real ``kvtier serve``, stopped and cleaned up however
the block ends; its CPU time read while it runs."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
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
        with Client.connect(daemon.address, timeout_s=60.0) as client:
            for _ in range(200):
                assert client.ping() >= 0
        after = daemon.cpu_seconds()
        assert after is not None and after > before  # answering the pings took more
        proc = daemon.proc
        1 / 0
    assert proc is not None and proc.poll() is not None, "the daemon was stopped"
    assert daemon.proc is None and not work.exists()
    assert "t: failed; the daemon's log ends with:" in capsys.readouterr().err


BURN_THEN_END = """
import sys, threading
stop = threading.Event()
def burn():  # spins until told to stop, then the thread ends
    while not stop.is_set():
        pass
worker = threading.Thread(target=burn)
worker.start()
sys.stdin.readline()
stop.set()
worker.join()
print("ended", flush=True)
sys.stdin.readline()
"""


def test_cpu_seconds_keeps_the_time_of_a_thread_that_ended(tmp_path: Path) -> None:
    # The daemon's start-up prefault thread ends a moment after it is ready: its time must not
    # vanish from the readings, or a window around its end reads negative.
    daemon = BenchDaemon(tmp_path, [], suite="t")
    proc = subprocess.Popen([sys.executable, "-c", BURN_THEN_END], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    daemon.proc = proc  # type: ignore[assignment]  # any process will do: only its /proc is read
    try:
        deadline = time.monotonic() + 30
        during = daemon.cpu_seconds()
        while during is not None and during < 0.1 and time.monotonic() < deadline:
            time.sleep(0.01)
            during = daemon.cpu_seconds()
        assert during is not None and during >= 0.1, "the burning thread was seen running"
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "ended"
        after = daemon.cpu_seconds()
        assert after is not None and after >= during  # the ended thread still counts
    finally:
        daemon.proc = None
        proc.kill()
        proc.communicate()  # reaps it and closes its pipes
