"""Why a client call found the daemon unavailable: both are :class:`Unavailable` (wire code
``unavailable``), split so that retry logic and callers can tell a lost connection from silence."""

from __future__ import annotations

from kvtier_protocol.errors import Unavailable


class ConnectionLost(Unavailable):
    """The connection could not be made, or broke (refused, reset, closed by the daemon).

    Idempotent calls reconnect and retry after it; it is also raised by a call made on a
    connection that another call found broken.
    """


class TimedOut(Unavailable):
    """The daemon did not answer within the call's ``timeout_s`` (or ``connect_timeout_s``).

    Never retried: a stuck daemon would only make the caller wait again. The connection is
    dropped, since a late answer could no longer be matched safely.
    """


class Unreachable(ConnectionLost):
    """No connection could be made: no socket, refused, or no route. Like a timeout, it starts the
    client's hold-down; a connection lost mid-call does not (the daemon may just have restarted)."""
