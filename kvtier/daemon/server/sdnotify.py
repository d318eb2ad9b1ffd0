"""systemd's readiness protocol (``sd_notify``) without libsystemd: one datagram to ``$NOTIFY_SOCKET``.

A ``Type=notify`` unit is started once the daemon sends ``READY=1``; ``STOPPING=1`` tells systemd
the shutdown has begun, ``STATUS=...`` is what ``systemctl status`` shows. Outside systemd
(no ``$NOTIFY_SOCKET``) every call is a no-op. A leading ``@`` names a socket in the abstract
namespace (its address starts with a NUL byte).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class SdNotifier:
    """Sends state lines to systemd's notify socket.

    Args:
        env: where ``NOTIFY_SOCKET`` is read (the process environment by default).
    """

    def __init__(self, env: Mapping[str, str] = os.environ) -> None:
        path = env.get("NOTIFY_SOCKET") or ""
        self.address: str | bytes | None = None
        if path.startswith("@"):
            self.address = b"\0" + os.fsencode(path[1:])
        elif path.startswith("/"):
            self.address = path

    @property
    def enabled(self) -> bool:
        """Whether a notify socket was given."""
        return self.address is not None

    def notify(self, **state: str | int) -> bool:
        """Send ``KEY=value`` lines, e.g. ``notify(READY=1, STATUS="serving")``.

        Returns:
            True when the datagram was sent; False without a notify socket or when sending
            failed (logged: systemd then times the unit out, which says more than a crash here).
        """
        if self.address is None or not state:
            return False
        lines = "".join(f"{key}={str(value).replace(chr(10), ' ')}\n" for key, value in state.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(lines.encode(), self.address)
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self.address, e)
            return False
        return True

    def ready(self, status: str = "") -> bool:
        """``READY=1`` (and ``STATUS``)."""
        return self.notify(READY=1, **({"STATUS": status} if status else {}))

    def stopping(self, status: str = "") -> bool:
        """``STOPPING=1`` (and ``STATUS``)."""
        return self.notify(STOPPING=1, **({"STATUS": status} if status else {}))

    def status(self, text: str) -> bool:
        """``STATUS=text``."""
        return self.notify(STATUS=text)
