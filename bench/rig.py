"""The rig: Redis, the synthetic engine, the gateway and the reference relays as real processes."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis
import redis.asyncio as aioredis

from bench import measure
from bench.loadgen import (
    HTTPPool,
)
from gateway.sessions import SessionStore
from gateway.settings import Settings
from stack import processes
from stack.redis_server import EmbeddedRedis, free_port
from wire import Keys

HOST = "127.0.0.1"
GATEWAY_CPU, LOADGEN_CPU = 1, 0
START_RATE = 200.0
"""Streams started per second at most: the schedule spreads N starts over N / START_RATE s
(at least one token interval), and each stream lasts at least twice that spread, so all N
are open together for a while. The same schedule for every mode."""
MAX_STREAMS = 12_000


@dataclass
class Rig:
    redis_port: int
    prefix: str
    gateway_port: int
    reference_port: int
    spin_port: int
    gateway: subprocess.Popen[bytes]
    reference: subprocess.Popen[bytes]
    spin: subprocess.Popen[bytes]
    engine: subprocess.Popen[bytes]
    redis_pid: int
    redis: aioredis.Redis
    store: SessionStore
    http: httpx.AsyncClient
    pinned: bool
    posts: HTTPPool = field(init=False)
    keys: Keys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = Keys(self.prefix)
        self.posts = HTTPPool(HOST, self.gateway_port)

    def pid_of(self, mode: str) -> int | None:
        processes = {
            "gateway": self.gateway,
            "ws": self.gateway,
            "reference": self.reference,
            "reference-spin": self.spin,
        }
        process = processes.get(mode)
        return process.pid if process else None

    def port_of(self, mode: str) -> int:
        return {"reference": self.reference_port, "reference-spin": self.spin_port}[mode]


def wait_worker(url: str, prefix: str, process: subprocess.Popen[bytes]) -> None:
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"engine exited with {process.returncode}")
            if client.zcard(f"{prefix}:workers"):
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise TimeoutError("the synthetic engine did not register")


@contextlib.asynccontextmanager
async def rig(tokens_per_s: float, logs: Path, server: str = "uvicorn") -> AsyncIterator[Rig]:
    """Start everything; the gateway and the reference relay pinned to one CPU."""
    prefix = f"bench-{secrets.token_hex(3)}"
    with EmbeddedRedis() as embedded:
        env = {
            "REDIS_URL": embedded.url,
            "TOKENSPOUT_KEY_PREFIX": prefix,
            "TOKENSPOUT_GRPC_PORT": "0",  # the gateway's gRPC server: not measured here
            "TOKENSPOUT_LOG_LEVEL": "WARNING",
            "TOKENSPOUT_MAX_INFLIGHT": str(MAX_STREAMS * 2),
            "TOKENSPOUT_SESSION_TTL_S": "600",
        }
        children: list[subprocess.Popen[bytes]] = []
        try:
            engine = processes.engine(
                [
                    "--backend",
                    "synthetic",
                    "--tokens-per-s",
                    str(tokens_per_s),
                    "--capacity",
                    str(MAX_STREAMS),
                ],
                env,
                logs / "engine.log",
            )
            children.append(engine)
            wait_worker(embedded.url, prefix, engine)
            gateway_port, reference_port = free_port(), free_port()
            gateway_args = ["-m", "gateway", "--host", HOST, "--port", str(gateway_port)]
            if server != "uvicorn":
                gateway_args = ["-m", "bench.serve", server, str(gateway_port)]
            gateway = processes.spawn(gateway_args, env, logs / "gateway.log")
            children.append(gateway)
            reference = processes.spawn(
                ["-m", "bench.reference_relay", "--host", HOST, "--port", str(reference_port)],
                env,
                logs / "reference.log",
            )
            children.append(reference)
            spin_port = free_port()
            spin = processes.spawn(
                [
                    "-m",
                    "bench.reference_relay",
                    "--host",
                    HOST,
                    "--port",
                    str(spin_port),
                    "--wait",
                    "spin",
                ],
                env,
                logs / "reference-spin.log",
            )
            children.append(spin)
            pinned = all(measure.pin(p.pid, GATEWAY_CPU) for p in (gateway, reference, spin))
            if pinned:
                # Only the load generator itself: its tree holds every process of the rig.
                measure.pin(os.getpid(), LOADGEN_CPU, children=False)
            processes.wait_http(f"http://{HOST}:{gateway_port}/health", gateway, 60)
            processes.wait_http(f"http://{HOST}:{reference_port}/health", reference, 60)
            processes.wait_http(f"http://{HOST}:{spin_port}/health", spin, 60)
            client = aioredis.Redis(
                connection_pool=aioredis.BlockingConnectionPool.from_url(
                    embedded.url, max_connections=128, timeout=60
                )
            )
            settings = Settings(
                redis_url=embedded.url, key_prefix=prefix, max_inflight=MAX_STREAMS * 2
            )
            limits = httpx.Limits(
                max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0
            )
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:
                yield Rig(
                    embedded.port,
                    prefix,
                    gateway_port,
                    reference_port,
                    spin_port,
                    gateway,
                    reference,
                    spin,
                    engine,
                    embedded.process.pid if embedded.process else 0,
                    client,
                    SessionStore(client, settings),
                    http,
                    pinned,
                )
            await client.aclose()
        finally:
            for child in reversed(children):
                processes.stop(child)
