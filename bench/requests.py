"""``python -m bench.requests``: what a request costs, end to end, against the engine alone.

One-shot streaming chat completions (``POST /v1/chat/completions``, ``stream: true``) of
``--tokens`` tokens (1: the request is nearly all there is), ``--concurrency`` at a time,
``--requests`` of them per side, the synthetic engine unpaced, on each kind of connection
of ``--connections``: ``new`` (each request on a new connection: a new client, paying its
connect) and ``kept`` (each of the ``--concurrency`` clients sends its requests one after
another on one kept-alive connection, as the OpenAI SDK and a browser do). The sides, in
turns for ``--rounds``, on one set of processes (bench/rig.py, nothing pinned: every core
of the box):

- ``engine``: the same request answered by the engine alone (bench/reference_engine.py:
  the synthetic backend behind a bare ASGI app on the gateway's uvicorn settings);
- ``gateway xN``: through a gateway of N processes (``--gateways 1 2``: ``python -m gateway
  --workers N``, each on its own port); Redis and ``--engines`` engine workers (one by
  default) behind them all, on one Redis or a cluster (``--cluster``).

The clients run in this process, or split over ``--load-processes`` processes of their own
(one load generator is one core: on a box with many, it is what would be measured).

Per side: requests/s, time to the first token (p50, p99), and the CPU each process spent
per request (from /proc, before and after: gateway processes, worker, Redis; the engine
alone's own), the processes the side does not use idling meanwhile (their cost is
reported, and is small). Results: docs/bench/requests.json and requests.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from bench import profile_top, report, stats, stuck
from bench.loadgen import OpenAIStream, SSEStream, StreamRecord, open_stream, sse_request
from bench.rig import Rig, rig
from bench.runner import chat_body
from gateway.tenants.keystore import KeyStore
from gateway.tenants.records import NewKey
from stack.rig import HOST
from wire import Keys
from wire.limits import Limits

ROOT = Path(__file__).resolve().parent.parent
ENGINE = "engine"
LOAD_PROCESSES = "loadgen processes"
"""The load processes' part of ``loadgen``'s CPU (none when this process sends)."""
NEW, KEPT = "new", "kept"


def say(message: str) -> None:
    print(f"[bench.requests] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Outcome:
    """One request as the side's summary needs it (it crosses from a load process)."""

    ttft_s: float | None
    failure: str | None
    """Its failure, or how it ended when that was not ``done``; None: a whole reply."""


async def send(
    port: int, request: bytes, requests: int, concurrency: int, kept: bool
) -> list[Outcome]:
    """``requests`` copies of ``request`` to ``port``, ``concurrency`` at a time (``kept``:
    each client on one kept-alive connection)."""
    outcomes: list[Outcome] = []
    numbers = itertools.count()

    async def client() -> None:
        stream: SSEStream | None = None
        while next(numbers) < requests:
            record = StreamRecord()
            if stream is None:
                stream = await open_stream(HOST, port, request, record, OpenAIStream, kept)
            else:
                stream.again(record)
            assert record.finished is not None
            await record.finished
            ttft = record.arrivals[0] - record.submitted_at if record.arrivals else None
            failed = record.failure or (None if record.final == "done" else str(record.final))
            outcomes.append(Outcome(ttft, failed))
            if kept and record.failure is None:
                await stream.answered
            else:
                stream.close()
                stream = None
        if stream is not None:
            stream.close()

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return outcomes


def send_in_process(
    port: int, request: bytes, requests: int, concurrency: int, kept: bool
) -> tuple[list[Outcome], float]:
    """``send`` in a load process of its own (``--load-processes``), on asyncio's loop as
    in the main process (the readers are asyncio protocols); with the CPU seconds it took,
    the load generator's share."""
    began = time.process_time()
    outcomes = stuck.run(send(port, request, requests, concurrency, kept))
    return outcomes, time.process_time() - began


@dataclass(frozen=True)
class Side:
    """Where a side's requests go: its port, the processes on its path, its headers."""

    port: int
    path: list[str]
    headers: dict[str, str] | None = None


@dataclass(frozen=True)
class LimitedKey:
    """A key made for the bench with every limit set, none ever reached (each request is
    admitted against them: gateway/tenants/limits.py; the gateway, open to every request,
    serves a known key as its tenant)."""

    store: KeyStore
    id: str
    headers: dict[str, str]

    @classmethod
    async def make(cls, the_rig: Rig) -> LimitedKey:
        huge = 10**12
        limits = Limits(
            concurrent=huge, requests_per_minute=huge, tokens_per_minute=huge, tokens_per_day=huge
        )
        server = next(iter(the_rig.servers.values()))
        store = KeyStore(server.client, Keys(the_rig.prefix))
        record, secret = await store.create(NewKey(name="bench", limits=limits))
        await asyncio.sleep(1.0)  # the gateway reads the keys every 250 ms
        return cls(store, record.id, {"Authorization": f"Bearer {secret}"})

    async def generations(self) -> int:
        """The generations its usage counts (today's and yesterday's)."""
        now = int(time.time())
        days = await self.store.usage(self.id, "day", now - 86_400, now + 1)
        return sum(day.generations for day in days)


async def sides_of(
    the_rig: Rig, args: argparse.Namespace
) -> tuple[dict[str, Side], LimitedKey | None]:
    """The sides a run measures, by name (and the key of ``--limited-key``'s)."""
    behind = [*the_rig.engine_workers, *the_rig.servers]
    sides: dict[str, Side] = {ENGINE: Side(the_rig.engine_port, [ENGINE])}
    if 1 in args.gateways:
        sides["gateway x1"] = Side(the_rig.gateway_port, ["gateway", *behind])
    key = await LimitedKey.make(the_rig) if args.limited_key else None
    if key is not None:
        path = ["gateway", *behind]
        sides["gateway x1, limited key"] = Side(the_rig.gateway_port, path, key.headers)
    for name, (_, port) in the_rig.more_gateways.items():
        sides[name] = Side(port, [name, *behind])
    return sides, key


def shares(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` near-equal whole shares."""
    return [total // parts + (i < total % parts) for i in range(parts)]


async def run_side(
    the_rig: Rig,
    port: int,
    args: argparse.Namespace,
    kept: bool = False,
    load: ProcessPoolExecutor | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[list[Outcome], dict[str, float], float]:
    """``args.requests`` requests to ``port``, ``args.concurrency`` at a time (``kept``: each
    client on one kept-alive connection), sent from this process or split over the
    processes of ``load``: their outcomes, the CPU seconds of every process of the rig
    meanwhile (``loadgen``: this process and the load processes; ``LOAD_PROCESSES``: the
    load processes' part, each timing itself), and the wall time. ``headers``: the
    requests' own (an API key's)."""
    body = chat_body(the_rig, args.tokens)
    request = sse_request(HOST, port, "/v1/chat/completions", headers or {}, body)
    pids = the_rig.pids()
    before, began = stats.cpu_of(pids), time.perf_counter()
    load_cpu_s = 0.0
    if load is None:
        outcomes = await send(port, request, args.requests, args.concurrency, kept)
    else:
        loop = asyncio.get_running_loop()
        parts = args.load_processes
        sent = await asyncio.gather(
            *(
                loop.run_in_executor(load, send_in_process, port, request, n, c, kept)
                for n, c in zip(
                    shares(args.requests, parts), shares(args.concurrency, parts), strict=True
                )
            )
        )
        outcomes = [outcome for part, _ in sent for outcome in part]
        load_cpu_s = sum(cpu_s for _, cpu_s in sent)
    wall = time.perf_counter() - began
    after = stats.cpu_of(pids)
    cpu = {name: after[name] - before[name] for name in pids}
    cpu["loadgen"] += load_cpu_s
    cpu[LOAD_PROCESSES] = load_cpu_s
    return outcomes, cpu, wall


def summary(
    runs: list[tuple[list[Outcome], dict[str, float], float]], path: list[str]
) -> dict[str, Any]:
    """One side over its rounds: ``path``, the processes it runs through."""
    outcomes = [o for run in runs for o in run[0]]
    n, wall = len(outcomes), sum(run[2] for run in runs)
    cpu = {name: sum(run[1][name] for run in runs) for name in runs[0][1]}
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    failed = [o.failure for o in outcomes if o.failure is not None]
    return {
        "requests": n,
        "failed": len(failed),
        "failures": sorted(set(failed))[:5],
        "requests_per_s": round(n / wall, 1),
        "ttft_p50_ms": stats.ms(stats.pct(ttft, 50)),
        "ttft_p99_ms": stats.ms(stats.pct(ttft, 99)),
        "cpu_us_per_request": {name: round(cpu[name] / n * 1e6) for name in cpu},
        "path": path,
        "path_cpu_us_per_request": round(sum(cpu[name] for name in path) / n * 1e6),
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "tokens": args.tokens,
            "rounds": args.rounds,
            "gateways": args.gateways,
            "connections": args.connections,
            "load_processes": args.load_processes,
            "engines": args.engines,
            "cluster": args.cluster,
            "limited_key": args.limited_key,
        },
        "sides": {},
    }
    more = tuple(n for n in args.gateways if n > 1)
    load = None
    if args.load_processes > 1:
        load = ProcessPoolExecutor(args.load_processes, mp_context=get_context("spawn"))
    async with contextlib.AsyncExitStack() as stack:
        if load is not None:
            stack.callback(load.shutdown)
        the_rig = await stack.enter_async_context(
            rig(
                0,
                args.logs,
                shards=args.cluster,
                rest_cpu=None,
                gateway_cpu=None,
                workers=more,
                engines=args.engines,
            )
        )
        sides, key = await sides_of(the_rig, args)
        kinds = [(side, connection) for side in sides for connection in args.connections]
        runs: dict[tuple[str, str], list[Any]] = {kind: [] for kind in kinds}
        warm = argparse.Namespace(**{**vars(args), "requests": 50})
        for side in sides.values():  # warm up: imports, caches, pools, load processes
            await run_side(the_rig, side.port, warm, load=load, headers=side.headers)
        for round_ in range(1, args.rounds + 1):
            for name, connection in kinds:
                side = sides[name]
                kept = connection == KEPT
                runs[name, connection].append(
                    await run_side(the_rig, side.port, args, kept, load, side.headers)
                )
                outcomes, _, wall = runs[name, connection][-1]
                say(
                    f"round {round_}, {name}, {connection} connections:"
                    f" {len(outcomes) / wall:,.0f} requests/s"
                )
        for name, connection in kinds:
            results["sides"][f"{name}, {connection}"] = {
                "side": name,
                "connections": connection,
                **summary(runs[name, connection], sides[name].path),
            }
        if key is not None:  # the key's usage: every request of its side served it
            results["limited_key_generations"] = await key.generations()
        if args.profile is not None:
            results["profile"] = await profile(the_rig, args)
    return results


async def profile(the_rig: Rig, args: argparse.Namespace) -> dict[str, Any]:
    """py-spy on the gateway and the worker during one more run through one gateway on the
    first kind of ``--connections`` (not counted in the sides' figures); the speedscope
    files and their top frames into ``args.profile``."""
    args.profile.mkdir(parents=True, exist_ok=True)
    pids = {name: the_rig.pids()[name] for name in ("gateway", "worker")}
    async with profile_top.profiling(pids, args.profile, "requests", args.profile_native) as top:
        await run_side(the_rig, the_rig.gateway_port, args, kept=args.connections[0] == KEPT)
    (args.profile / "requests-summary.txt").write_text(profile_top.text({"gateway x1": top}))
    return top


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    sides = results["sides"]
    rows = []
    for r in sides.values():
        cpu = r["cpu_us_per_request"]
        parts = " + ".join(f"{name} {cpu[name]:,}" for name in r["path"])
        engine = sides[f"{ENGINE}, {r['connections']}"]
        ratio = r["requests_per_s"] / engine["requests_per_s"]
        rows.append(
            f"| {r['side']} | {r['connections']} | {r['requests_per_s']:,.0f} | {ratio:.2f} |"
            f" {r['ttft_p50_ms']:.1f} |"
            f" {r['ttft_p99_ms']:.1f} | {parts} | {r['path_cpu_us_per_request']:,} |"
            f" {r['failed']} |"
        )
    m = results["machine"]
    return (
        "# What a request costs\n\n"
        f"`python -m bench.requests`: {s['requests']:,} one-shot streaming chat completions"
        f" of {s['tokens']} token(s) per side and round, {s['concurrency']} at a time"
        " (connections: `new`, each request on a new connection; `kept`, each client's"
        " requests one after another on one kept-alive connection); the synthetic engine"
        f" unpaced, {s.get('engines', 1)} engine worker(s); sent from"
        f" {s.get('load_processes', 1)} load process(es); {s['rounds']} rounds, the sides in"
        " turns; nothing pinned. CPU per"
        " request from /proc, every process on the side's path; `vs engine`: against the"
        " engine alone on the same connections.\n\n"
        "| side | connections | requests/s | vs engine | TTFT p50 ms | TTFT p99 ms"
        " | CPU per request, us | path, us | failed |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n"
        f"Machine: {m['cpu_model']}, {m['nproc']} cores. The load generator shares"
        " them; its own CPU is in requests.json.\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.requests", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="per side and round")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1, help="tokens per request")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gateways", type=int, nargs="+", default=[1, 2])
    parser.add_argument(
        "--load-processes",
        type=int,
        default=1,
        help="send from this many processes (a box with spare cores: one is a core's worth)",
    )
    parser.add_argument("--engines", type=int, default=1, help="engine workers behind the gateways")
    parser.add_argument(
        "--cluster", type=int, default=0, metavar="PRIMARIES", help="on a Redis Cluster of these"
    )
    parser.add_argument("--connections", nargs="+", choices=[NEW, KEPT], default=[NEW, KEPT])
    parser.add_argument(
        "--limited-key",
        action="store_true",
        help="a side through one gateway with a key that has limits (never reached): what "
        "its admission costs, in turns with the side without a key",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="requests", help="file names: NAME.json, NAME.md")
    parser.add_argument("--logs", type=Path, default=None)
    parser.add_argument("--profile", type=Path, default=None, help="py-spy profiles into DIR")
    parser.add_argument(
        "--profile-native", action="store_true", help="with C frames (uvloop, the interpreter)"
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="only write NAME.md from this results JSON"
    )
    args = parser.parse_args(argv)
    if args.limited_key and args.cluster:
        parser.error("--limited-key runs on one Redis (its key is made there)")
    if args.concurrency < args.load_processes:
        parser.error("--concurrency must be at least --load-processes (a client or more each)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
        report.write(args.out, args.name, results, markdown(results))
        return
    report.run(args, measure, markdown, say)


if __name__ == "__main__":
    main()
