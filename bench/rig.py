"""The suite's rig (``python -m bench``) on stack/rig.py's: Redis, the synthetic engine, the gateway
and the reference relays as real processes, with what the load generator needs of them."""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from bench.loadgen import HTTPPool
from gateway.sessions import SessionStore
from gateway.settings import Settings
from stack.redis_server import free_port
from stack.rig import HOST, on_embedded_redis
from wire import Keys

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


@contextlib.asynccontextmanager
async def rig(tokens_per_s: float, logs: Path) -> AsyncIterator[Rig]:
    """Start everything; the gateway and the reference relays pinned to one CPU."""
    prefix = f"bench-{secrets.token_hex(3)}"
    env = {
        "TOKENSPOUT_LOG_LEVEL": "WARNING",
        "TOKENSPOUT_MAX_INFLIGHT": str(MAX_STREAMS * 2),
        "TOKENSPOUT_SESSION_TTL_S": "600",
    }
    with on_embedded_redis(logs, prefix, env) as (procs, embedded):
        engine = procs.synthetic(tokens_per_s, "--capacity", str(MAX_STREAMS))
        gateway = procs.gateway(cpu=GATEWAY_CPU)
        ports = free_port(), free_port()
        relays = [
            procs.spawn(
                name,
                ["-m", "bench.reference_relay", "--host", HOST, "--port", str(port), *wait],
                health=f"http://{HOST}:{port}/health",
                cpu=GATEWAY_CPU,
            )
            for name, port, wait in (
                ("reference", ports[0], []),
                ("reference-spin", ports[1], ["--wait", "spin"]),
            )
        ]
        reference, spin = relays
        if procs.pinned:
            # Only the load generator itself: its tree holds every process of the rig.
            procs.pin(os.getpid(), LOADGEN_CPU, children=False)
        client = aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool.from_url(
                embedded.url, max_connections=128, timeout=60
            )
        )
        settings = Settings(redis_url=embedded.url, key_prefix=prefix, max_inflight=MAX_STREAMS * 2)
        limits = httpx.Limits(
            max_connections=64, max_keepalive_connections=64, keepalive_expiry=2.0
        )
        try:
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:
                yield Rig(
                    embedded.port,
                    prefix,
                    gateway.port,
                    *ports,
                    gateway.process,
                    reference,
                    spin,
                    engine,
                    embedded.process.pid if embedded.process else 0,
                    client,
                    SessionStore(client, settings),
                    http,
                    procs.pinned,
                )
        finally:
            await client.aclose()
