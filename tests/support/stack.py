"""A test's processes: a gateway and engine workers on one Redis key prefix."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from stack import processes
from stack.redis_server import free_port
from tests.support.redis_probes import async_client, live_readers, wait_for_worker
from wire import Keys

VLLM_LOCK = Path("/tmp/tokenspout-vllm.lock")
"""Held while a test session runs vLLM: two engines at once would starve these 2 cores."""


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
        return f"127.0.0.1:{self.grpc_port}"


@dataclass
class Stack:
    """Processes of one test, all on one Redis key prefix; stopped when the test ends."""

    redis_url: str
    prefix: str
    logs: Path
    env: dict[str, str] = field(default_factory=dict)
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def base_env(self, **extra: str) -> dict[str, str]:
        return {
            "REDIS_URL": self.redis_url,
            "TOKENSPOUT_KEY_PREFIX": self.prefix,
            "TOKENSPOUT_LOG_LEVEL": "INFO",
            **self.env,
            **extra,
        }

    def gateway(self, port: int | None = None, *, grpc: bool = False, **env: str) -> Gateway:
        """A gateway process; ``grpc``: with its gRPC server, on a free port (listening by
        the time ``/health`` answers: the app's lifespan starts it)."""
        port = port or free_port()
        grpc_port = free_port() if grpc else 0
        log = self.logs / f"gateway-{port}.log"
        process = processes.gateway(port, self.base_env(**env), log, grpc_port=grpc_port)
        self.children.append(process)
        url = f"http://127.0.0.1:{port}"
        processes.wait_http(f"{url}/health", process, 60)
        return Gateway(url, process, port, grpc_port)

    def engine(self, *args: str, wait: bool = True, **env: str) -> subprocess.Popen[bytes]:
        worker_id = f"w-{secrets.token_hex(4)}"
        log = self.logs / f"engine-{worker_id}.log"
        process = processes.engine([*args, "--worker-id", worker_id], self.base_env(**env), log)
        self.children.append(process)
        if wait:
            wait_for_worker(self.redis_url, self.prefix, worker_id, process)
        return process

    def synthetic(
        self, tokens_per_s: float = 200, *args: str, **env: str
    ) -> subprocess.Popen[bytes]:
        return self.engine(
            "--backend", "synthetic", "--tokens-per-s", str(tokens_per_s), *args, **env
        )

    async def wait_live_readers(self, session_id: str, count: int = 1) -> None:
        """Until Redis confirms ``count`` gateways' subscriptions to the session's live
        channel: from then on its events reach those gateways' readers live."""
        channel = Keys(self.prefix).live_channel(session_id)
        client = async_client(self.redis_url)
        try:
            async with asyncio.timeout(30):
                while await live_readers(client, channel) < count:
                    await asyncio.sleep(0.01)
        finally:
            await client.aclose()

    def stop(self) -> None:
        for child in reversed(self.children):
            processes.stop(child)


@dataclass
class VllmStack:
    stack: Stack
    gateway: Gateway
    engine: subprocess.Popen[bytes]
