"""The network of a chaos run: a fault proxy (bench/chaos/proxy.py) between every process
and Redis, another between the clients and the gateways, and the partitions they make.

A partition is drawn as a ``Cut``: how (``blackhole``, ``oneway`` up or down, ``latency``,
``reset``), how long it holds, how late a ``latency`` makes each chunk. The same cuts strike
a worker's or a gateway's links to Redis (by process, found in /proc), or the clients'
links to one gateway (a share of them, all their HTTP and gRPC ports)."""

from __future__ import annotations

import random
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from bench.chaos.proxy import ProxyControl
from stack import processes
from stack.redis_server import free_port

HOWS = ("blackhole", "oneway", "latency", "reset")
BLACKHOLE_S = (1.0, 8.0)
"""How long a blackhole or a one-way partition holds: past the workers' 5 s timeout at
times, below the 10 s after which TCP would give up on a connection (wire/connect.py: a
proxy's kernel acknowledges what it buffers, so the processes' own TCP never sees it)."""
LATENCY_S = (2.0, 8.0)
DELAY_S = (0.02, 0.3)


@dataclass(frozen=True)
class Cut:
    how: str
    held_s: float = 0.0
    delay_s: float = 0.0
    direction: str = ""

    @classmethod
    def draw(cls, how: str, rng: random.Random) -> Cut:
        if how == "reset":
            return cls(how)
        if how == "latency":
            return cls(how, rng.uniform(*LATENCY_S), rng.uniform(*DELAY_S))
        direction = rng.choice(("up", "down")) if how == "oneway" else ""
        return cls(how, rng.uniform(*BLACKHOLE_S), direction=direction)

    def describe(self) -> str:
        words = [self.how, self.direction]
        if self.delay_s:
            words.append(f"+{self.delay_s * 1000:.0f} ms")
        return " ".join(w for w in words if w)

    def arguments(self) -> dict[str, object]:
        return {"held_s": self.held_s, "delay_s": self.delay_s, "direction": self.direction}


def listeners_for(upstreams: list[int]) -> dict[int, int]:
    """A free port to listen on for each upstream port."""
    return {upstream: free_port() for upstream in upstreams}


class Proxy:
    """A proxy process (``python -m bench.chaos.proxy``): one listener per upstream port
    (``listen``: upstream -> its listener, picked before the servers start, so that they
    can announce it)."""

    def __init__(self, name: str, listen: dict[int, int], logs: Path) -> None:
        self.name = name
        self.listen = dict(listen)
        self.control_port = free_port()
        self.logs = logs
        self.process: subprocess.Popen[bytes] | None = None
        self.control = ProxyControl(self.control_port)

    def port_for(self, upstream: int) -> int:
        return self.listen[upstream]

    def start(self, timeout_s: float = 30.0) -> Proxy:
        routes = [f"{listen}:{upstream}" for upstream, listen in self.listen.items()]
        args = ["-m", "bench.chaos.proxy", "--control-port", str(self.control_port)]
        self.process = processes.spawn(
            [*args, *(a for route in routes for a in ("--route", route))],
            {},
            self.logs / f"proxy-{self.name}.log",
        )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} proxy exited with {self.process.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.control_port), timeout=1).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    async def cut(
        self,
        cut: Cut,
        *,
        pids: list[int] | None = None,
        listeners: list[int] | None = None,
        share: float = 1.0,
    ) -> int:
        """Strike ``cut`` on the links of ``pids`` or of ``listeners``; the links struck."""
        return await self.control.strike(
            cut.how, pids=pids, listeners=listeners, share=share, **cut.arguments()
        )

    def stop(self) -> None:
        if self.process is not None:
            processes.stop(self.process)
