"""The processes a chaos run breaks: a Redis (bench/chaos/redises.py) behind a fault proxy,
gateways on fixed ports (the second one ``python -m gateway --workers 2``, the shape
``make run`` and compose start on a box with spare cores), each with its gRPC server, behind
another proxy that the clients go through, synthetic workers of two models; and every fault
as one method.

Each fault leaves the fleet whole again: a killed or stopped process is replaced on the
same port (a gateway) or by a fresh worker of the same model, a stopped one is resumed,
Redis is started again, a partition heals; a gateway process killed alone is replaced by
its gateway's parent.
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

from bench.chaos.network import Cut, Proxy, listeners_for
from bench.chaos.redises import LOSES_WRITES, Datastore, datastore
from bench.chaos.tenants import ApiKey, admin_key, make_keys
from stack import processes, procfs
from stack.redis_server import free_port
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
HOLDS_A_GATEWAY = {
    f"{side}_{how}" for side in ("gateway", "client") for how in ("blackhole", "oneway", "latency")
} | {"gateway_stop", "gateway_kill", "gateway_term"}
"""Faults that hold what a gateway answers until they end (a killed one's: until its
successor listens; the client proxy holds a connection made meanwhile till then)."""
HOLDS_A_WORKER = {"worker_stop", "worker_blackhole", "worker_oneway", "worker_latency"}
"""Faults that hold what a worker writes until they end."""
REDIS_AWAY = {"redis_restart", "redis_crash", "redis_wipe", "sentinel_failover", "primary_kill"}
"""Faults after which Redis takes no writes until it answers again (``Fault.back_s``)."""
REDIS_HELD = {"redis_pause", "redis_full"}
"""Faults during which Redis takes no (or too few) writes, for their ``held_s``."""


@dataclass
class Fault:
    """One fault as it was injected: ``at_s`` after the run began, ``held_s`` for a pause."""

    at_s: float
    kind: str
    target: str
    held_s: float = 0.0
    note: str = ""
    back_s: float | None = None
    """When Redis answered again (``REDIS_AWAY``); None while it has not."""


def redis_away_s(faults: list[Fault], from_s: float, to_s: float) -> float:
    """How long between ``from_s`` and ``to_s`` Redis took no writes by one of ``faults``
    (down, without a primary, paused, at its maxmemory): every gateway refuses then, 503
    with ``Retry-After``, as it should. Faults that overlap count once."""
    spans = sorted(
        (
            max(fault.at_s, from_s),
            min(
                to_s,
                fault.at_s + fault.held_s
                if fault.kind in REDIS_HELD
                else (fault.back_s if fault.back_s is not None else to_s),
            ),
        )
        for fault in faults
        if fault.kind in REDIS_AWAY | REDIS_HELD
    )
    away, reached = 0.0, from_s
    for begin, end in spans:
        begin = max(begin, reached)
        if end > begin:
            away += end - begin
            reached = end
    return away


@dataclass(frozen=True)
class Loss:
    """A fault after which Redis may lack writes it had acknowledged: from ``at_s`` until
    it answered again, ``back_s``."""

    at_s: float
    back_s: float
    kind: str


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
    store: Datastore
    client_proxy: Proxy
    """Between the run's clients and the gateways (their HTTP and gRPC ports)."""
    gateway_ports: list[int]
    grpc_ports: dict[int, int]
    """Gateway port -> its gRPC port (kept across restarts)."""
    admin: str = ""
    """``TOKENSPOUT_ADMIN_KEY`` of its gateways."""
    api_keys: list[ApiKey] = field(default_factory=list)
    """The keys its clients send with (bench/chaos/tenants.py), made once it serves."""
    started: float = field(default_factory=time.monotonic)
    started_unix: float = field(default_factory=time.time)
    """The same instant on the wall clock (Redis's stream ids are unix ms)."""
    gateways: dict[int, Gateway] = field(default_factory=dict)
    gateway_processes: dict[int, int] = field(default_factory=dict)
    workers: list[Worker] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
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
    def redis_kind(self) -> str:
        """``single``, ``volatile``, ``cluster`` or ``sentinel`` (bench/chaos/redises.py)."""
        return self.store.kind

    @property
    def keys(self) -> Keys:
        return Keys(self.rig.prefix)

    def now(self) -> float:
        return time.monotonic() - self.started

    @property
    def gateway_urls(self) -> list[str]:
        """The gateways, reached directly (the checks after the run, the admin API)."""
        return [f"http://{HOST}:{port}" for port in self.gateway_ports]

    @property
    def client_urls(self) -> list[str]:
        """The gateways as the clients reach them: through the client proxy."""
        return [f"http://{HOST}:{self.client_proxy.port_for(p)}" for p in self.gateway_ports]

    @property
    def grpc_urls(self) -> dict[str, str]:
        """A client URL -> its gateway's gRPC server, through the client proxy."""
        return {
            f"http://{HOST}:{self.client_proxy.port_for(port)}": (
                f"{HOST}:{self.client_proxy.port_for(self.grpc_ports[port])}"
            )
            for port in self.gateway_ports
        }

    # --- starting ------------------------------------------------------------------------

    def start(self) -> None:
        self.gateway_processes = dict(zip(self.gateway_ports, GATEWAY_PROCESSES, strict=True))
        for model, _ in itertools.product(MODELS, range(WORKERS_PER_MODEL)):
            self.start_worker(model)
        for port in self.gateway_ports:
            self.start_gateway(port)
        self.api_keys = make_keys(self.gateway_urls, self.admin)
        if self.redis_kind in ("single", "volatile"):
            self.store.provision(self.keys)
        self.started = time.monotonic()
        self.started_unix = time.time()

    def start_gateway(self, port: int) -> None:
        self.gateways[port] = self.rig.gateway(
            port, workers=self.gateway_processes[port], grpc_port=self.grpc_ports[port]
        )

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
        held = f" for {held_s:.1f} s" if held_s else ""
        print(f"[chaos] {fault.at_s:6.1f} s {kind} {target}{held} {note}".rstrip(), flush=True)
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
        fault = self.note(f"gateway_{how}", f"gateway:{port}", held_s if how == "stop" else 0.0)
        if how == "stop":
            await self._hold(gateway.process, held_s)
            return
        self.restarting.add(port)
        # Held until its successor listens (then known): meanwhile the client proxy takes
        # a connection to its port and closes it, and a request begun then was cut by it.
        fault.held_s = math.inf
        try:
            if how == "kill":
                self._kill_tree(gateway.process)
            else:
                gateway.process.send_signal(signal.SIGTERM)
                await asyncio.to_thread(gateway.process.wait, 60)
            await asyncio.to_thread(self.start_gateway, port)
        finally:
            self.restarting.discard(port)
            # Its port answers nobody until its successor listens: a fault that long.
            fault.held_s = round(self.now() - fault.at_s, 2)

    def kill_gateway_process(self, port: int, pid: int) -> None:
        """SIGKILL one process of a gateway of several (as the OOM killer would): its parent
        starts another on the same sockets; the others serve on."""
        self.note("gateway_process_kill", f"gateway:{port}", note=f"pid {pid}")
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _kill_tree(self, process: subprocess.Popen[bytes]) -> None:
        """SIGKILL a process and all its descendants at once, then reap it."""
        signal_all(procfs.tree(process.pid), signal.SIGKILL)
        process.wait()

    def faults_on(self, url: str, until_s: float = math.inf) -> int:
        """Faults on the gateway at ``url`` (direct, or through the client proxy), or on
        the clients' links to it, over by ``until_s`` (all so far): one still holding then
        (a gateway not yet back after its kill, a partition) counts as after it."""
        target = self._target_of(url)
        return sum(
            fault.target == target and fault.at_s + fault.held_s <= until_s for fault in self.faults
        )

    def held_until(self, url: str, from_s: float, to_s: float) -> float:
        """When the last fault between ``from_s`` and ``to_s`` that held what a client of
        the gateway at ``url`` is told ended (0.0: none did): one that held that gateway
        from Redis (or its clients from it), or a worker (stopped or cut off: the end of a
        reply it wrote comes once it is back)."""
        target = self._target_of(url) if url else ""
        return max(
            (
                fault.at_s + fault.held_s
                for fault in self.faults
                if (fault.kind in HOLDS_A_WORKER or fault.kind in HOLDS_A_GATEWAY)
                and (fault.target == target or fault.kind in HOLDS_A_WORKER)
                and fault.at_s <= to_s
                and fault.at_s + fault.held_s >= from_s
            ),
            default=0.0,
        )

    def redis_away_s(self, from_s: float, to_s: float) -> float:
        """``redis_away_s`` of this run's faults."""
        return redis_away_s(self.faults, from_s, to_s)

    def _target_of(self, url: str) -> str:
        port = int(url.rsplit(":", 1)[1])
        through = {listen: up for up, listen in self.client_proxy.listen.items()}
        return f"gateway:{through.get(port, port)}"

    async def _hold(self, process: subprocess.Popen[bytes], held_s: float) -> None:
        held = self.stopped[process.pid] = procfs.tree(process.pid)
        signal_all(held, signal.SIGSTOP)
        try:
            await asyncio.sleep(held_s)
        finally:
            del self.stopped[process.pid]
            signal_all(held, signal.SIGCONT)

    async def cut_worker(self, worker: Worker, cut: Cut) -> None:
        """Partition a worker from Redis (its links only) as ``cut`` says."""
        fault = self.note(f"worker_{cut.how}", worker.worker_id, cut.held_s, cut.describe())
        links = await self.store.proxy.cut(cut, pids=[worker.process.pid])
        fault.note += f", {links} links"

    async def cut_gateway(self, port: int, cut: Cut) -> None:
        """Partition a gateway (every process of it) from Redis as ``cut`` says."""
        fault = self.note(f"gateway_{cut.how}", f"gateway:{port}", cut.held_s, cut.describe())
        links = await self.store.proxy.cut(cut, pids=[self.gateways[port].process.pid])
        fault.note += f", {links} links"

    async def cut_clients(self, port: int, cut: Cut, share: float) -> None:
        """Partition a ``share`` of the clients' links to a gateway (HTTP and gRPC)."""
        fault = self.note(f"client_{cut.how}", f"gateway:{port}", cut.held_s, cut.describe())
        listeners = [self.client_proxy.port_for(p) for p in (port, self.grpc_ports[port])]
        links = await self.client_proxy.cut(cut, listeners=listeners, share=share)
        fault.note += f", {links} of the clients' links ({share:.0%})"

    async def redis_down(self, kind: str, down_s: float) -> None:
        """``restart``, ``crash`` or ``wipe`` the one Redis (bench/chaos/redises.py)."""
        async with self.redis_lock:
            fault = self.note(f"redis_{kind}", "redis", down_s)
            lost = await asyncio.to_thread(getattr(self.store, kind), down_s)
            self._answered_again(fault, kind)
            if kind == "crash":
                fault.note += f", {lost} bytes of AOF lost"

    async def fail_over(self, pick: int) -> None:
        """SIGKILL a primary (a cluster's, or the one Sentinel names); its replica is
        promoted; the old one comes back as its replica."""
        kind = "primary_kill" if self.redis_kind == "cluster" else "sentinel_failover"
        loop = asyncio.get_running_loop()

        def promoted(victim: str) -> None:  # called in the fault's thread
            fault.target = victim
            loop.call_soon_threadsafe(self._answered_again, fault, "fail_over")

        async with self.redis_lock:
            await asyncio.sleep(self.store.fail_over_in_s())
            fault = self.note(kind, "redis")
            await asyncio.to_thread(self.store.fail_over, pick, promoted)

    def _answered_again(self, fault: Fault, kind: str) -> None:
        back_s = fault.back_s = round(self.now(), 2)
        fault.note = f"answered again at {back_s} s"
        if kind in LOSES_WRITES:
            self.losses.append(Loss(fault.at_s, back_s, fault.kind))

    async def pause_redis(self, held_s: float) -> None:
        """``CLIENT PAUSE`` writes for ``held_s`` on every primary."""
        async with self.redis_lock:
            self.note("redis_pause", "redis", held_s)
            await asyncio.to_thread(self.store.pause, held_s)
            await asyncio.sleep(held_s)

    async def fill_redis(self, held_s: float) -> None:
        """Every primary at its ``maxmemory`` for ``held_s``: writes refused with OOM."""
        async with self.redis_lock:
            self.note("redis_full", "redis", held_s)
            await asyncio.to_thread(self.store.fill, True)
            try:
                await asyncio.sleep(held_s)
            finally:
                await asyncio.to_thread(self.store.fill, False)

    def resume_all(self) -> None:
        """SIGCONT whatever a fault still holds (the run is ending)."""
        for held in list(self.stopped.values()):
            signal_all(held, signal.SIGCONT)


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


@contextlib.contextmanager
def fleet(redis_kind: str, logs: Path) -> Iterator[Fleet]:
    """A fleet on a Redis of its own, stopped with it (every process, then the proxies and
    the Redis)."""
    prefix = f"chaos-{secrets.token_hex(3)}"
    admin = admin_key()
    env = {
        "TOKENSPOUT_ADMIN_KEY": admin,  # every request then wants a key: the run's own
        "TOKENSPOUT_LOG_LEVEL": "INFO",  # an anomaly's story: every start, end, takeover
        "TOKENSPOUT_SHUTDOWN_GRACE_S": "3",
        "TOKENSPOUT_DEFAULT_MODEL": MODELS[0],  # TGI's requests name no model
        # A one-shot request's keys outlive the run: the usage check reads them all at its
        # end (by default they last 600 s, and the first ones expired as a soak was read).
        "TOKENSPOUT_STATELESS_TTL_S": "86400",
    }
    store = datastore(redis_kind, logs)
    ports = [free_port() for _ in GATEWAY_PROCESSES]
    grpc_ports = {port: free_port() for port in ports}
    client_proxy = Proxy("clients", listeners_for([*ports, *grpc_ports.values()]), logs)
    rig = Rig(store.url, prefix, logs, env)
    the_fleet = Fleet(rig, store, client_proxy, ports, grpc_ports, admin)
    try:
        client_proxy.start()
        the_fleet.start()
        yield the_fleet
    finally:
        the_fleet.resume_all()
        rig.stop()
        client_proxy.stop()
        store.cleanup()
