"""The processes a chaos run breaks: a Redis (one server with persistence, or a cluster),
gateways on fixed ports (the second one ``python -m gateway --workers 2``, the shape
``make run`` and compose start on a box with spare cores), synthetic workers of two models;
and every fault as one method.

Each fault leaves the fleet whole again: a killed or stopped process is replaced on the
same port (a gateway) or by a fresh worker of the same model, a stopped one is resumed,
Redis is started again; a gateway process killed alone is replaced by its gateway's parent.
A gateway is its whole process tree (its children have sessions of their own): a kill or a
stop strikes every process of it, as a container's would. ``faults`` records what was done
and when, for the report and for the checker (a client cut off while its gateway died was
not failed by the product)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import secrets
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from bench.chaos.tenants import ApiKey, admin_key, make_keys
from stack import processes, procfs
from stack.redis_cluster import EmbeddedCluster
from stack.redis_server import EmbeddedRedis, free_port
from stack.rig import HOST, Gateway, Rig
from wire import Keys

MODELS = ("alpha", "beta")
PREEMPTING = "beta"
PREEMPTING_SLOTS = 4
"""The workers of ``PREEMPTING`` have this few slots, full under the run's load, and
preempt (``--preempt``): replies are stopped for tenants served less, under every fault."""
WORKERS_PER_MODEL = 2
GATEWAY_PROCESSES = (1, 2)
"""Per gateway, its processes (``--workers``)."""
SERVING_AFTER_S = 10.0
"""A gateway process this old has served: killed, it is replaced (one killed before it
served stops its whole gateway, by design: gateway/server/supervisor.py)."""
TOKENS_PER_S = 40


@dataclass
class Fault:
    """One fault as it was injected: ``at_s`` after the run began, ``held_s`` for a pause."""

    at_s: float
    kind: str
    target: str
    held_s: float = 0.0
    note: str = ""


@dataclass
class Worker:
    model: str
    worker_id: str
    process: subprocess.Popen[bytes]
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class Fleet:
    rig: Rig
    redis_kind: str
    """``single`` (one server, AOF), ``volatile`` (one server keeping nothing on disk, as
    the embedded default: never restarted, docs/reliability.md 4b says what a restart does
    to it) or ``cluster`` (3 primaries, 3 replicas)."""
    server: EmbeddedRedis | None
    cluster: EmbeddedCluster | None
    admin: str = ""
    """``TOKENSPOUT_ADMIN_KEY`` of its gateways."""
    api_keys: list[ApiKey] = field(default_factory=list)
    """The keys its clients send with (bench/chaos/tenants.py), made once it serves."""
    started: float = field(default_factory=time.monotonic)
    started_unix: float = field(default_factory=time.time)
    """The same instant on the wall clock (Redis's stream ids are unix ms)."""
    gateway_ports: list[int] = field(default_factory=list)
    gateways: dict[int, Gateway] = field(default_factory=dict)
    gateway_processes: dict[int, int] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    restarting: set[int] = field(default_factory=set)
    """Gateway ports between a kill or SIGTERM and their new process serving."""
    ending: set[str] = field(default_factory=set)
    """Workers SIGTERMed and still handing over: no longer targets."""
    stopped: dict[int, list[int]] = field(default_factory=dict)
    """Pid -> its process tree, held by SIGSTOP right now (resumed at the end, whatever
    happens)."""
    redis_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    """One Redis fault at a time: a restart during a pause, or two failovers at once, is
    a different experiment."""

    @property
    def keys(self) -> Keys:
        return Keys(self.rig.prefix)

    def now(self) -> float:
        return time.monotonic() - self.started

    @property
    def gateway_urls(self) -> list[str]:
        return [f"http://{HOST}:{port}" for port in self.gateway_ports]

    # --- starting ------------------------------------------------------------------------

    def start(self) -> None:
        self.gateway_ports = [free_port() for _ in GATEWAY_PROCESSES]
        self.gateway_processes = dict(zip(self.gateway_ports, GATEWAY_PROCESSES, strict=True))
        for model, _ in itertools.product(MODELS, range(WORKERS_PER_MODEL)):
            self.start_worker(model)
        for port in self.gateway_ports:
            self.start_gateway(port)
        self.api_keys = make_keys(self.gateway_urls, self.admin)
        self.started = time.monotonic()
        self.started_unix = time.time()

    def start_gateway(self, port: int) -> None:
        self.gateways[port] = self.rig.gateway(port, workers=self.gateway_processes[port])

    def start_worker(self, model: str) -> None:
        worker_id = f"{model}-{secrets.token_hex(3)}"
        metrics_port = free_port()
        preempting = ["--capacity", str(PREEMPTING_SLOTS), "--preempt"]
        process = self.rig.synthetic(
            TOKENS_PER_S,
            "--served-model-name",
            model,
            "--metrics-port",
            str(metrics_port),
            "--drain-s",
            "5",
            *(preempting if model == PREEMPTING else []),
            worker_id=worker_id,
        )
        self.workers.append(Worker(model, worker_id, process, metrics_port))

    def gateway_target(self, pick: int) -> int | None:
        """A gateway port no fault holds now (``pick`` modulo those), or None."""
        free = self._free_gateways()
        return free[pick % len(free)] if free else None

    def gateway_process_target(self, pick: int) -> tuple[int, int] | None:
        """One process (port, pid) of a gateway of several that no fault holds, one that
        has served (``SERVING_AFTER_S``), or None."""
        serving = [
            (port, pid)
            for port in self._free_gateways()
            if self.gateway_processes[port] > 1
            for pid in procfs.tree(self.gateways[port].process.pid)[1:]
            if procfs.age_s(pid) > SERVING_AFTER_S
        ]
        return serving[pick % len(serving)] if serving else None

    def _free_gateways(self) -> list[int]:
        return [
            port
            for port in self.gateway_ports
            if port not in self.restarting and self.gateways[port].process.pid not in self.stopped
        ]

    def worker_target(self, pick: int) -> Worker | None:
        """A serving worker no fault holds now (``pick`` modulo those), or None."""
        free = [w for w in self.live_workers() if w.process.pid not in self.stopped]
        return free[pick % len(free)] if free else None

    def live_workers(self) -> list[Worker]:
        return [
            w for w in self.workers if w.process.poll() is None and w.worker_id not in self.ending
        ]

    # --- faults --------------------------------------------------------------------------

    def note(self, kind: str, target: str, held_s: float = 0.0, note: str = "") -> Fault:
        fault = Fault(round(self.now(), 2), kind, target, round(held_s, 2), note)
        self.faults.append(fault)
        return fault

    async def signal_worker(self, worker: Worker, how: str, held_s: float) -> None:
        """SIGKILL or SIGTERM a worker (a fresh one of its model takes its place at once),
        or SIGSTOP it for ``held_s``."""
        self.note(f"worker_{how}", worker.worker_id, held_s if how == "stop" else 0.0)
        if how == "stop":
            await self._hold(worker.process, held_s)
            return
        self.ending.add(worker.worker_id)
        if how == "kill":
            processes.kill(worker.process)
        else:
            worker.process.send_signal(signal.SIGTERM)
        await asyncio.to_thread(self.start_worker, worker.model)

    async def signal_gateway(self, port: int, how: str, held_s: float) -> None:
        """SIGKILL or SIGTERM a gateway and start another on its port once it is gone, or
        SIGSTOP it for ``held_s`` (one no other fault holds: ``gateway_target``)."""
        gateway = self.gateways[port]
        self.note(f"gateway_{how}", f"gateway:{port}", held_s if how == "stop" else 0.0)
        if how == "stop":
            await self._hold(gateway.process, held_s)
            return
        self.restarting.add(port)
        try:
            if how == "kill":
                self._kill_tree(gateway.process)
            else:
                gateway.process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(gateway.process.wait, 60)
            await asyncio.to_thread(self.start_gateway, port)
        finally:
            self.restarting.discard(port)

    def kill_gateway_process(self, port: int, pid: int) -> None:
        """SIGKILL one process of a gateway of several (as the OOM killer would): its parent
        starts another on the same sockets; the others serve on."""
        self.note("gateway_process_kill", f"gateway:{port}", note=f"pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _kill_tree(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL a process and all its descendants at once, then reap it."""
        _signal_all(procfs.tree(process.pid), signal.SIGKILL)
        process.wait()

    def faults_on(self, url: str, until_s: float = math.inf) -> int:
        """Faults on the gateway at ``url`` injected up to ``until_s`` (all so far)."""
        target = f"gateway:{url.rsplit(':', 1)[1]}"
        return sum(fault.target == target and fault.at_s <= until_s for fault in self.faults)

    async def _hold(self, process: subprocess.Popen[bytes], held_s: float) -> None:
        held = self.stopped[process.pid] = procfs.tree(process.pid)
        _signal_all(held, signal.SIGSTOP)
        try:
            await asyncio.sleep(held_s)
        finally:
            del self.stopped[process.pid]
            _signal_all(held, signal.SIGCONT)

    async def restart_redis(self, down_s: float) -> None:
        """Stop the one Redis (SIGTERM: its AOF is written whole), wait, start it again."""
        assert self.server is not None
        async with self.redis_lock:
            self.note("redis_restart", "redis", down_s)
            await asyncio.to_thread(self.server.stop)
            await asyncio.sleep(down_s)
            await asyncio.to_thread(self.server.start)

    async def pause_redis(self, held_s: float) -> None:
        """``CLIENT PAUSE`` writes for ``held_s`` on the one Redis, or on every primary."""
        async with self.redis_lock:
            self.note("redis_pause", "redis", held_s)
            for port in self._primary_ports():
                with redis.Redis(host=HOST, port=port, socket_timeout=5) as client:
                    client.execute_command("CLIENT", "PAUSE", int(held_s * 1000), "WRITE")
            await asyncio.sleep(held_s)

    async def fail_over_primary(self, index: int) -> None:
        """SIGKILL one cluster primary; once its replica is promoted, the old one comes back
        as the new primary's replica."""
        assert self.cluster is not None
        async with self.redis_lock:
            ports = self._primary_ports()
            victim = next(n for n in self.cluster.nodes if n.port == ports[index % len(ports)])
            self.note("primary_kill", f"redis:{victim.port}")
            await asyncio.to_thread(self.cluster.kill_primary, victim, 90)
            await asyncio.to_thread(victim.start)
            await asyncio.to_thread(self.cluster.wait_healthy, 90)

    def _primary_ports(self) -> list[int]:
        if self.server is not None:
            return [self.server.port]
        assert self.cluster is not None
        return [node.port for node in self.cluster.primaries_now()]

    def resume_all(self) -> None:
        """SIGCONT whatever a fault still holds (the run is ending)."""
        for held in list(self.stopped.values()):
            _signal_all(held, signal.SIGCONT)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def fleet(redis_kind: str, logs: Path) -> Iterator[Fleet]:
    """A fleet on a Redis of its own, stopped with it (every process, the Redis last)."""
    prefix = f"chaos-{secrets.token_hex(3)}"
    admin = admin_key()
    env = {
        "TOKENSPOUT_ADMIN_KEY": admin,  # every request then wants a key: the run's own
        "TOKENSPOUT_LOG_LEVEL": "INFO",  # an anomaly's story: every start, end, takeover
        "TOKENSPOUT_SHUTDOWN_GRACE_S": "3",
    }
    server: EmbeddedRedis | None = None
    cluster: EmbeddedCluster | None = None
    if redis_kind in ("single", "volatile"):
        server = EmbeddedRedis(data_dir=logs / "redis", persist=redis_kind == "single")
        server.data_dir.mkdir(parents=True, exist_ok=True)
        server.start()
        url = server.url
    else:
        cluster = EmbeddedCluster().__enter__()
        url = cluster.url
    rig = Rig(url, prefix, logs, env)
    the_fleet = Fleet(rig, redis_kind, server, cluster, admin)
    try:
        the_fleet.start()
        yield the_fleet
    finally:
        the_fleet.resume_all()
        rig.stop()
        if server is not None:
            server.cleanup()
        if cluster is not None:
            cluster.cleanup()
