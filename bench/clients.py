"""Streaming chat completions from several load processes at once: the one client of
``python -m bench.gpu``, the same for vLLM's own server and for the gateway.

One load process is one core: at GPU rates (a thousand streams, tens of thousands of chunks
a second) a client in one process would be what the bench measures. ``Clients(K)`` keeps K
processes (spawned once, for the whole bench); ``run`` hands each every K-th stream of a
schedule (stream i starts at ``began + i * spread / N``, ``began`` on the machine's
monotonic clock, which every process shares), and each reads its streams with the load
generator's own readers (bench/loadgen.py ``OpenAIStream``, on uvloop). Each process times
its own CPU, so the report shows whether the client kept up: a process near 1.0 of a core
is a bottleneck, and more processes (``--clients``) are needed.
"""

from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context

import uvloop

from bench.loadgen import OpenAIStream, SSEStream, StreamRecord, open_stream
from stack.rig import HOST


@dataclass(frozen=True)
class Share:
    """What one load process read: its streams (as ``StreamRecord`` fields, which cross
    processes), its own CPU seconds and how long it ran."""

    streams: list[tuple[float, float, list[float], str | None, str | None]]
    cpu_s: float
    wall_s: float
    timed_out: bool


@dataclass(frozen=True)
class Outcome:
    """One run over every load process."""

    records: list[StreamRecord]
    cpu_s: list[float]
    """Each load process's own CPU seconds."""
    wall_s: float
    timed_out: bool

    @property
    def busiest(self) -> float:
        """The busiest load process's share of a core over the run (near 1.0: the client
        may be what limits the run)."""
        return round(max(self.cpu_s) / self.wall_s, 3) if self.wall_s else 0.0


async def _read(
    port: int,
    request: bytes,
    schedule: list[tuple[int, StreamRecord]],
    streams_n: int,
    spread_s: float,
    began: float,
) -> None:
    readers: list[SSEStream] = []

    async def one(index: int, record: StreamRecord) -> None:
        await asyncio.sleep(max(0.0, began + index * spread_s / streams_n - time.perf_counter()))
        try:
            readers.append(await open_stream(HOST, port, request, record, OpenAIStream))
        except OSError as exc:
            record.end(failure=f"{type(exc).__name__}: {exc}")
            return
        assert record.finished is not None
        await record.finished

    try:
        await asyncio.gather(*(one(index, record) for index, record in schedule))
    finally:
        for reader in readers:
            reader.close()


def read_share(
    port: int,
    request: bytes,
    indices: list[int],
    streams_n: int,
    spread_s: float,
    began: float,
    bound_s: float,
) -> Share:
    """In a load process: streams ``indices`` of the schedule, bounded by ``bound_s``."""
    cpu, wall = time.process_time(), time.perf_counter()

    records = [StreamRecord() for _ in indices]

    async def bounded() -> bool:
        schedule = list(zip(indices, records, strict=True))
        try:
            await asyncio.wait_for(
                _read(port, request, schedule, streams_n, spread_s, began), bound_s
            )
        except TimeoutError:
            return True
        return False

    timed_out = uvloop.run(bounded())
    streams = [(r.submitted_at, r.headers_at, r.arrivals, r.final, r.failure) for r in records]
    wall = time.perf_counter() - max(wall, began)
    return Share(streams, time.process_time() - cpu, wall, timed_out)


def _pid() -> int:
    time.sleep(0.3)  # held, so that the pool starts a process for each call
    return os.getpid()


class Clients:
    """``processes`` load processes, started by ``start`` and kept until ``close``."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._pool = ProcessPoolExecutor(processes, mp_context=get_context("spawn"))

    async def start(self) -> None:
        """Every process up (spawned, its imports done) before the first measured run."""
        loop = asyncio.get_running_loop()
        while True:
            pids = await asyncio.gather(
                *(loop.run_in_executor(self._pool, _pid) for _ in range(self.processes))
            )
            if len(set(pids)) == self.processes:
                return

    async def run(
        self, port: int, request: bytes, streams_n: int, spread_s: float, bound_s: float
    ) -> Outcome:
        """``streams_n`` copies of ``request`` (a streamed chat completion) to ``port``,
        started evenly over ``spread_s``, split over the load processes."""
        loop = asyncio.get_running_loop()
        began = time.perf_counter() + 0.2  # the calls reach every process first
        shares = await asyncio.gather(
            *(
                loop.run_in_executor(
                    self._pool,
                    read_share,
                    port,
                    request,
                    list(range(k, streams_n, self.processes)),
                    streams_n,
                    spread_s,
                    began,
                    bound_s,
                )
                for k in range(min(self.processes, streams_n))
            )
        )
        records = [
            StreamRecord(submitted_at=s, headers_at=h, arrivals=a, final=f, failure=x)
            for share in shares
            for s, h, a, f, x in share.streams
        ]
        wall = max(share.wall_s for share in shares)
        timed_out = any(share.timed_out for share in shares)
        return Outcome(records, [share.cpu_s for share in shares], wall, timed_out)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
