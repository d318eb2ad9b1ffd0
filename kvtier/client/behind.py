"""Write-behind saves (``ClientOptions.write_behind``): what becomes of commits nobody waits for.

A write-behind save returns once its payloads are in shared memory; its commits travel on, and
their answers are claimed later by the connection (kvtier.client.save). Two things follow:

* a commit the daemon refuses, or whose answer a broken connection swallows, surfaces after the
  save returned: :class:`LateErrors` logs it, counts it and keeps it for ``flush()`` to raise;
* the blocking client holds the last commit back so that the next request leaves in the same
  write (kvtier.client.steps.JUMP_OPS); :class:`DeferredFlush` writes it anyway if no request
  comes within :data:`FLUSH_AFTER_S`, so a client that goes quiet still commits (a reservation
  left uncommitted would expire, and its blocks would be lost).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable

from kvtier_protocol.errors import KVTierError

log = logging.getLogger("kvtier.client")

FLUSH_AFTER_S = 0.002
"""Longest a write-behind commit is held back waiting for the next request to share its write:
next to a save's copies (milliseconds) it is nothing, and the next save of a stream comes sooner."""


class LateErrors:
    """Write-behind commits that failed after their save returned, since the last :meth:`take`."""

    def __init__(self) -> None:
        self._errors: list[KVTierError] = []
        self.total = 0  # since the client was made, for its owner's counters

    def add(self, exc: KVTierError, what: str) -> None:
        """Record (and log) one failure; ``what`` says which commits it concerns."""
        log.warning("kvtier client: a write-behind commit failed after its save returned "
                    "(%s): %s", what, exc)
        self._errors.append(exc)
        self.total += 1

    def answer_failed(self, exc: KVTierError, *, broken: bool, after: int) -> None:
        """Record a kept commit whose answer was ``exc``: refused by the daemon, or, when the
        connection ``broken``, of unknown fate, like the ``after`` kept commits behind it."""
        if broken:
            self.lost(exc, after + 1)
        else:
            self.add(exc, "its blocks are not stored")

    def lost(self, exc: KVTierError, count: int) -> None:
        """Record ``count`` kept commits whose answers the broken connection (``exc``) took."""
        self.add(exc, f"{count} commits unanswered; their blocks may or may not be stored")

    def raise_first(self) -> None:
        """Raise the oldest failure recorded since the last call (and forget them all)."""
        errors = self.take()
        if errors:
            raise errors[0]

    def absorb(self, other: LateErrors) -> None:
        """Take over ``other``'s failures and count (a connection's, as it is replaced)."""
        self._errors += other.take()
        self.total += other.total
        other.total = 0

    def take(self) -> list[KVTierError]:
        """The failures recorded since the last call, oldest first (and forget them)."""
        errors, self._errors = self._errors, []
        return errors


class DeferredFlush:
    """Calls ``flush`` once, ``delay_s`` (default :data:`FLUSH_AFTER_S`) after the latest
    :meth:`arm`, unless re-armed first.

    One thread per client, started at the first :meth:`arm`; it holds only a weak reference to
    the flush method's owner, so a client dropped without ``close`` is still collected (and its
    thread ends).
    """

    def __init__(self, flush: Callable[[], None], delay_s: float | None = None) -> None:
        self._flush = weakref.WeakMethod(flush)  # type: ignore[arg-type]
        self._delay_s = delay_s  # None: FLUSH_AFTER_S, read at each arm
        self._cond = threading.Condition()
        self._due: float | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    def arm(self) -> None:
        """Flush ``delay_s`` from now (a pending flush moves there)."""
        with self._cond:
            if self._closed:
                return
            idle = self._due is None
            self._due = time.monotonic() + (FLUSH_AFTER_S if self._delay_s is None else self._delay_s)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvtier-client-flush", daemon=True)
                self._thread.start()
            if idle:  # else the thread is waiting for the earlier due time, and looks again then
                self._cond.notify()

    def close(self) -> None:
        """Stop the thread (a pending flush is dropped: the caller flushes itself)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._due is None:
                        self._cond.wait()
                        continue
                    wait = self._due - time.monotonic()
                    if wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._closed:
                    return
                self._due = None
            flush = self._flush()
            if flush is None:  # the client is gone
                return
            flush()
            del flush


__all__ = ["FLUSH_AFTER_S", "DeferredFlush", "LateErrors"]
