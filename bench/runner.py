"""One measured point on the suite's rig (bench/rig.py): sessions, submits, readers, figures."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import WebSocketException

from bench import stats
from bench.loadgen import (
    PubSubReader,
    SSEStream,
    StreamRecord,
    open_pubsub,
    open_sse,
    read_ws,
)
from bench.rig import START_RATE, Rig
from bench.stats import cpu_of, ms, pct, steady_rate
from stack import procfs
from stack.rig import HOST

MODES = ("direct", "reference", "reference-spin", "gateway", "ws")
SWEEP_MODES = ("direct", "reference", "gateway", "ws")


@dataclass
class Stream:
    """One session and its generation; ``fanout`` readers on it (one unless fan-out)."""

    session_id: str
    token: str = ""
    generation_id: str = ""
    records: list[StreamRecord] = field(default_factory=list)
    readers: list[SSEStream] = field(default_factory=list)
    socket: Any = None
    socket_reader: asyncio.Task[None] | None = None

    def close(self) -> None:
        for reader in self.readers:
            reader.close()
        if self.socket_reader is not None:
            self.socket_reader.cancel()
        if self.socket is not None:
            self.socket.transport.abort()


async def gather_limited(jobs: list[Callable[[], Awaitable[None]]], limit: int = 32) -> None:
    gate = asyncio.Semaphore(limit)

    async def one(job: Callable[[], Awaitable[None]]) -> None:
        async with gate:
            await job()

    await asyncio.gather(*(one(job) for job in jobs))


async def create_sessions(rig: Rig, mode: str, count: int) -> list[Stream]:
    if mode == "ws":  # the generate frame makes the session
        return [Stream("") for _ in range(count)]
    streams: list[Stream] = []

    async def create() -> None:
        if mode == "gateway":
            response = await rig.http.post(f"http://{HOST}:{rig.gateway_port}/v1/sessions")
            response.raise_for_status()
            body = response.json()
            streams.append(Stream(body["session_id"], body["token"]))
        else:
            created = await rig.store.create_session()
            streams.append(Stream(created.session_id, created.token))

    await gather_limited([create] * count)
    return streams


async def submit(rig: Rig, mode: str, stream: Stream, max_tokens: int) -> None:
    if mode == "ws":
        ack: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        stream.socket_reader = asyncio.create_task(read_ws(stream.socket, stream.records[0], ack))
        await stream.socket.send(
            json.dumps(
                {"type": "generate", "id": "b", "content": "bench", "max_tokens": max_tokens}
            )
        )
        acked = await ack
        stream.session_id, stream.generation_id = acked["session_id"], acked["generation_id"]
        return
    if mode == "gateway":
        status, body = await rig.posts.post(
            f"/v1/sessions/{stream.session_id}/messages",
            b'{"content": "bench", "max_tokens": %d}' % max_tokens,
            {"X-Session-Token": stream.token},
        )
        if status != 202:
            raise RuntimeError(f"POST messages answered {status}: {body[:200]!r}")
        stream.generation_id = json.loads(body)["generation_id"]
    else:
        params = rig.store.queue.sampling(max_tokens=max_tokens)
        submitted = await rig.store.submit_message(stream.session_id, stream.token, "bench", params)
        stream.generation_id = submitted.generation_id


async def open_reader(rig: Rig, mode: str, stream: Stream, pubsub: PubSubReader | None) -> None:
    record = StreamRecord()
    stream.records.append(record)
    if mode == "direct":
        assert pubsub is not None
        await pubsub.subscribe(rig.keys.live_channel(stream.session_id), record)
        return
    if mode == "ws":
        loop = asyncio.get_running_loop()
        record.finished = loop.create_future()
        record.opened_at = time.perf_counter()
        stream.socket = await ws_connect(f"ws://{HOST}:{rig.gateway_port}/v1/ws")
        return
    if mode == "gateway":
        port, path = rig.gateway_port, f"/v1/sessions/{stream.session_id}/events"
        headers = {"X-Session-Token": stream.token}
    else:
        port, path, headers = rig.port_of(mode), f"/stream/{stream.session_id}", {}
    stream.readers.append(await open_sse(HOST, port, path, headers, record))
    assert record.ready is not None
    await record.ready


async def forget(rig: Rig, streams: list[Stream]) -> None:
    """Delete the point's keys, so Redis memory does not grow over the suite."""
    keys = rig.keys
    async with rig.redis.pipeline(transaction=False) as pipe:
        for s in streams:
            if not s.session_id:
                continue
            names = [keys.meta(s.session_id), keys.history(s.session_id)]
            names += [keys.events(s.session_id), keys.active(s.session_id)]
            names += [keys.watch(s.session_id)]
            if s.generation_id:
                names.append(keys.generation(s.session_id, s.generation_id))
            pipe.unlink(*names)
        await pipe.execute()


async def run_point(
    rig: Rig,
    mode: str,
    streams_n: int,
    tokens_per_s: float,
    duration_s: float,
    fanout: int = 1,
) -> dict[str, object]:
    """N streams of ``tokens_per_s * duration_s`` tokens each, started on one schedule.

    With ``fanout`` > 1 each session has that many readers (SSE modes only): the engine
    makes N streams of tokens and the relay delivers N * fanout.
    """
    readers = fanout if mode != "direct" else 1
    spread = max(1.0 / tokens_per_s, streams_n * readers / START_RATE)
    max_tokens = max(2, round(tokens_per_s * max(duration_s, 2 * spread if streams_n > 1 else 0)))
    streams = await create_sessions(rig, mode, streams_n)
    pubsub = await open_pubsub(HOST, rig.redis_port) if mode == "direct" else None
    pid = rig.pid_of(mode)
    pids = {"engine": rig.engine.pid, "redis": rig.redis_pid, "loadgen": os.getpid()}
    if pid:
        pids["relay"] = pid
    await stats.reset_command_stats(rig.redis)
    cpu_before = cpu_of(pids)
    rss_before = procfs.rss_bytes(pid) if pid else 0
    rss_peak = rss_before
    load_before = os.getloadavg()[0]
    failures: list[str] = []
    loop = asyncio.get_running_loop()
    began = loop.time() + 0.1

    async def run_stream(index: int, stream: Stream) -> None:
        await asyncio.sleep(max(0.0, began + index * spread / streams_n - loop.time()))
        try:
            for _ in range(readers):
                await open_reader(rig, mode, stream, pubsub)
            submitted_at = time.perf_counter()
            for record in stream.records:
                record.submitted_at = submitted_at
            await submit(rig, mode, stream, max_tokens)
            accepted_at = time.perf_counter()
            for record in stream.records:
                record.accepted_at = accepted_at
            for record in stream.records:
                assert record.finished is not None
                await record.finished
        except (OSError, RuntimeError, httpx.HTTPError, WebSocketException) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            for record in stream.records:
                record.end(failure=str(exc))

    async def sample_rss() -> None:
        nonlocal rss_peak
        while pid:
            rss_peak = max(rss_peak, procfs.rss_bytes(pid))
            await asyncio.sleep(0.25)

    sampler = asyncio.create_task(sample_rss())
    wall_began = time.perf_counter()
    runs = asyncio.gather(*(run_stream(i, s) for i, s in enumerate(streams)))
    try:
        await asyncio.wait_for(runs, max_tokens / tokens_per_s + spread + 20)
        timed_out = False
    except TimeoutError:
        timed_out = True
    wall = time.perf_counter() - wall_began
    sampler.cancel()
    cpu_after = cpu_of(pids)
    calls = await stats.command_calls(rig.redis)
    for stream in streams:
        stream.close()
    if pubsub is not None:
        pubsub.unsubscribe_all()
    await forget(rig, streams)

    records = [r for s in streams for r in s.records]
    tokens = sum(len(r.arrivals) for r in records)
    generated = sum(max((len(r.arrivals) for r in s.records), default=0) for s in streams)
    ttft = [r.arrivals[0] - r.submitted_at for r in records if r.arrivals]
    submit_s = [r.accepted_at - r.submitted_at for r in records if r.accepted_at]
    gaps = [b - a for r in records for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    arrivals = [t for r in records for t in r.arrivals]
    starts = [r.submitted_at for r in records if r.submitted_at]
    span = (max(arrivals) - min(starts)) if arrivals and starts else 0.0
    steady = steady_rate(records)
    complete = sum(1 for r in records if r.final == "done" and len(r.arrivals) == max_tokens)
    cpu = {name: cpu_after[name] - cpu_before[name] for name in pids}
    relay_cpu = cpu.get("relay")
    total_calls = sum(calls.values())
    top = sorted(calls.items(), key=lambda kv: -kv[1])[:8]
    failed = sorted(set(failures) | {r.failure for r in records if r.failure})
    return {
        "mode": mode,
        "streams": streams_n,
        "readers_per_stream": readers,
        "tokens_per_s_per_stream": tokens_per_s,
        "max_tokens": max_tokens,
        "start_spread_s": round(spread, 3),
        "wall_s": round(wall, 2),
        "loadavg_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "timed_out": timed_out,
        "complete_readers": complete,
        "failures": failed[:5],
        "tokens": tokens,
        "tokens_expected": max_tokens * streams_n * readers,
        "tokens_per_s": steady or (round(tokens / span, 1) if span else None),
        "tokens_per_s_whole_run": round(tokens / span, 1) if span else None,
        "ttft_ms": {
            "p50": ms(pct(ttft, 50)),
            "p99": ms(pct(ttft, 99)),
            "max": ms(max(ttft, default=None)),
        },
        "submit_ms": {"p50": ms(pct(submit_s, 50)), "p99": ms(pct(submit_s, 99))},
        "itl_ms": {
            "p50": ms(pct(gaps, 50)),
            "p99": ms(pct(gaps, 99)),
            "mean": ms(statistics.fmean(gaps) if gaps else None),
        },
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "relay_cpu_us_per_token": round(relay_cpu / tokens * 1e6, 2)
        if relay_cpu and tokens
        else None,
        "relay_cpu_utilisation": round(relay_cpu / wall, 3)
        if relay_cpu is not None and wall
        else None,
        "loadgen_cpu_utilisation": round(cpu["loadgen"] / wall, 3) if wall else None,
        "engine_cpu_us_per_token": round(cpu["engine"] / generated * 1e6, 2) if generated else None,
        "redis_cpu_us_per_token": round(cpu["redis"] / tokens * 1e6, 2) if tokens else None,
        "relay_rss_mib_before": round(rss_before / 2**20, 1) if pid else None,
        "relay_rss_mib_peak": round(rss_peak / 2**20, 1) if pid else None,
        "redis_calls": total_calls,
        "redis_calls_per_token": round(total_calls / tokens, 2) if tokens else None,
        "redis_top_commands": dict(top),
    }


async def single_stream_ttft(
    rig: Rig, modes: list[str], rounds: int, tokens_per_s: float
) -> dict[str, dict[str, float | None]]:
    """TTFT of one stream at a time, ``rounds`` times per mode, the modes interleaved so a
    busy moment on a shared machine hits all of them alike."""
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(rounds):
        for mode in modes:
            point = await run_point(rig, mode, 1, tokens_per_s, 3 / tokens_per_s)
            value = point["ttft_ms"]["p50"]  # type: ignore[index]
            if value is not None:
                samples[mode].append(value / 1000)
    return {
        mode: {
            "rounds": len(values),
            "p50": ms(pct(values, 50)),
            "p90": ms(pct(values, 90)),
            "min": ms(min(values, default=None)),
        }
        for mode, values in samples.items()
    }
