"""Real parts for every test: a Redis server, gateway and engine processes, vLLM on the CPU."""

from __future__ import annotations

import fcntl
import os
import secrets
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from stack import processes
from stack.redis_server import EmbeddedRedis, free_port

VLLM_LOCK = Path("/tmp/tokenspout-vllm.lock")
"""Held while a test session runs vLLM: two engines at once would starve these 2 cores."""


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture(name="redis")
async def async_redis(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the session's Redis server (the fixture is named ``redis``)."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@dataclass
class Gateway:
    url: str
    process: subprocess.Popen[bytes]
    port: int


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

    def gateway(self, port: int | None = None, **env: str) -> Gateway:
        port = port or free_port()
        log = self.logs / f"gateway-{port}.log"
        process = processes.gateway(port, self.base_env(**env), log)
        self.children.append(process)
        url = f"http://127.0.0.1:{port}"
        processes.wait_http(f"{url}/health", process, 60)
        return Gateway(url, process, port)

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

    def stop(self) -> None:
        for child in reversed(self.children):
            processes.stop(child)


def wait_for_worker(
    redis_url: str,
    prefix: str,
    worker_id: str,
    process: subprocess.Popen[bytes],
    timeout_s: float = 600,
) -> None:
    client = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"engine worker exited with {process.returncode}")
            if client.exists(f"{prefix}:worker:{worker_id}"):
                return
            time.sleep(0.1)
    finally:
        client.close()
    raise TimeoutError(f"worker {worker_id} did not register in {timeout_s} s")


@pytest.fixture
def stack(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(redis_server.url, f"t-{secrets.token_hex(4)}", tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@dataclass
class VllmStack:
    stack: Stack
    gateway: Gateway
    engine: subprocess.Popen[bytes]


@pytest.fixture(scope="session")
def vllm_stack(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmStack]:
    """One real vLLM worker (SmolLM2 on the CPU) and a gateway, shared by the session."""
    logs = tmp_path_factory.mktemp("vllm")
    stack = Stack(redis_server.url, f"v-{secrets.token_hex(4)}", logs)
    with VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            engine = stack.engine(
                "--backend",
                "vllm",
                "--model",
                "default",
                "--capacity",
                "8",
                "--metrics-port",
                str(free_port()),
            )
            gateway = stack.gateway()
            yield VllmStack(stack, gateway, engine)
        except Exception:
            for path in logs.iterdir():
                print(path.read_text()[-4000:])
            raise
        finally:
            stack.stop()
            fcntl.flock(lock, fcntl.LOCK_UN)


def pytest_report_header() -> str:
    return f"tokenspout tests: real Redis, real processes (pid {os.getpid()})"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Container tests first: their engine takes VLLM_LOCK, which the session's ``vllm_stack``
    holds from its first use to the session's end (a later take would wait on itself)."""
    items.sort(key=lambda item: item.get_closest_marker("containers") is None)
