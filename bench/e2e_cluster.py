"""``python -m bench.e2e_cluster``: bench/e2e.py's end-to-end mode on one Redis and on a
3-primary Redis Cluster, side by side in one run.

Two rigs run at once, each bench/e2e.py's (a gateway, a synthetic engine worker, the load
generator; pinned the same way): one on one embedded Redis (``e2e.e2e_rig``), one on an
embedded cluster of 3 primaries without replicas (stack/redis_cluster.py, ``REDIS_URL=
redis+cluster://``; one Redis has no replica either). At each point (100 and 500 streams by
default) the two take turns, round after round, with the same streams: the same machine
load falls on both, so their ratio holds where the absolute figures drift.

Per shard: its CPU time from /proc (utime + stime of its valkey-server, as the one-Redis run
reads its one), the events written on it (XADD calls, the scripts' included), and from
those its share of the tokens and its CPU per token. The question: does the cluster spread
Redis's work over the shards (each shard about a third), and not add to it (the shards'
CPU per token summed about one Redis's)? Results: docs/bench/e2e_cluster.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis.asyncio as aioredis

from bench import e2e, e2e_report, report, stats
from bench.stats import Run, summarise
from stack.redis_cluster import EmbeddedCluster
from stack.rig import Rig as ProcessRig

BACKENDS = ("one Redis", "cluster")


def say(message: str) -> None:
    print(f"[bench.e2e_cluster] {message}", file=sys.stderr, flush=True)


class _Shards:
    """What ``e2e.run_once`` asks of its Redis (reset the command stats, read them), over
    every shard of the cluster."""

    def __init__(self, clients: dict[str, aioredis.Redis]) -> None:
        self.clients = clients

    async def config_resetstat(self) -> None:
        for client in self.clients.values():
            await client.config_resetstat()

    async def info(self, section: str) -> dict[str, dict[str, int]]:
        merged: dict[str, dict[str, int]] = {}
        for client in self.clients.values():
            for name, value in (await client.info(section)).items():
                if isinstance(value, dict):
                    merged.setdefault(name, {"calls": 0})["calls"] += int(value["calls"])
        return merged


@dataclass
class ClusterRig(e2e.Rig):
    shards: dict[str, int] = field(default_factory=dict)
    """valkey-server pid of each shard, by name (``redis0``...)."""
    shard_clients: dict[str, aioredis.Redis] = field(default_factory=dict)

    def pids(self) -> dict[str, int]:
        pids = {name: pid for name, pid in super().pids().items() if name != "redis"}
        return pids | self.shards


@contextlib.asynccontextmanager
async def cluster_rig(tokens_per_s: float, logs: Path, primaries: int) -> AsyncIterator[ClusterRig]:
    """e2e.e2e_rig's processes on a cluster of ``primaries`` shards (no replicas), every
    shard pinned where e2e pins its one Redis."""
    prefix = f"e2e-{secrets.token_hex(3)}"
    with EmbeddedCluster(primaries=primaries, replicas=0) as cluster:
        procs = ProcessRig(cluster.url, prefix, logs, dict(e2e.ENV))
        shards = {f"redis{i}": n.process.pid for i, n in enumerate(cluster.nodes) if n.process}
        for pid in shards.values():
            procs.pin(pid, e2e.REST_CPU)
        clients = {f"redis{i}": aioredis.Redis(port=n.port) for i, n in enumerate(cluster.nodes)}
        try:
            shard_view = cast(aioredis.Redis, _Shards(clients))
            extra = {"shards": shards, "shard_clients": clients}
            async with e2e.serving(
                procs, tokens_per_s, shard_view, 0, False, ClusterRig, **extra
            ) as rig:
                yield cast(ClusterRig, rig)
        finally:
            procs.stop()
            for client in clients.values():
                await client.aclose()


def _servers(rig: e2e.Rig) -> dict[str, aioredis.Redis]:
    return rig.shard_clients if isinstance(rig, ClusterRig) else {"redis": rig.redis}


async def measured_run(
    rig: e2e.Rig, mode: str, streams_n: int, max_tokens: int, spread: float, bound: float
) -> tuple[Run, dict[str, int]]:
    """One ``e2e.run_once``, with its Redis CPU summed over the shards as ``redis``, and
    the events (XADD calls) each Redis server wrote."""
    run = await e2e.run_once(rig, mode, streams_n, max_tokens, spread, bound)
    servers = _servers(rig)
    run.cpu_s["redis"] = sum(run.cpu_s[name] for name in servers)
    events = {
        name: (await stats.command_calls(client)).get("xadd", 0) for name, client in servers.items()
    }
    return run, events


def shard_figures(
    runs: list[tuple[Run, dict[str, int]]], tokens: int, tokens_per_s: float | None
) -> dict[str, Any]:
    """Per Redis server: CPU, events written, its share of them and of the tokens, CPU per
    token over every token delivered and over its own share."""
    names = list(runs[0][1])
    events = {name: sum(ev[name] for _run, ev in runs) for name in names}
    total_events = sum(events.values()) or 1
    figures = {}
    for name in names:
        cpu = sum(run.cpu_s[name] for run, _ev in runs)
        share = events[name] / total_events
        own_tokens = tokens * share
        figures[name] = {
            "cpu_s": round(cpu, 3),
            "events": events[name],
            "share": round(share, 3),
            "tokens_per_s": round(tokens_per_s * share, 1) if tokens_per_s else None,
            "cpu_us_per_token": round(cpu / tokens * 1e6, 1) if tokens else None,
            "cpu_us_per_own_token": round(cpu / own_tokens * 1e6, 1) if own_tokens else None,
        }
    return figures


async def compare_point(
    rigs: dict[str, e2e.Rig], args: argparse.Namespace, streams_n: int
) -> dict[str, Any]:
    spread = streams_n / args.start_rate if streams_n > 1 else 0.0
    max_tokens = max(args.tokens, int(2 * spread * args.rate) + 1)
    bound = max_tokens / args.rate + spread + 20
    runs: dict[str, dict[str, list[tuple[Run, dict[str, int]]]]] = {
        backend: {mode: [] for mode in args.modes} for backend in rigs
    }
    load = [round(os.getloadavg()[0], 2)]
    for _ in range(args.rounds):
        for mode in args.modes:
            for backend, rig in rigs.items():
                runs[backend][mode].append(
                    await measured_run(rig, mode, streams_n, max_tokens, spread, bound)
                )
                await asyncio.sleep(0.2)
    load.append(round(os.getloadavg()[0], 2))
    point: dict[str, Any] = {
        "streams": streams_n,
        "max_tokens": max_tokens,
        "loadavg_before_after": load,
        "backends": {},
    }
    for backend in rigs:
        point["backends"][backend] = {}
        for mode in args.modes:
            done = runs[backend][mode]
            summary = summarise(mode, [run for run, _ev in done], max_tokens)
            summary["redis_servers"] = shard_figures(
                done, summary["tokens"], summary["tokens_per_s"]
            )
            point["backends"][backend][mode] = summary
    return point


def describe(point: dict[str, Any]) -> str:
    parts = [f"{point['streams']} streams:"]
    for backend, modes in point["backends"].items():
        for mode, m in modes.items():
            shards = ", ".join(
                f"{name} {s['share']:.2f} {s['cpu_us_per_token']} us/tok"
                for name, s in m["redis_servers"].items()
            )
            parts.append(
                f"{backend} {mode}: {m['tokens']}/{m['tokens_expected']} tok, "
                f"{m['tokens_per_s']} tok/s, Redis {m['cpu_us_per_token']['redis']} us/tok "
                f"({shards});"
            )
    return " ".join(parts)


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {
            "streams": args.streams,
            "tokens_per_s_per_stream": args.rate,
            "tokens_per_stream": args.tokens,
            "start_rate_streams_per_s": args.start_rate,
            "rounds": args.rounds,
            "primaries": args.primaries,
            "modes": args.modes,
        },
        "points": [],
    }
    began = time.monotonic()
    for backend in BACKENDS:
        (args.logs / backend.replace(" ", "-")).mkdir(exist_ok=True)
    async with (
        e2e.e2e_rig(args.rate, args.logs / "one-Redis") as one,
        cluster_rig(args.rate, args.logs / "cluster", args.primaries) as sharded,
    ):
        rigs: dict[str, e2e.Rig] = {"one Redis": one, "cluster": sharded}
        results["pinned"] = one.pinned and sharded.pinned
        for rig in rigs.values():
            await e2e.warm_up(rig, args.modes)
        for n in args.streams:
            point = await compare_point(rigs, args, n)
            results["points"].append(point)
            say(describe(point))
    results["suite_s"] = round(time.monotonic() - began, 1)
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e_cluster", description=__doc__)
    parser.add_argument("--out", type=Path, default=e2e.ROOT / "docs" / "bench")
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--rate", type=float, default=50.0, help="tokens/s per stream")
    parser.add_argument("--tokens", type=int, default=100, help="tokens per stream (at least)")
    parser.add_argument("--start-rate", type=float, default=1000.0, help="streams started per s")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per point and backend")
    parser.add_argument("--primaries", type=int, default=3, help="the cluster's shards")
    parser.add_argument(
        "--modes", nargs="+", choices=("openai", "session"), default=["session", "openai"]
    )
    parser.add_argument("--name", default="e2e_cluster", help="file names: NAME.json, NAME.md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = Path(tempfile.mkdtemp(prefix="tokenspout-e2e-cluster-"))
    say(f"process logs in {args.logs}; load average {os.getloadavg()[0]:.2f}")
    results = asyncio.run(suite(args))
    report.write(args.out, args.name, results, e2e_report.cluster_markdown(results))
    say(f"done in {results['suite_s']} s: {args.out}/{args.name}.md")


if __name__ == "__main__":
    main()
