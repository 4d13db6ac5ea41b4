"""``python -m bench.e2e``: end to end, as a new user would try it, against the engine alone.

A client streams chat completions through the gateway, Redis and the synthetic engine worker,
and the same schedule straight from an engine with no gateway and no Redis
(bench/reference_engine.py: the synthetic backend's own generator behind a bare ASGI app).
Three paths per point, interleaved, on one set of processes:

- ``engine``: ``POST /v1/chat/completions`` (``stream: true``) on the reference engine;
- ``openai``: the same request on the gateway (one request = one stateless session);
- ``session``: the session API: ``POST /v1/sessions`` beforehand (not timed), the SSE stream
  ``GET /v1/sessions/{id}/events`` opened, then ``POST /v1/sessions/{id}/messages`` (timed);
- ``grpc``: the gateway's KServe v2 / Triton ``ModelStreamInfer``, one call per stream, all
  on one channel (bench/grpc_stream.py);
- ``responses`` (only when ``--modes`` names it): ``POST /v1/responses`` (``stream: true``),
  a Responses stream on the gateway (one request = one stored response).

Streams: 100 tokens at 50 tokens/s each by default, N = 1, 10, 100, 500, 1,000 streams
started over N / 1,000 s, and an unpaced saturation point (tokens as fast as the engine
makes them). The gateway is pinned to CPU 1; the engine worker, Redis, the reference engine
and the load generator to CPU 0. Added latency is a gateway path minus ``engine`` at the
same point. Results: docs/bench/e2e.json, e2e.md, e2e.png; docs/bench.md has the method.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis

from bench import e2e_report, profile_top, report, stats
from bench.grpc_stream import GrpcStream, open_grpc_stream, stream_request
from bench.loadgen import (
    HTTPPool,
    SSEStream,
    StreamRecord,
    open_chat_stream,
    open_responses_stream,
    open_sse,
)
from bench.stats import Run, added, cpu_of, describe, summarise
from stack.redis_server import free_port
from stack.rig import HOST, on_embedded_redis
from stack.rig import Rig as ProcessRig

ENV = {
    "TOKENSPOUT_LOG_LEVEL": "WARNING",
    "TOKENSPOUT_MAX_INFLIGHT": str(12_000 * 2),
    "TOKENSPOUT_SESSION_TTL_S": "600",
}
MODES = ("engine", "openai", "session", "grpc", "responses")
DEFAULT_MODES = ("engine", "openai", "session", "grpc")
GATEWAY_CPU, REST_CPU = 1, 0
MAX_STREAMS = 12_000
ROOT = Path(__file__).resolve().parent.parent


def say(message: str) -> None:
    print(f"[bench.e2e] {message}", file=sys.stderr, flush=True)


@dataclass
class Rig:
    gateway: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]
    engine: subprocess.Popen[bytes]
    gateway_port: int
    engine_port: int
    redis_pid: int
    redis: aioredis.Redis
    pinned: bool
    grpc_channel: grpc.aio.Channel
    posts: HTTPPool = field(init=False)
    top_logprobs: int | None = field(default=None, init=False)
    """The OpenAI path's requests ask for logprobs with this many alternatives (--logprobs)."""

    def __post_init__(self) -> None:
        self.posts = HTTPPool(HOST, self.gateway_port)

    def pids(self) -> dict[str, int]:
        return {
            "gateway": self.gateway.pid,
            "worker": self.worker.pid,
            "redis": self.redis_pid,
            "engine": self.engine.pid,
            "loadgen": os.getpid(),
        }


@contextlib.asynccontextmanager
async def e2e_rig(
    tokens_per_s: float, logs: Path, unix_socket: bool = False, join_tokens: bool = False
) -> AsyncIterator[Rig]:
    """Redis, one synthetic engine worker, the gateway and the reference engine, all paced
    at ``tokens_per_s`` (0: unpaced); the gateway on CPU 1, everything else on CPU 0."""
    prefix = f"e2e-{secrets.token_hex(3)}"
    with on_embedded_redis(logs, prefix, ENV, unix_socket=unix_socket, cpu=REST_CPU) as (
        procs,
        embedded,
    ):
        pid = embedded.process.pid if embedded.process else 0
        async with (
            aioredis.Redis.from_url(procs.redis_url) as client,
            serving(procs, tokens_per_s, client, pid, join_tokens) as rig,
        ):
            yield rig


@contextlib.asynccontextmanager
async def serving(
    procs: ProcessRig,
    tokens_per_s: float,
    client: aioredis.Redis,
    redis_pid: int,
    join_tokens: bool = False,
    rig_type: type[Rig] = Rig,
    **extra: Any,
) -> AsyncIterator[Rig]:
    """The worker, the gateway and the reference engine on ``procs``' Redis, pinned; the
    rig a ``rig_type`` with ``extra`` fields."""
    joined = ["--join-tokens"] if join_tokens else []
    worker = procs.synthetic(tokens_per_s, "--capacity", str(MAX_STREAMS), *joined, cpu=REST_CPU)
    gateway = procs.gateway(grpc=True, cpu=GATEWAY_CPU)
    port = free_port()
    engine = procs.spawn(
        "reference-engine",
        ["-m", "bench.reference_engine", "--port", str(port), "--tokens-per-s", str(tokens_per_s)],
        health=f"http://{HOST}:{port}/health",
        cpu=REST_CPU,
    )
    if procs.pinned:
        procs.pin(os.getpid(), REST_CPU, children=False)
    channel = grpc.aio.insecure_channel(gateway.grpc_url)
    rig = rig_type(
        gateway.process, worker, engine, gateway.port, port, redis_pid, client, procs.pinned,
        channel, **extra,
    )  # fmt: skip
    try:
        yield rig
    finally:
        rig.posts.close()
        await channel.close()


def chat_body(max_tokens: int, top_logprobs: int | None = None) -> bytes:
    body: dict[str, object] = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "bench"}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if top_logprobs is not None:
        body |= {"logprobs": True, "top_logprobs": top_logprobs}
    return json.dumps(body).encode()


def responses_body(max_tokens: int) -> bytes:
    body = {"model": "synthetic", "input": "bench", "max_output_tokens": max_tokens, "stream": True}
    return json.dumps(body).encode()


async def create_session(rig: Rig) -> tuple[str, str]:
    status, body = await rig.posts.post("/v1/sessions", b"{}", {})
    if status not in (200, 201):
        raise RuntimeError(f"POST /v1/sessions answered {status}: {body[:200]!r}")
    created = json.loads(body)
    return created["session_id"], created["token"]


async def one_stream(
    rig: Rig, mode: str, max_tokens: int, record: StreamRecord, session: tuple[str, str] | None
) -> SSEStream | GrpcStream:
    """Open one stream of ``mode``; it is counted into ``record`` until its final frame."""
    if mode == "grpc":
        return open_grpc_stream(rig.grpc_channel, stream_request(max_tokens), record)
    if mode == "responses":
        return await open_responses_stream(
            HOST, rig.gateway_port, responses_body(max_tokens), record
        )
    if mode in ("engine", "openai"):
        port = rig.engine_port if mode == "engine" else rig.gateway_port
        logprobs = rig.top_logprobs if mode == "openai" else None
        return await open_chat_stream(HOST, port, chat_body(max_tokens, logprobs), record)
    assert session is not None
    sid, token = session
    headers = {"X-Session-Token": token}
    reader = await open_sse(HOST, rig.gateway_port, f"/v1/sessions/{sid}/events", headers, record)
    assert record.ready is not None
    await record.ready
    record.submitted_at = time.perf_counter()
    body = b'{"content": "bench", "max_tokens": %d}' % max_tokens
    status, reply = await rig.posts.post(f"/v1/sessions/{sid}/messages", body, headers)
    if status != 202:
        raise RuntimeError(f"POST messages answered {status}: {reply[:200]!r}")
    record.accepted_at = time.perf_counter()
    return reader


async def run_once(
    rig: Rig, mode: str, streams_n: int, max_tokens: int, spread_s: float, bound_s: float
) -> Run:
    sessions: list[tuple[str, str] | None] = [None] * streams_n
    if mode == "session":
        sessions = list(await asyncio.gather(*(create_session(rig) for _ in range(streams_n))))
    records = [StreamRecord() for _ in range(streams_n)]
    readers: list[SSEStream | GrpcStream] = []
    failures: list[str] = []
    pids = rig.pids()
    await stats.reset_command_stats(rig.redis)
    before = cpu_of(pids)
    loop = asyncio.get_running_loop()
    began = loop.time() + 0.05

    async def stream(index: int) -> None:
        record = records[index]
        await asyncio.sleep(max(0.0, began + index * spread_s / streams_n - loop.time()))
        try:
            readers.append(await one_stream(rig, mode, max_tokens, record, sessions[index]))
            assert record.finished is not None
            await record.finished
        except (OSError, RuntimeError) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            record.end(failure=str(exc))

    wall_began = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(streams_n))), bound_s)
        timed_out = False
    except TimeoutError:
        timed_out = True
    wall = time.perf_counter() - wall_began
    after = cpu_of(pids)
    calls = sum((await stats.command_calls(rig.redis)).values())
    for reader in readers:
        reader.close()
    arrivals = [t for r in records for t in r.arrivals]
    starts = [r.submitted_at for r in records if r.submitted_at]
    span = max(arrivals) - min(starts) if arrivals and starts else 0.0
    failures += [r.failure for r in records if r.failure]
    cpu = {name: after[name] - before[name] for name in pids}
    return Run(records, cpu, wall, calls, timed_out, sorted(set(failures))[:5], span)


async def run_point(
    rig: Rig,
    streams_n: int,
    tokens_per_s: float,
    tokens: int,
    start_rate: float,
    rounds: int,
    modes: list[str],
) -> dict[str, Any]:
    """N streams per mode, ``rounds`` times, the modes interleaved within each round."""
    spread = streams_n / start_rate if streams_n > 1 else 0.0
    max_tokens = tokens
    if tokens_per_s > 0:
        max_tokens = max(tokens, math.ceil(2 * spread * tokens_per_s))
        bound = max_tokens / tokens_per_s + spread + 20
    else:
        bound = spread + streams_n * max_tokens / 2_000 + 20  # 2,000 tokens/s at worst
    runs: dict[str, list[Run]] = {mode: [] for mode in modes}
    load = [round(os.getloadavg()[0], 2)]
    for _ in range(rounds):
        for mode in modes:
            runs[mode].append(await run_once(rig, mode, streams_n, max_tokens, spread, bound))
            await asyncio.sleep(0.2)
    load.append(round(os.getloadavg()[0], 2))
    point: dict[str, Any] = {
        "streams": streams_n,
        "tokens_per_s_per_stream": tokens_per_s,
        "max_tokens": max_tokens,
        "start_spread_s": round(spread, 3),
        "loadavg_before_after": load,
        "modes": {mode: summarise(mode, runs[mode], max_tokens) for mode in modes},
    }
    if "engine" in modes:
        alone = point["modes"]["engine"]
        point["added"] = {
            mode: added(point["modes"][mode], alone) for mode in modes if mode != "engine"
        }
    return point


async def profile_point(
    rig: Rig, args: argparse.Namespace, streams_n: int, modes: list[str]
) -> dict[str, Any]:
    """The point again (not measured: py-spy takes CPU too), with py-spy on the gateway and
    the worker for each gateway path; speedscope files and their top frames."""
    out: Path = args.profile  # made by main()
    summary: dict[str, Any] = {}
    for mode in modes:
        files = {
            name: out / f"{mode}-{streams_n}-{name}.speedscope.json"
            for name in ("gateway", "worker")
        }
        spies = [
            profile_top.record(pid, files[name], native=args.profile_native)
            for name, pid in (("gateway", rig.gateway.pid), ("worker", rig.worker.pid))
        ]
        await asyncio.sleep(1.0)  # py-spy attaches
        await run_point(rig, streams_n, args.rate, args.tokens, args.start_rate, 1, [mode])
        for spy in spies:
            profile_top.stop(spy)
        summary[mode] = {name: profile_top.summary(path) for name, path in files.items()}
    return summary


async def warm_up(rig: Rig, modes: list[str]) -> None:
    """A few streams per path, not measured: the first requests of a fresh process pay for
    imports, caches and connection pools (tens of ms), which is not what the points ask."""
    for mode in modes:
        await run_once(rig, mode, 10, 5, 0.01, 30)


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {
            "streams": args.streams,
            "tokens_per_s_per_stream": args.rate,
            "tokens_per_stream": args.tokens,
            "start_rate_streams_per_s": args.start_rate,
            "single_stream_rounds": args.rounds_single,
            "saturation": args.saturation,
            "modes": args.modes,
            "openai_top_logprobs": args.logprobs,
            "reduced": args.reduced,
        },
        "points": [],
    }
    began = time.monotonic()
    async with e2e_rig(args.rate, args.logs, args.unix_socket, args.join_tokens) as rig:
        rig.top_logprobs = args.logprobs
        results["pinned"] = rig.pinned
        await warm_up(rig, args.modes)
        for n in args.streams:
            rounds = args.rounds_single if n == 1 else 1
            point = await run_point(
                rig, n, args.rate, args.tokens, args.start_rate, rounds, args.modes
            )
            results["points"].append(point)
            say(describe(point))
        if args.profile is not None:
            at = args.profile_streams
            gateway_modes = [m for m in args.modes if m != "engine"]
            say(f"profiling {gateway_modes} at {at} streams into {args.profile}")
            results["profile"] = {
                "streams": at,
                "dir": str(args.profile),
                "top": await profile_point(rig, args, at, gateway_modes),
            }
    streams_n, tokens = args.saturation
    if streams_n and tokens:
        async with e2e_rig(0, args.logs, args.unix_socket, args.join_tokens) as rig:
            rig.top_logprobs = args.logprobs
            await warm_up(rig, args.modes)
            point = await run_point(rig, streams_n, 0, tokens, args.start_rate, 1, args.modes)
            results["saturation"] = point
            say("saturation (unpaced) " + describe(point))
    results["suite_s"] = round(time.monotonic() - began, 1)
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 10, 100, 500, 1000])
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream (at least)")
    parser.add_argument("--start-rate", type=float, default=1000.0, help="streams started per s")
    parser.add_argument(
        "--rounds-single", type=int, default=10, help="rounds of the 1-stream point"
    )
    parser.add_argument(
        "--saturation",
        type=int,
        nargs=2,
        default=[100, 1000],
        metavar=("STREAMS", "TOKENS"),
        help="unpaced point: streams x tokens each (0 0: skip)",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy speedscopes into DIR")
    parser.add_argument("--profile-streams", type=int, default=500, help="the profiled point")
    parser.add_argument(
        "--profile-native", action="store_true", help="py-spy --native (C frames: uvloop, hiredis)"
    )
    parser.add_argument("--reduced", action="store_true", help="mark the results as a reduced run")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--join-tokens",
        action="store_true",
        help="the worker joins a reply's tokens while Redis is behind (engine --join-tokens)",
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="TOP",
        help="the OpenAI path asks for each token's logprob and TOP alternatives (its cost)",
    )
    parser.add_argument(
        "--unix-socket",
        action="store_true",
        help="gateway and worker reach Redis over a Unix socket (default: loopback TCP)",
    )
    parser.add_argument("--name", default="e2e", help="file names: NAME.json, NAME.md, NAME.png")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = Path(tempfile.mkdtemp(prefix="tokenspout-e2e-"))
    say(f"process logs in {args.logs}; load average {os.getloadavg()[0]:.2f}")
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    results = asyncio.run(suite(args))
    if "profile" in results:
        top = results["profile"]["top"]
        (args.profile / "summary.json").write_text(json.dumps(top, indent=1) + "\n")
        (args.profile / "summary.txt").write_text(profile_top.text(top))
    before = args.out / f"{args.name}-before.json"  # kept for comparison, if there is one
    old = json.loads(before.read_text()) if before.exists() else None
    png = args.out / f"{args.name}.png"
    plot = None if args.no_plot else (lambda _out: e2e_report.plot(results, png))
    report.write(args.out, args.name, results, e2e_report.markdown(results, old), plot)
    say(f"done in {results['suite_s']} s: {args.out}/{args.name}.md")


if __name__ == "__main__":
    main()
