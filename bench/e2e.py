"""``python -m bench.e2e``: end to end, as a new user would try it, against the engine alone.

A client streams chat completions through the gateway, Redis and the synthetic engine worker,
and the same schedule straight from an engine with no gateway and no Redis
(bench/reference_engine.py: the synthetic backend's own generator behind a bare ASGI app),
on the bench rig (bench/rig.py). The paths are bench/runner.py's: ``engine``, ``openai``,
``session`` and ``grpc`` by default, ``responses`` and ``ws`` when ``--modes`` names them;
interleaved within each round, on one set of processes.

Streams: 100 tokens at 50 tokens/s each by default, N = 1, 10, 100, 500, 1,000 streams
started over N / 1,000 s, and an unpaced saturation point (tokens as fast as the engine
makes them). Added latency is a gateway path minus ``engine`` at the same point.
``--cluster 3`` runs every gateway path a second time on a Redis Cluster of 3 primaries, in
turns with the one Redis (does a cluster spread Redis's work, or add to it?).
``--engine vllm`` puts vLLM on the CPU on both sides (SmolLM2, greedy: the worker's backend
and the engine alone's are the same code), at its own pace (``--rate 0``); ``--cancels N``
measures N cancels on the rig after the points (bench/cancels.py).
Results: docs/bench/e2e.json, e2e.md, e2e.png; docs/bench.md has the method.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from bench import cancels, e2e_report, profile_top, report, stats, stuck
from bench.rig import Rig, rig, run_logs
from bench.runner import MODES, run_once
from bench.stats import Run, added, describe, summarise

DEFAULT_MODES = ("engine", "openai", "session", "grpc")
ONE, CLUSTER = "one Redis", "cluster"
ROOT = Path(__file__).resolve().parent.parent


FLOATING = {"rest_cpu": None, "gateway_cpu": None}
"""``--floating``: no process pinned, each may take a core of its own (a box with spare
cores); by default the gateway has CPU 1 and everything else CPU 0."""


def say(message: str) -> None:
    print(f"[bench.e2e] {message}", file=sys.stderr, flush=True)


@contextlib.asynccontextmanager
async def rigs(args: argparse.Namespace, tokens_per_s: float) -> AsyncIterator[dict[str, Rig]]:
    """The one-Redis rig, and with ``--cluster`` the same on a cluster beside it."""
    placement: dict[str, Any] = {"gateway_workers": args.gateway_workers}
    if args.floating:
        placement |= FLOATING
    async with contextlib.AsyncExitStack() as stack:
        one = rig(
            tokens_per_s,
            args.logs,
            engine=args.engine,
            unix_socket=args.unix_socket,
            join_tokens=args.join_tokens,
            **placement,
        )
        sides = {ONE: await stack.enter_async_context(one)}
        if args.cluster:
            logs = args.logs / f"cluster-{tokens_per_s:g}"
            logs.mkdir(exist_ok=True)
            sides[CLUSTER] = await stack.enter_async_context(
                rig(
                    tokens_per_s,
                    logs,
                    shards=args.cluster,
                    join_tokens=args.join_tokens,
                    **placement,
                )
            )
        for side in sides.values():
            side.top_logprobs = args.logprobs
        yield sides


async def run_point(
    sides: dict[str, Rig],
    streams_n: int,
    tokens_per_s: float,
    tokens: int,
    start_rate: float,
    rounds: int,
    modes: list[str],
) -> dict[str, Any]:
    """N streams per mode, ``rounds`` times, the modes interleaved within each round and
    each mode run on every side in turn (the engine alone only once: it has no Redis)."""
    spread = streams_n / start_rate if streams_n > 1 else 0.0
    max_tokens = tokens
    if tokens_per_s > 0:
        max_tokens = max(tokens, math.ceil(2 * spread * tokens_per_s))
        bound = max_tokens / tokens_per_s + spread + 20
    else:
        bound = spread + streams_n * max_tokens / 2_000 + 20  # 2,000 tokens/s at worst
    runs: dict[tuple[str, str], list[Run]] = {}
    load = [round(os.getloadavg()[0], 2)]
    for _ in range(rounds):
        for mode in modes:
            for side, the_rig in sides.items():
                if side == ONE or mode != "engine":
                    run = await run_once(the_rig, mode, streams_n, max_tokens, spread, bound)
                    runs.setdefault((side, mode), []).append(run)
                    await asyncio.sleep(0.2)
    load.append(round(os.getloadavg()[0], 2))
    on: dict[str, dict[str, Any]] = {side: {} for side in sides}
    for (side, mode), done in runs.items():
        on[side][mode] = summarise(mode, done, max_tokens)
    point: dict[str, Any] = {
        "streams": streams_n,
        "tokens_per_s_per_stream": tokens_per_s,
        "max_tokens": max_tokens,
        "start_spread_s": round(spread, 3),
        "loadavg_before_after": load,
        "modes": on[ONE],
    }
    if CLUSTER in on:
        point["cluster"] = on[CLUSTER]
    if "engine" in modes:
        alone = point["modes"]["engine"]
        point["added"] = {
            mode: added(point["modes"][mode], alone) for mode in modes if mode != "engine"
        }
    return point


async def profile_point(
    the_rig: Rig, args: argparse.Namespace, streams_n: int, modes: list[str]
) -> dict[str, Any]:
    """The point again (not measured: py-spy takes CPU too), with py-spy on the gateway and
    the worker for each gateway path; speedscope files and their top frames."""
    summary: dict[str, Any] = {}
    pids = {"gateway": the_rig.gateway.pid, "worker": the_rig.worker.pid}
    for mode in modes:
        stem, native = f"{mode}-{streams_n}", args.profile_native
        async with profile_top.profiling(pids, args.profile, stem, native) as summary[mode]:
            await run_point(
                {ONE: the_rig}, streams_n, args.rate, args.tokens, args.start_rate, 1, [mode]
            )
    return summary


async def warm_up(sides: dict[str, Rig], modes: list[str]) -> None:
    """A few streams per path, not measured: the first requests of a fresh process pay for
    imports, caches and connection pools (tens of ms), which is not what the points ask."""
    for the_rig in sides.values():
        for mode in modes:
            await run_once(the_rig, mode, 10, 5, 0.01, 30)


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {
            "engine": args.engine,
            "streams": args.streams,
            "tokens_per_s_per_stream": args.rate,
            "tokens_per_stream": args.tokens,
            "start_rate_streams_per_s": args.start_rate,
            "single_stream_rounds": args.rounds_single,
            "rounds": args.rounds,
            "saturation": args.saturation,
            "modes": args.modes,
            "openai_top_logprobs": args.logprobs,
            "cluster_primaries": args.cluster,
            "reduced": args.reduced,
            "gateway_workers": args.gateway_workers,
            "floating": args.floating,
        },
        "points": [],
    }
    began = time.monotonic()
    async with rigs(args, args.rate) as sides:
        results["pinned"] = all(side.pinned for side in sides.values())
        await warm_up(sides, args.modes)
        for n in args.streams:
            rounds = args.rounds_single if n == 1 else args.rounds
            point = await run_point(
                sides, n, args.rate, args.tokens, args.start_rate, rounds, args.modes
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
                "top": await profile_point(sides[ONE], args, at, gateway_modes),
            }
        if args.cancels:
            say(f"{args.cancels} cancels")
            results["cancels"] = await cancels.measure(sides[ONE], args.cancels)
    streams_n, tokens = args.saturation
    if streams_n and tokens:
        async with rigs(args, 0) as sides:
            await warm_up(sides, args.modes)
            point = await run_point(sides, streams_n, 0, tokens, args.start_rate, 1, args.modes)
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
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every other point")
    parser.add_argument(
        "--saturation",
        type=int,
        nargs=2,
        default=[100, 1000],
        metavar=("STREAMS", "TOKENS"),
        help="unpaced point: streams x tokens each (0 0: skip)",
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(DEFAULT_MODES))
    parser.add_argument(
        "--engine",
        choices=("synthetic", "vllm"),
        default="synthetic",
        help="vllm: SmolLM2 on the CPU on both sides, at its own pace (give --rate 0)",
    )
    parser.add_argument(
        "--cancels", type=int, default=0, help="then N cancelled generations (bench/cancels.py)"
    )
    parser.add_argument(
        "--cluster",
        type=int,
        default=0,
        metavar="PRIMARIES",
        help="every gateway path also on a Redis Cluster of PRIMARIES shards, in turns",
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy speedscopes into DIR")
    parser.add_argument("--profile-streams", type=int, default=500, help="the profiled point")
    parser.add_argument(
        "--profile-native", action="store_true", help="py-spy --native (C frames: uvloop, hiredis)"
    )
    parser.add_argument(
        "--floating", action="store_true", help="pin nothing: every process floats over every core"
    )
    parser.add_argument(
        "--gateway-workers",
        type=int,
        default=1,
        metavar="N",
        help="the gateway as N processes on one port (python -m gateway --workers N; with"
        " --floating)",
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
    args = parser.parse_args(argv)
    if args.gateway_workers > 1 and not args.floating:
        parser.error("--gateway-workers N > 1 needs --floating (pinned, all N share CPU 1)")
    if args.engine == "vllm" and (args.cluster or args.rate):
        parser.error("--engine vllm runs at vLLM's own pace (--rate 0) on one Redis")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = run_logs("e2e", args.profile, say)
    results = stuck.run(suite(args))
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
