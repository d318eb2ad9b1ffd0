"""Many hosts on one machine (issue 23): network namespaces, a Redis Cluster spread over them.

:func:`many_hosts` is the whole setup as a context manager, for a ``scope="module"`` fixture::

    @pytest.fixture(scope="module")
    def world(tmp_path_factory):
        with many_hosts(tmp_path_factory.mktemp("hosts")) as w:
            yield w

It skips the test (printing why) where namespaces cannot be made (not root, no ``ip``, no
``redis-server``), and fails it instead when ``KVTIER_REQUIRE_NETNS=1`` (set by ``.ci/run``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.manyhosts.netns import Fabric, Host, NetnsLoop, NetnsUnavailable, check_prerequisites, skip_or_fail
from tests.manyhosts.rediscluster import RedisCluster
from tests.manyhosts.tls import TlsFiles, make_tls


@dataclass
class ManyHosts:
    """Attributes:
        fabric: the namespaces.
        servers: the hosts that run the cluster (``h1``..``h3``).
        client: the test's own host (``h4``): no server runs there.
        cluster: the Redis Cluster over ``servers`` (``cluster.tls``: its certificates, or None).
        loop: an event loop inside ``client``: ``loop.run(coro)`` talks from the client host.
    """

    fabric: Fabric
    servers: list[Host]
    client: Host
    cluster: RedisCluster
    loop: NetnsLoop


@contextmanager
def many_hosts(workdir: Path, *, servers: int = 3, tls: bool = False) -> Iterator[ManyHosts]:
    """``servers`` hosts running a cluster (two nodes each: masters + replicas), plus a client
    host with an event loop in it; all torn down on exit, on failure too.

    ``tls``: the cluster speaks TLS only (clients, bus, replication), with certificates of a
    throw-away CA (``cluster.tls.ca``); needs the ``openssl`` command."""
    try:
        check_prerequisites("redis-server", "redis-cli", *(("openssl",) if tls else ()))
        fabric = Fabric(servers + 1)
    except NetnsUnavailable as e:
        skip_or_fail(str(e))
        raise AssertionError("unreachable: skip_or_fail raises") from e
    certs: TlsFiles | None = None
    try:
        if tls:
            certs = make_tls(workdir / "tls", [h.address for h in fabric.hosts[:servers]])
    except BaseException:
        fabric.close()
        raise
    cluster = RedisCluster(fabric.hosts[:servers], workdir, tls=certs)
    loop: NetnsLoop | None = None
    try:
        cluster.start()
        loop = NetnsLoop(fabric.hosts[servers])
        yield ManyHosts(fabric, fabric.hosts[:servers], fabric.hosts[servers], cluster, loop)
    finally:
        if loop is not None:
            loop.close()
        cluster.stop()
        fabric.close()


__all__ = ["Fabric", "Host", "ManyHosts", "NetnsLoop", "NetnsUnavailable", "RedisCluster", "TlsFiles", "many_hosts"]
