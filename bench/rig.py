"""The benchmarks' one rig, on stack/rig.py's: a Redis (one server, or a cluster of shards),
one engine worker, the gateway (with its gRPC server) and the engine alone
(bench/reference_engine.py) with the worker's own backend: the synthetic engine paced at one
rate, or vLLM on the CPU (``engine="vllm"``: SmolLM2, greedy; both engines are loaded, one
generating at a time, under the lock the tests take so that no other vLLM runs beside them).
Pinned: the gateway on CPU 1; the worker, every Redis server, the reference
engine and the load generator on CPU 0 (vLLM: nothing pinned, it binds its engine core
itself). ``python -m bench``, ``bench.e2e`` and ``bench.requests`` run on it."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import secrets
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import redis.asyncio as aioredis

from bench.loadgen import HTTPPool
from engine.model import MODEL_NAME
from stack import processes
from stack.redis_cluster import EmbeddedCluster
from stack.redis_server import free_port
from stack.rig import HOST, VLLM_LOCK, on_embedded_redis
from stack.rig import Rig as ProcessRig

MAX_STREAMS = 12_000
ENV = {
    "TOKENSPOUT_LOG_LEVEL": "WARNING",
    "TOKENSPOUT_MAX_INFLIGHT": str(MAX_STREAMS * 2),
    "TOKENSPOUT_SESSION_TTL_S": "600",
    # A bench's gateways stop when it ends: a stream still open then (a bench stopped
    # mid-stream) is cut within a second, not after the default grace of 30 s.
    "TOKENSPOUT_SHUTDOWN_GRACE_S": "1",
}
GATEWAY_CPU, REST_CPU = 1, 0
VLLM = ["--backend", "vllm", "--model", "default", "--capacity", "8"]
VLLM_PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
"""Greedy, SmolLM2 writes past any ``max_tokens`` the benchmarks ask for: every reply is
whole, on both sides."""


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
    prefix: str
    """The Redis key prefix of the gateway and the worker."""
    worker_metrics: str
    """The worker's ``/metrics`` URL."""
    model: str = "synthetic"
    prompt: str = "bench"
    posts: HTTPPool = field(init=False)
    top_logprobs: int | None = None
    """The OpenAI path's requests ask for logprobs with this many alternatives (--logprobs)."""
    more_gateways: dict[str, tuple[subprocess.Popen[bytes], int]] = field(default_factory=dict)
    """Gateways beside the first by name (``gateway xN``: ``--workers N``), with their ports."""
    more_engines: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    """Engine workers beside the first by name (``worker2``...), on the same model's queue."""

    def __post_init__(self) -> None:
        self.posts = HTTPPool(HOST, self.gateway_port)

    @property
    def engine_workers(self) -> list[str]:
        """The engine workers' names, as ``pids`` has them."""
        return ["worker", *self.more_engines]

    def pids(self) -> dict[str, int]:
        named = {"gateway": self.gateway, "worker": self.worker, "engine": self.engine}
        named |= {name: process for name, (process, _) in self.more_gateways.items()}
        named |= self.more_engines
        pids = {name: process.pid for name, process in named.items()}
        return pids | {name: s.pid for name, s in self.servers.items()} | {"loadgen": os.getpid()}


def run_logs(kind: str, profile: Path | None, say: Callable[[str], None]) -> Path:
    """A fresh folder for a run's process logs (said, with the load average it starts at),
    and the profile's folder made if one is asked for."""
    logs = Path(tempfile.mkdtemp(prefix=f"tokenspout-{kind}-"))
    say(f"process logs in {logs}; load average {os.getloadavg()[0]:.2f}")
    if profile is not None:
        profile.mkdir(parents=True, exist_ok=True)
    return logs


@contextlib.asynccontextmanager
async def rig(
    tokens_per_s: float,
    logs: Path,
    *,
    engine: str = "synthetic",
    shards: int = 0,
    unix_socket: bool = False,
    join_tokens: bool = False,
    rest_cpu: int | None = REST_CPU,
    gateway_cpu: int | None = GATEWAY_CPU,
    workers: tuple[int, ...] = (),
    engines: int = 1,
    gateway_workers: int = 1,
    backend_args: tuple[str, ...] = (),
    root: Path = processes.ROOT,
    worker_args: tuple[str, ...] | None = None,
) -> AsyncIterator[Rig]:
    """Everything, paced at ``tokens_per_s`` (0: unpaced; vLLM: its own pace); ``engine``:
    ``synthetic`` or ``vllm``; ``shards`` > 0: on an embedded
    cluster of that many primaries without replicas (one Redis has none either);
    ``rest_cpu`` None: the worker, Redis, the reference engine and the load generator float
    over every CPU (``gateway_cpu`` None: the gateway too); ``workers``: one more gateway for
    each, on its own port, with that many processes (``python -m gateway --workers N``;
    floating); ``engines``: engine workers on the model's queue (the first with metrics);
    ``gateway_workers``: the gateway's processes (``python -m gateway --workers``);
    ``backend_args``: more engine flags for both engines (the worker's and the engine
    alone's), e.g. ``--prepare-cpu-ms``; ``root``: where the gateway and the engine workers
    run from (another revision's checkout: bench/revisions.py; the engine alone and the
    load generator are always this checkout's); ``worker_args``: the engine workers' flags
    in place of ``backend_args`` (an older revision's worker lacks some)."""
    prefix = f"bench-{secrets.token_hex(3)}"
    backend = ["--backend", "synthetic", "--tokens-per-s", str(tokens_per_s)]
    backend += ["--capacity", str(MAX_STREAMS)]
    if engine == "vllm":
        backend, rest_cpu, gateway_cpu = VLLM, None, None
    alone_backend = [*backend, *backend_args]
    backend = [*backend, *(backend_args if worker_args is None else worker_args)]
    backend += ["--drain-s", "1"]  # its workers too (ENV)
    async with contextlib.AsyncExitStack() as stack:
        if engine == "vllm":
            lock = stack.enter_context(VLLM_LOCK.open("w"))
            fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes
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
        procs.root = root
        servers = {}
        for name, node in nodes.items():
            pid = node.process.pid if node.process else 0
            if shards and pid:  # on_embedded_redis pinned the one server
                procs.pin(pid, rest_cpu)
            client = await stack.enter_async_context(aioredis.Redis.from_url(urls[name]))
            servers[name] = RedisServer(pid, node.port, client)
        joined = ["--join-tokens"] if join_tokens else []
        metrics = free_port()
        worker = procs.engine(
            *backend, *joined, "--metrics-port", str(metrics), cpu=rest_cpu
        )  # registered: a vLLM worker has loaded its model before the other one starts
        more_engines = {
            f"worker{n}": procs.engine(*backend, cpu=rest_cpu) for n in range(2, engines + 1)
        }
        gateway = procs.gateway(grpc=True, cpu=gateway_cpu, workers=gateway_workers)
        more = {f"gateway x{n}": procs.gateway(workers=n) for n in workers}
        port = free_port()
        alone = procs.spawn(
            "reference-engine",
            ["-m", "bench.reference_engine", "--port", str(port), *alone_backend],
            cpu=rest_cpu,
        )
        # Awaited off the loop (vLLM: a model load): an interrupt now stops the rig at once.
        # A wait on the loop held the cancel until the engine answered, and a bench killed
        # meanwhile left the engine running.
        health = f"http://{HOST}:{port}/health"
        await asyncio.to_thread(processes.wait_http, health, alone, 600)
        if procs.pinned:  # the load generator alone: its tree holds every process above
            procs.pin(os.getpid(), rest_cpu, children=False)
        channel = grpc.aio.insecure_channel(gateway.grpc_url)
        the_rig = Rig(
            gateway.process,
            worker,
            alone,
            gateway.port,
            port,
            servers,
            procs.pinned and rest_cpu is not None,
            channel,
            prefix,
            f"http://{HOST}:{metrics}/metrics",
        )
        if engine == "vllm":
            the_rig.model, the_rig.prompt = MODEL_NAME, VLLM_PROMPT
        the_rig.more_gateways = {name: (g.process, g.port) for name, g in more.items()}
        the_rig.more_engines = more_engines
        try:
            yield the_rig
        finally:
            the_rig.posts.close()
            await channel.close()
