"""One log line when the daemon goes away and one when it is back, not one per failed call.

An engine keeps serving while kvtier is down (lookups miss, loads recompute), and it may call the
connector thousands of times a second: logging each failure would flood its log. Adapters hold an
:class:`OutageLog` and report every call's outcome to it.
"""

from __future__ import annotations

import logging
import threading

from kvtier_protocol.errors import KVTierError, Unavailable


class OutageLog:
    """Tracks whether the daemon is reachable and logs the transitions.

    Args:
        log: the adapter's logger.
        fallback: what the engine does instead, for the log lines (``"recomputing"``).
        prefix: put in front of the line of a failure that is not an outage.
    """

    def __init__(self, log: logging.Logger, fallback: str, prefix: str = "kvtier") -> None:
        self.log = log
        self.fallback = fallback
        self.prefix = prefix
        self._down = False
        self._lock = threading.Lock()  # adapters call from several engine threads

    def failed(self, op: str, exc: KVTierError) -> str:
        """Note a failed call of ``op``; returns a short reason for the caller's error reports.

        An outage (``Unavailable``) is logged when it starts; any other error is logged each time
        (it names a request-specific problem, not a state).
        """
        if not isinstance(exc, Unavailable):
            self.log.warning("%s: %s failed (%s: %s); %s", self.prefix, op, exc.code, exc.message, self.fallback)
            return f"{op} failed ({exc.code}: {exc.message})"
        with self._lock:
            first, self._down = not self._down, True
        if first:
            self.log.warning("kvtier daemon unavailable during %s (%s); %s until it is back",
                             op, exc.message, self.fallback)
        return f"daemon unavailable ({exc.message})"

    def ok(self) -> None:
        """Note a successful call; logs the end of an outage."""
        if self._down:
            with self._lock:
                was, self._down = self._down, False
            if was:
                self.log.info("kvtier daemon available again")
