"""What the soak watches from outside the daemon: /proc memory and descriptors, /dev/shm, REST stats.

Memory comes from ``/proc/<pid>/status``. ``VmRSS`` is ``RssAnon + RssFile + RssShmem``:

* ``RssAnon``: the daemon's private memory (Python heap, index, RocksDB memtables and caches,
  socket buffers it copied into);
* ``RssFile``: file pages it maps (the interpreter, shared libraries);
* ``RssShmem``: pages of the host tier's shared-memory segments that the daemon itself has touched
  (it pre-faults the whole tier at start, so this is the tier's size). The same pages are counted
  again in every client that maps them: RSS counts mapped pages per process, not memory used.

``VmHWM`` is the kernel's own peak of ``VmRSS``, so no sample can miss a short spike. Stdlib only.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.daemon.store.shm import SHM_DIR

_MEMORY_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory(pid: int) -> dict[str, int]:
    """The memory fields of ``/proc/<pid>/status`` in bytes."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in _MEMORY_FIELDS:
                out[name] = int(value.split()[0]) * 1024  # always kB
    return out


def fd_census(pid: int, data_dir: Path) -> dict[str, int]:
    """The daemon's open descriptors by what they point at.

    Kinds: ``socket``, ``shm`` (files under /dev/shm), ``disk tier`` (files under ``data_dir``:
    RocksDB's tables, blob files, log and lock; their number follows flushes and compactions, not
    clients; ``disk tier deleted``: files RocksDB made obsolete and has not closed yet), ``pipe``,
    ``anon_inode`` (epoll, eventfd), ``deleted`` (another file unlinked while open) and ``other``.
    """
    counts: dict[str, int] = {}
    base = f"/proc/{pid}/fd"
    prefix = str(data_dir.resolve()) + os.sep
    for name in os.listdir(base):
        try:
            target = os.readlink(os.path.join(base, name))
        except FileNotFoundError:
            continue  # closed while we looked
        deleted = target.endswith(" (deleted)")
        if target.startswith(prefix):
            kind = "disk tier deleted" if deleted else "disk tier"
        elif deleted:
            kind = "deleted"
        elif target.startswith("socket:"):
            kind = "socket"
        elif target.startswith("pipe:"):
            kind = "pipe"
        elif target.startswith("anon_inode:"):
            kind = "anon_inode"
        elif target.startswith(SHM_DIR + "/"):
            kind = "shm"
        else:
            kind = "other"
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def shm_segments(prefix: str) -> list[str]:
    """Names of the /dev/shm files whose name starts with ``prefix`` (one daemon's segments)."""
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def rest_stats(rest: str, token: str | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """``GET /v1/stats`` of the daemon's REST API (``rest`` = ``http://host:port``); ``token``: the
    daemon's token (REST reads need one unless ``rest.public_reads``)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(f"{rest}/v1/stats", headers=headers), timeout=timeout_s) as r:
        return json.loads(r.read())


@dataclass(slots=True)
class Sampler:
    """Samples the daemon's memory every ``interval_s`` and its counters every second, in a thread.

    Attributes:
        peak: the largest value seen of each memory field (bytes).
        seconds: counter deltas per whole second: ``(host evictions, disk evictions, commits)``.
    """

    pid: int
    stats: Callable[[], dict[str, Any]]
    interval_s: float = 0.1
    peak: dict[str, int] = field(default_factory=dict)
    seconds: list[tuple[int, int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _counters(self) -> tuple[int, int, int]:
        c = self.stats()["counters"]
        return c["tiers"]["host"]["evictions"], c["tiers"]["disk"]["evictions"], c["commits"]

    def _run(self) -> None:
        try:
            last = self._counters()
            next_tick = time.monotonic() + 1.0
            while not self._stop.wait(self.interval_s):
                for name, value in memory(self.pid).items():
                    self.peak[name] = max(self.peak.get(name, 0), value)
                if time.monotonic() >= next_tick:
                    next_tick += 1.0
                    now = self._counters()
                    self.seconds.append((now[0] - last[0], now[1] - last[1], now[2] - last[2]))
                    last = now
        except Exception as exc:  # the soak reports a sampler that died rather than hanging on it
            self.errors.append(f"{type(exc).__name__}: {exc}")
