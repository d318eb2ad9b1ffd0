"""Where a remote tier is: the cluster URL kvtier accepts and the key prefix rule. No I/O, no redis-py
(the configuration checks these without the ``kvtier[remote]`` extra installed)."""

from __future__ import annotations

import re
from dataclasses import dataclass

SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
"""URL scheme -> TLS."""
DEFAULT_PORT = 6379
PREFIX = re.compile(r"[A-Za-z0-9_.-]{1,64}")
"""A key prefix: no ``:`` (the key's separator), no ``{``/``}`` (a hash tag would pin keys to one
shard)."""


@dataclass(frozen=True, slots=True)
class ClusterAddress:
    """The seed nodes of a cluster URL and whether to speak TLS."""

    nodes: tuple[tuple[str, int], ...]
    tls: bool

    def __str__(self) -> str:
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)


def parse_cluster_url(url: str) -> ClusterAddress:
    """Parse ``redis+cluster://HOST:PORT[,HOST:PORT...]`` (``rediss+cluster://`` for TLS).

    A port defaults to 6379; an IPv6 host is written in brackets. Credentials are refused in the
    URL (they would end up in logs and process listings): use the user and password file settings.

    Raises:
        ValueError: another scheme, no node, a bad port, credentials, a path or a query.
    """
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"a remote cluster URL starts with redis+cluster:// or rediss+cluster://, got {url!r:.80}")
    if "@" in rest:
        raise ValueError("credentials do not go in the cluster URL: set the user and a password file")
    if any(c in rest for c in "/?#"):
        raise ValueError(f"a cluster URL holds seed nodes only (HOST:PORT,...), got {url!r:.80}")
    nodes: list[tuple[str, int]] = []
    for part in rest.split(","):
        if part.startswith("["):
            host, close, tail = part[1:].partition("]")
            if not close or (tail and not tail.startswith(":")):
                raise ValueError(f"bad IPv6 seed node {part!r}")
            port_s = tail[1:] if tail else ""
        else:
            host, _, port_s = part.partition(":")
        if not host:
            raise ValueError(f"empty host in cluster URL {url!r:.80}")
        try:
            port = int(port_s) if port_s else DEFAULT_PORT
        except ValueError:
            raise ValueError(f"bad port {port_s!r} in cluster URL") from None
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range in cluster URL")
        nodes.append((host, port))
    return ClusterAddress(tuple(nodes), SCHEMES[scheme])
