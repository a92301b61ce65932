"""A real Redis Cluster for tests: redis-server processes in cluster mode (random ports,
one temp dir each), 3 masters and optionally one replica per master, the 16384 slots
split evenly. Made with CLUSTER ADDSLOTSRANGE / MEET / REPLICATE (no redis-cli), and
ready once every node reports ``cluster_state:ok`` with every replica in sync.

``cluster-node-timeout`` is small (``node_timeout_ms``), so a killed master's replica is
promoted within about a second or two (``Cluster.kill_master``). With ``tls`` every node
listens for TLS only, the cluster bus and replication too (tls-cluster, tls-replication);
``extra``: more redis-server arguments for every node, ``conn``: more client options for
the fixture's own connections (a password, the client certificate)."""
from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import redis

from pagedq.worker.redis_server import RedisServer, ServerTls, free_port

SLOTS = 16384


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and below 65536."""
    for _ in range(200):
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


@dataclass
class Cluster:
    masters: int = 3
    replicas: int = 0  # per master
    node_timeout_ms: int = 1000
    tls: ServerTls | None = None
    extra: list[str] = field(default_factory=list)
    conn: dict = field(default_factory=dict)
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        """The start-up node clients are given (they discover the others)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.nodes[0].port}"

    def start(self, timeout: float = 30.0) -> Cluster:
        total = self.masters * (1 + self.replicas)
        extra = ["--cluster-enabled", "yes", "--cluster-node-timeout", str(self.node_timeout_ms),
                 "--cluster-replica-validity-factor", "0", "--appendonly", "no",
                 "--cluster-require-full-coverage", "yes", *self.extra]
        if self.tls:
            extra += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        try:
            for _ in range(total):
                srv = RedisServer(cluster_port(), min_version=(7, 0), tls=self.tls,
                                  extra=[*extra, "--cluster-config-file", "nodes.conf"])
                self.nodes.append(srv.start())
            self._form(timeout)
        except BaseException:
            self.cleanup()
            raise
        return self

    def _conn(self, srv: RedisServer) -> redis.Redis:
        tls = {} if self.tls is None else {"ssl": True, "ssl_ca_certs": self.tls.ca}
        return redis.Redis(port=srv.port, decode_responses=True, socket_timeout=5, **tls,
                           **self.conn)

    def _form(self, timeout: float) -> None:
        first = self._conn(self.nodes[0])
        per = SLOTS // self.masters
        for i, srv in enumerate(self.nodes[:self.masters]):
            lo, hi = i * per, SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1
            with self._conn(srv) as c:
                c.execute_command("CLUSTER ADDSLOTSRANGE", lo, hi)
        for srv in self.nodes[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", srv.port)
        ids = [self._conn(s).execute_command("CLUSTER MYID") for s in self.nodes]
        # every node must know every other before a replica can name its master
        self._until(lambda: all(len(self._conn(s).cluster("NODES")) == len(self.nodes)
                                for s in self.nodes), "nodes to meet", timeout)
        for j, srv in enumerate(self.nodes[self.masters:]):
            with self._conn(srv) as c:
                c.execute_command("CLUSTER REPLICATE", ids[j % self.masters])
        first.close()
        self._until(self.healthy, "cluster_state:ok with replicas in sync", timeout)

    def healthy(self) -> bool:
        """Every live node sees the cluster ok; every replica's link to its master is up."""
        for srv in self.live():
            try:
                with self._conn(srv) as c:
                    if c.cluster("INFO").get("cluster_state") != "ok":
                        return False
                    info = c.info("replication")
                    if info.get("role") == "slave" and info.get("master_link_status") != "up":
                        return False
            except redis.RedisError:
                return False
        return True

    def live(self) -> list[RedisServer]:
        return [s for s in self.nodes if s.proc is not None and s.proc.poll() is None]

    def master_of(self, key: str) -> RedisServer:
        """The live node that serves ``key``'s slot now."""
        with self._conn(self.live()[0]) as c:
            slot = c.cluster("KEYSLOT", key)
            for lo, hi, master, *_ in c.cluster("SLOTS"):
                if lo <= slot <= hi:
                    return next(s for s in self.nodes if s.port == int(master[1]))
        raise AssertionError(f"no node serves the slot of {key!r}")

    def replica_of(self, master: RedisServer) -> RedisServer:
        with self._conn(master) as c:
            for r in c.info("replication").values():
                if isinstance(r, dict) and "port" in r:
                    return next(s for s in self.nodes if s.port == int(r["port"]))
        raise AssertionError(f"master on port {master.port} has no replica")

    def kill_master(self, master: RedisServer, timeout: float = 30.0) -> RedisServer:
        """SIGKILL ``master``; wait until its replica is promoted and the cluster is ok.
        Returns the promoted replica."""
        replica = self.replica_of(master)
        master.kill()
        self._until(lambda: self._role(replica) == "master" and self.healthy(),
                    "the replica's promotion", timeout)
        return replica

    def _role(self, srv: RedisServer) -> str:
        try:
            with self._conn(srv) as c:
                return c.info("replication").get("role", "")
        except redis.RedisError:
            return ""

    @staticmethod
    def _until(cond, what: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if cond():
                return
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}")

    def cleanup(self) -> None:
        for srv in self.nodes:
            srv.cleanup()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.cleanup()
