"""The one process rig of the tests and the benchmarks: gateways, engine workers and helper
servers on one Redis key prefix, each a real process with its log, optionally pinned to a
CPU; ``on_embedded_redis`` adds a Redis of its own. tests/support/stack.py builds on it."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, cast
from urllib.parse import urlsplit

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from stack import processes, procfs
from stack.redis_server import EmbeddedRedis, free_port
from wire import Keys
from wire.connect import CLUSTER_SCHEMES, REDIS_AWAY_ERRORS, kind_of, redis_away

HOST = "127.0.0.1"
VLLM_LOCK = Path("/tmp/tokenspout-vllm.lock")
"""Held while a test session or a benchmark runs vLLM: two engines at once would starve
these 2 cores."""


class _ClosingCluster(RedisCluster):
    """A cluster client whose ``close`` closes its sockets. redis-py's ``from_url`` gives
    each node a connection pool that the node's client does not own, so ``close`` leaves
    those sockets open until the garbage collector finds them: a ``ResourceWarning`` in
    whichever later test collects them."""

    def close(self) -> None:
        self.disconnect_connection_pools()  # type: ignore[no-untyped-call]
        super().close()


def sync_client(redis_url: str) -> redis.Redis:
    """A blocking client of ``redis_url``: one Redis, a cluster (``redis+cluster://``), or
    the primary Sentinel names (``redis+sentinel://h:p,.../SERVICE``, no password)."""
    if kind_of(redis_url) == "cluster":
        scheme, rest = redis_url.split("://", 1)
        cluster = _ClosingCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}")
        return cluster  # type: ignore[return-value]
    if kind_of(redis_url) == "sentinel":
        parts = urlsplit(redis_url)
        hosts = [(h, int(p)) for h, p in (a.rsplit(":", 1) for a in parts.netloc.split(","))]
        sentinel = Sentinel(hosts)  # type: ignore[no-untyped-call]
        primary = sentinel.master_for(parts.path.strip("/").split("/")[0])  # type: ignore[no-untyped-call]
        return cast(redis.Redis, primary)
    return redis.Redis.from_url(redis_url)


def wait_worker(
    redis_url: str,
    prefix: str,
    worker_id: str,
    process: subprocess.Popen[bytes],
    timeout_s: float = 600,
) -> None:
    """Until the worker has registered (its ``worker:{id}`` key); fails if it exits first.
    Redis away meanwhile (restarting, a cluster failing over) is waited for: a cluster
    client cannot even be made while the node the URL names is down (the chaos run's
    replacement worker, started during a primary's failover, failed there)."""
    key = Keys(prefix).worker(worker_id)
    deadline = time.monotonic() + timeout_s
    client: redis.Redis | None = None
    unanswered: Exception | None = None
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"engine worker exited with {process.returncode}")
            try:
                client = client or sync_client(redis_url)
                if client.exists(key):
                    return
            except REDIS_AWAY_ERRORS as exc:
                if not redis_away(exc):
                    raise
                unanswered = exc  # asked again in 20 ms, until the deadline
            time.sleep(0.02)
    finally:
        if client is not None:
            client.close()
    why = f" (Redis last said: {unanswered!r})" if unanswered is not None else ""
    raise TimeoutError(f"worker {worker_id} did not register in {timeout_s} s{why}")


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    port: int
    grpc_port: int = 0
    """Its gRPC inference service's port; 0: started without one."""

    @property
    def grpc_url(self) -> str:
        """``host:port``, as ``tritonclient.grpc`` takes it."""
        assert self.grpc_port, "this gateway was started without its gRPC server"
        return f"{HOST}:{self.grpc_port}"


@dataclass
class Rig:
    """Processes on one Redis key prefix; ``stop`` ends them, the last started first."""

    redis_url: str
    prefix: str
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)
    pinned: bool = True
    """Every ``cpu=`` asked so far was granted (False on a one-CPU machine)."""
    root: Path = processes.ROOT
    """Where its gateways and engine workers run from: this repository, or another
    revision's checkout (bench/revisions.py); helper servers (``spawn``) run from here."""
    synthetic_drain_s: ClassVar[str | None] = None
    """A synthetic worker's ``--drain-s`` unless its caller gives one (None: the worker's
    own default)."""

    def base_env(self, **extra: str) -> dict[str, str]:
        return {
            "REDIS_URL": self.redis_url,
            "TOKENSPOUT_KEY_PREFIX": self.prefix,
            "TOKENSPOUT_LOG_LEVEL": "INFO",
            **self.env,
            **extra,
        }

    def pin(self, pid: int, cpu: int | None, *, children: bool = True) -> None:
        """Pin ``pid``'s tree (or the process alone) to ``cpu``; None: leave it to float."""
        if cpu is not None:
            self.pinned = procfs.pin(pid, cpu, children=children) and self.pinned

    def spawn(
        self,
        name: str,
        args: list[str],
        *,
        health: str | None = None,
        cpu: int | None = None,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        """``python ARGS`` logged to ``NAME.log``; waits for ``health`` (a URL) to answer."""
        process = processes.spawn(args, self.base_env(**env), self.logs / f"{name}.log")
        self.children.append(process)
        self.pin(process.pid, cpu)
        if health is not None:
            processes.wait_http(health, process, 60)
        return process

    def gateway(
        self,
        port: int | None = None,
        *,
        grpc: bool = False,
        cpu: int | None = None,
        workers: int = 1,
        grpc_port: int = 0,
        **env: str,
    ) -> Gateway:
        """A gateway process; ``grpc``: with its gRPC server, on ``grpc_port`` or a free
        port (listening by the time ``/health`` answers: the app's lifespan starts it);
        ``workers``: processes on its ports (``python -m gateway --workers``)."""
        port = port or free_port()
        grpc_port = grpc_port or (free_port() if grpc else 0)
        log = self.logs / f"gateway-{port}.log"
        env = self.base_env(**env)
        process = processes.gateway(
            port, env, log, grpc_port=grpc_port, workers=str(workers), root=self.root
        )
        self.children.append(process)
        self.pin(process.pid, cpu)
        url = f"http://{HOST}:{port}"
        processes.wait_http(f"{url}/health", process, 60)
        return Gateway(url, process, port, grpc_port)

    def engine(
        self,
        *args: str,
        wait: bool = True,
        cpu: int | None = None,
        worker_id: str | None = None,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        """``python -m engine ARGS``; ``wait``: until the worker has registered."""
        worker_id = worker_id or f"w-{secrets.token_hex(4)}"
        return self._worker(list(args), worker_id, wait, cpu, self.base_env(**env))

    def _worker(
        self, args: list[str], worker_id: str, wait: bool, cpu: int | None, env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        log = self.logs / f"engine-{worker_id}.log"
        process = processes.engine([*args, "--worker-id", worker_id], env, log, root=self.root)
        self.children.append(process)
        self.pin(process.pid, cpu)
        if wait:
            wait_worker(self.redis_url, self.prefix, worker_id, process)
        return process

    def synthetic(
        self,
        tokens_per_s: float = 200,
        *args: str,
        cpu: int | None = None,
        worker_id: str | None = None,
        **env: str,
    ) -> subprocess.Popen[bytes]:
        """An engine worker with the synthetic backend at ``tokens_per_s`` per reply."""
        backend = ["--backend", "synthetic", "--tokens-per-s", str(tokens_per_s), *args]
        if self.synthetic_drain_s is not None and "--drain-s" not in args:
            backend += ["--drain-s", self.synthetic_drain_s]
        worker_id = worker_id or f"w-{secrets.token_hex(4)}"
        return self._worker(backend, worker_id, True, cpu, self.base_env(**env))

    def stop(self) -> None:
        for child in reversed(self.children):
            processes.stop(child)


@contextlib.contextmanager
def on_embedded_redis(
    logs: Path,
    prefix: str,
    env: dict[str, str] | None = None,
    *,
    unix_socket: bool = False,
    cpu: int | None = None,
) -> Iterator[tuple[Rig, EmbeddedRedis]]:
    """A rig on a Redis of its own (pinned to ``cpu``), its processes' environment ``env``
    added; stopped with it."""
    with EmbeddedRedis(unix_socket=unix_socket) as embedded:
        rig = Rig(embedded.unix_url if unix_socket else embedded.url, prefix, logs, dict(env or {}))
        if embedded.process is not None:
            rig.pin(embedded.process.pid, cpu)
        try:
            yield rig, embedded
        finally:
            rig.stop()
