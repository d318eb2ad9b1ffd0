"""A Redis Cluster of Debian's ``redis-server`` spread over the simulated hosts of a :class:`Fabric`.

Per host ``nodes_per_host`` nodes bound to the host's fabric address (ports 7001, 7002, ...); with
three hosts and two nodes each, ``redis-cli --cluster create --cluster-replicas 1`` makes three
masters and three replicas, each replica on another host than its master. Started with the
settings kvtier expects of a cluster (``cluster-require-full-coverage no``, ``maxmemory`` +
``allkeys-lru``) and the ones that keep a test quick (``cluster-node-timeout 2000``,
``repl-diskless-sync-delay 0``, no persistence but ``nodes.conf``, so a killed node restarts as
the same node and rejoins).

Every wait polls a condition against a deadline; nothing sleeps for a guessed time.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.manyhosts.netns import Host
from tests.manyhosts.tls import TlsFiles

BASE_PORT = 7001


class ClusterError(Exception):
    """The cluster did not reach the state waited for (the message says which and why)."""


@dataclass
class Node:
    """One ``redis-server`` of the cluster.

    Attributes:
        host: the simulated host it runs in.
        port: its port on the host's address.
        dir: its working directory (``nodes.conf``, log).
        process: the running server, or None while stopped.
    """

    host: Host
    port: int
    dir: Path
    process: subprocess.Popen[bytes] | None = None
    tls: TlsFiles | None = None

    @property
    def address(self) -> str:
        return f"{self.host.address}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def cli(self, *args: str, check: bool = True, timeout: float = 10) -> str:
        """``redis-cli`` against this node, run in its host; the reply as text.

        Raises:
            subprocess.CalledProcessError / TimeoutExpired when ``check`` and the call fails.
        """
        r = self.host.run("redis-cli", *_cli_tls(self.tls), "-h", self.host.address, "-p", str(self.port),
                          *args, check=check, timeout=timeout)
        return r.stdout


@dataclass(frozen=True)
class NodeView:
    """One line of ``CLUSTER NODES``: ``id``, ``address`` (``ip:port``), ``flags``, the ``master``
    id of a replica, and the slot ranges a master serves."""

    id: str
    address: str
    flags: frozenset[str]
    master: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failed(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "noaddr"})

    def serves(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_nodes(text: str) -> list[NodeView]:
    """Parse ``CLUSTER NODES`` output."""
    out = []
    for line in text.strip().splitlines():
        f = line.split()
        slots = []
        for s in f[8:]:
            if s.startswith("["):  # a slot being migrated: not served yet
                continue
            lo, _, hi = s.partition("-")
            slots.append((int(lo), int(hi or lo)))
        out.append(NodeView(id=f[0], address=f[1].split("@")[0], flags=frozenset(f[2].split(",")),
                            master=None if f[3] == "-" else f[3], slots=tuple(slots)))
    return out


def wait_for(what: str, condition: Callable[[], str], timeout_s: float) -> None:
    """Poll ``condition`` (which returns "" when satisfied, else what is still wrong) until it
    holds, or raise ClusterError naming ``what`` and the last thing wrong."""
    deadline = time.monotonic() + timeout_s
    while True:
        wrong = condition()
        if not wrong:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"{what}: still {wrong} after {timeout_s} s")
        time.sleep(0.05)  # poll interval of a condition wait, not a guessed delay


@dataclass
class RedisCluster:
    """A running cluster over ``hosts``. Use :meth:`start`; :meth:`stop` on teardown.

    Attributes:
        nodes: every node, in creation order (the first ``len(hosts)`` become masters).
        url: the seed list as kvtier takes it (``redis+cluster://...``), every node.
    """

    hosts: Sequence[Host]
    workdir: Path
    nodes_per_host: int = 2
    maxmemory: str = "256mb"
    tls: TlsFiles | None = None
    nodes: list[Node] = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "rediss+cluster" if self.tls else "redis+cluster"
        return f"{scheme}://" + ",".join(n.address for n in self.nodes)

    def start(self, timeout_s: float = 60) -> None:
        """Start every node, create the cluster, wait until it is healthy.

        Raises:
            ClusterError: it did not get healthy in time; subprocess errors from ``redis-cli``.
        """
        for k in range(self.nodes_per_host):
            for host in self.hosts:
                node = Node(host, BASE_PORT + k, self.workdir / f"{host.name}-{BASE_PORT + k}", tls=self.tls)
                node.dir.mkdir(parents=True, exist_ok=True)
                self.nodes.append(node)
        for node in self.nodes:
            self.start_node(node)
        for node in self.nodes:
            wait_for(f"{node.address} answering", lambda n=node: "" if _pong(n) else "no PONG", timeout_s)
        first = self.nodes[0]
        first.host.run("redis-cli", *_cli_tls(self.tls), "--cluster", "create", *(n.address for n in self.nodes),
                       "--cluster-replicas", "1", "--cluster-yes", timeout=timeout_s)
        self.wait_healthy(timeout_s)

    def start_node(self, node: Node) -> None:
        """Start (or restart, as the same cluster node) one server."""
        assert not node.alive, f"{node.address} is running"
        port = ["--port", str(node.port)]
        if self.tls is not None:  # TLS only: clients, the cluster bus and replication
            port = ["--port", "0", "--tls-port", str(node.port), "--tls-cluster", "yes",
                    "--tls-replication", "yes", "--tls-auth-clients", "no",
                    "--tls-cert-file", str(self.tls.cert), "--tls-key-file", str(self.tls.key),
                    "--tls-ca-cert-file", str(self.tls.ca)]
        node.process = node.host.popen([
            "redis-server", "--bind", node.host.address, *port,
            "--protected-mode", "no", "--dir", str(node.dir), "--logfile", "",
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", "2000", "--cluster-require-full-coverage", "no",
            "--repl-diskless-sync", "yes", "--repl-diskless-sync-delay", "0",
            "--save", "", "--appendonly", "no",
            "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
        ], node.dir / "server.log")

    def kill(self, node: Node) -> None:
        """SIGKILL one server (a crash: no goodbye to its peers)."""
        assert node.process is not None
        node.process.kill()
        node.process.wait(timeout=30)
        node.process = None

    def stop(self) -> None:
        """Kill every server (teardown; idempotent)."""
        for node in self.nodes:
            if node.alive:
                self.kill(node)

    def live(self) -> list[Node]:
        return [n for n in self.nodes if n.alive]

    def node_at(self, address: str) -> Node:
        return next(n for n in self.nodes if n.address == address)

    def topology(self) -> list[NodeView]:
        """``CLUSTER NODES`` as seen by the first live node that answers."""
        return self._topology_from(self.live())

    def _topology_from(self, nodes: Sequence[Node]) -> list[NodeView]:
        for node in nodes:
            try:
                return parse_nodes(node.cli("cluster", "nodes", timeout=5))
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                continue
        raise ClusterError("no live node answers CLUSTER NODES")

    def masters(self) -> list[Node]:
        """The nodes serving slots now, by the topology's account."""
        return [self.node_at(v.address) for v in self.topology() if v.is_master and v.slots and not v.failed]

    def master_of(self, key: bytes | str) -> Node:
        """The node serving ``key``'s slot now."""
        k = key.decode() if isinstance(key, bytes) else key
        slot = int(self.live()[0].cli("cluster", "keyslot", k).strip())
        for v in self.topology():
            if v.is_master and not v.failed and v.serves(slot):
                return self.node_at(v.address)
        raise ClusterError(f"no master serves slot {slot}")

    def health(self) -> str:
        """"" when healthy, else what is not: every node up, in ``cluster_state:ok`` with all
        slots served, three masters each with a replica whose link is up, none flagged failing."""
        if len(self.live()) != len(self.nodes):
            return "a node is stopped"
        for node in self.nodes:
            try:
                info = node.cli("cluster", "info", timeout=5)
            except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
                return f"{node.address} does not answer"
            if "cluster_state:ok" not in info or "cluster_slots_ok:16384" not in info:
                return f"{node.address} not ok"
        views = self.topology()
        if any(v.failed for v in views):
            return "a node is flagged failing"
        masters = [v for v in views if v.is_master and v.slots]
        if len(masters) != len(self.hosts):
            return f"{len(masters)} masters"
        for m in masters:
            replicas = [v for v in views if v.master == m.id]
            if not replicas:
                return f"{m.address} has no replica"
            for r in replicas:
                info = self.node_at(r.address).cli("info", "replication", timeout=5)
                if "master_link_status:up" not in info:
                    return f"replica {r.address} link not up"
        return ""

    def wait_healthy(self, timeout_s: float = 60) -> None:
        """Wait until :meth:`health` is empty (the first sync of each replica included: a
        failover before it fails with "Currently unable to failover")."""
        wait_for("cluster healthy", self.health, timeout_s)

    def wait_replicated(self, timeout_s: float = 30) -> None:
        """Wait until every replica has acknowledged everything its master has written."""
        def lag() -> str:
            for m in self.masters():
                info = dict(line.split(":", 1) for line in m.cli("info", "replication").split()
                            if ":" in line)
                offset = info.get("master_repl_offset")
                slaves = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
                if not slaves:
                    return f"{m.address} has no replica connected"
                for s in slaves:
                    fields = dict(kv.split("=", 1) for kv in s.split(","))
                    if fields.get("offset") != offset:
                        return f"a replica of {m.address} at {fields.get('offset')} < {offset}"
            return ""
        wait_for("replicas caught up", lag, timeout_s)

    def wait_failover(self, dead: Node, timeout_s: float = 60, *, among: Sequence[Node] | None = None) -> None:
        """Wait until every slot is served by a live master (a replica took over ``dead``'s) and
        every live node says ``cluster_state:ok``.

        ``among``: the nodes to ask and count as live (default: every running node); the nodes
        of a host that is cut off still run but cannot take part."""
        def done() -> str:
            nodes = self.live() if among is None else list(among)
            live = {n.address for n in nodes} - {dead.address}
            views = self._topology_from(nodes)
            served = [v for v in views if v.is_master and v.slots and not v.failed and v.address in live]
            if sum(hi - lo + 1 for v in served for lo, hi in v.slots) != 16384:
                return "slots not all served by live masters"
            if any(v.address == dead.address and v.slots for v in views):
                return f"{dead.address} still listed as serving slots"
            for n in nodes:
                if "cluster_state:ok" not in n.cli("cluster", "info", timeout=5):
                    return f"{n.address} not ok"
            return ""
        wait_for(f"failover of {dead.address}", done, timeout_s)

    def acl_setuser(self, user: str, *rules: str) -> None:
        """``ACL SETUSER user rules...`` on every live node (a cluster does not share its ACLs)."""
        for node in self.live():
            reply = node.cli("acl", "setuser", user, *rules)
            assert reply.strip() == "OK", f"ACL SETUSER on {node.address}: {reply!r}"


def _cli_tls(tls: TlsFiles | None) -> list[str]:
    return [] if tls is None else ["--tls", "--cacert", str(tls.ca)]


def _pong(node: Node) -> bool:
    try:
        return node.cli("ping", check=False, timeout=5).strip() == "PONG"
    except subprocess.TimeoutExpired:
        return False
