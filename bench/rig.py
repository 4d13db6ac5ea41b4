"""The benchmarks' one rig, on stack/rig.py's: a Redis (one server, or a cluster of shards),
one synthetic engine worker, the gateway (with its gRPC server) and the engine alone
(bench/reference_engine.py), all paced at one rate. Pinned as issue 12 asks: the gateway on
CPU 1; the worker, every Redis server, the reference engine and the load generator on CPU 0.
``python -m bench`` and ``python -m bench.e2e`` both run on it."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from bench.loadgen import HTTPPool
from stack.redis_cluster import EmbeddedCluster
from stack.redis_server import free_port
from stack.rig import HOST, on_embedded_redis
from stack.rig import Rig as ProcessRig

MAX_STREAMS = 12_000
ENV = {
    "TOKENSPOUT_LOG_LEVEL": "WARNING",
    "TOKENSPOUT_MAX_INFLIGHT": str(MAX_STREAMS * 2),
    "TOKENSPOUT_SESSION_TTL_S": "600",
}
GATEWAY_CPU, REST_CPU = 1, 0


@dataclass
class RedisServer:
    pid: int
    port: int
    client: aioredis.Redis


@dataclass
class Rig:
    gateway: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    engine: subprocess.Popen[bytes]
    gateway_port: int
    engine_port: int
    servers: dict[str, RedisServer]
    """``redis`` for one server; ``redis0``, ``redis1``... for a cluster's shards."""
    pinned: bool
    grpc_channel: grpc.aio.Channel
    posts: HTTPPool = field(init=False)
    top_logprobs: int | None = None
    """The OpenAI path's requests ask for logprobs with this many alternatives (--logprobs)."""
    more_gateways: list[tuple[subprocess.Popen[bytes], int]] = field(default_factory=list)
    """Gateway processes beside the first (``gateways`` > 1), with their ports."""

    def __post_init__(self) -> None:
        self.posts = HTTPPool(HOST, self.gateway_port)

    @property
    def gateway_ports(self) -> list[int]:
        return [self.gateway_port, *(port for _, port in self.more_gateways)]

    def pids(self) -> dict[str, int]:
        named = {"gateway": self.gateway, "worker": self.worker, "engine": self.engine}
        named |= {f"gateway{i}": p for i, (p, _) in enumerate(self.more_gateways, start=2)}
        pids = {name: process.pid for name, process in named.items()}
        return pids | {name: s.pid for name, s in self.servers.items()} | {"loadgen": os.getpid()}


@contextlib.asynccontextmanager
async def rig(
    tokens_per_s: float,
    logs: Path,
    *,
    shards: int = 0,
    unix_socket: bool = False,
    join_tokens: bool = False,
    rest_cpu: int | None = REST_CPU,
    gateway_cpu: int | None = GATEWAY_CPU,
    gateways: int = 1,
) -> AsyncIterator[Rig]:
    """Everything, paced at ``tokens_per_s`` (0: unpaced); ``shards`` > 0: on an embedded
    cluster of that many primaries without replicas (one Redis has none either);
    ``rest_cpu`` None: the worker, Redis, the reference engine and the load generator float
    over every CPU (``gateway_cpu`` None: the gateway too); ``gateways``: gateway processes,
    each on its own port (those past the first float)."""
    prefix = f"bench-{secrets.token_hex(3)}"
    async with contextlib.AsyncExitStack() as stack:
        if shards:
            cluster = stack.enter_context(EmbeddedCluster(primaries=shards, replicas=0))
            procs = ProcessRig(cluster.url, prefix, logs, dict(ENV))
            stack.callback(procs.stop)
            nodes = {f"redis{i}": n for i, n in enumerate(cluster.nodes)}
            urls = {name: f"redis://{HOST}:{n.port}" for name, n in nodes.items()}
        else:
            procs, one = stack.enter_context(
                on_embedded_redis(logs, prefix, ENV, unix_socket=unix_socket, cpu=rest_cpu)
            )
            nodes, urls = {"redis": one}, {"redis": procs.redis_url}
        servers = {}
        for name, node in nodes.items():
            pid = node.process.pid if node.process else 0
            if shards and pid:  # on_embedded_redis pinned the one server
                procs.pin(pid, rest_cpu)
            client = await stack.enter_async_context(aioredis.Redis.from_url(urls[name]))
            servers[name] = RedisServer(pid, node.port, client)
        joined = ["--join-tokens"] if join_tokens else []
        worker = procs.synthetic(
            tokens_per_s, "--capacity", str(MAX_STREAMS), *joined, cpu=rest_cpu
        )
        gateway = procs.gateway(grpc=True, cpu=gateway_cpu)
        more = [procs.gateway() for _ in range(gateways - 1)]
        port = free_port()
        pace = ["--port", str(port), "--tokens-per-s", str(tokens_per_s)]
        engine = procs.spawn(
            "reference-engine",
            ["-m", "bench.reference_engine", *pace],
            health=f"http://{HOST}:{port}/health",
            cpu=rest_cpu,
        )
        if procs.pinned:  # the load generator alone: its tree holds every process above
            procs.pin(os.getpid(), rest_cpu, children=False)
        channel = grpc.aio.insecure_channel(gateway.grpc_url)
        the_rig = Rig(
            gateway.process, worker, engine, gateway.port, port, servers, procs.pinned, channel
        )
        the_rig.more_gateways = [(g.process, g.port) for g in more]
        try:
            yield the_rig
        finally:
            the_rig.posts.close()
            await channel.close()
