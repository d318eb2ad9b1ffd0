"""A one-line progress display on stderr for long CLI work (an engine run, a benchmark).

In a terminal the line is rewritten in place (``\\r``) with what is being done and for how long;
when stderr is not a terminal (a log, a pipe, CI) nothing is drawn, so captured output stays what
the command prints for good. Standard library only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

MIN_INTERVAL_S = 0.1
"""Redraws closer together than this are skipped: a tight loop must not spend its time drawing."""


class Progress:
    """One status line, drawn while the work runs and erased when it ends.

    Args:
        label: what the work is (``"kvtier engine"``), shown before every status.
        stream: where to draw; None: ``sys.stderr`` as it is when the display opens.
        enabled: draw or not; None: only when ``stream`` is a terminal.
        clock: seconds, monotonic (tests pass a fake one).
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, enabled: bool | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self._clock = clock
        self._start = clock()
        self._drawn_at: float | None = None
        self._width = 0

    def update(self, status: str, *, force: bool = False) -> None:
        """Show ``status`` (and the time since the display opened), at most every MIN_INTERVAL_S."""
        if not self.enabled:
            return
        now = self._clock()
        if not force and self._drawn_at is not None and now - self._drawn_at < MIN_INTERVAL_S:
            return
        self._drawn_at = now
        line = f"{self.label}: {status} ({now - self._start:.0f} s)"
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def close(self) -> None:
        """Erase the line, so what the command prints next starts on a clean line."""
        if self.enabled and self._drawn_at is not None:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._drawn_at = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
