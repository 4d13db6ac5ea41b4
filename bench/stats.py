"""Every benchmark's figures: one percentile (``pct``), milliseconds, CPU per process and
per token, Redis command counts, the machine; one run's records and CPU (``Run``), a
path's figures over its rounds (``summarise``) with each Redis server's share
(``server_figures``), a gateway path against the engine alone at the same point
(``added``), the path's own part of a first token (``path_ttft``) and
bench.e2e's progress line."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.loadgen import StreamRecord
from stack import procfs

PROCESSES = ("gateway", "worker", "redis", "engine", "loadgen")


def pct(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile, the nearest sample by rank; None of no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


def steady_rate(records: list[StreamRecord]) -> float | None:
    """Tokens/s while every reader runs: from the last start to the first reader's end."""
    ended = [r.arrivals[-1] for r in records if r.arrivals]
    starts = [r.submitted_at for r in records if r.submitted_at]
    if not ended or not starts:
        return None
    low, high = max(starts), min(ended)
    if high - low < 0.5:
        return None
    count = sum(1 for r in records for t in r.arrivals if low <= t <= high)
    return round(count / (high - low), 1)


def cpu_of(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds per process tree; the load generator's own process alone (its tree is
    the whole rig), read to the nanosecond: /proc counts in 10 ms ticks, more than a tiny
    run's client spends (a test's 4-stream burst read 0.0)."""
    own = os.getpid()
    return {
        name: time.process_time() if pid == own else procfs.cpu_seconds(pid)
        for name, pid in pids.items()
    }


def per_token_us(cpu_s: float | None, tokens: int) -> float | None:
    return round(cpu_s / tokens * 1e6, 1) if cpu_s is not None and tokens else None


async def command_calls(client: aioredis.Redis) -> dict[str, int]:
    """Calls per command since the last reset (scripts' inner commands included)."""
    return {name: calls for name, (calls, _) in (await command_stats(client)).items()}


async def command_stats(client: aioredis.Redis) -> dict[str, tuple[int, int]]:
    """Calls and µs spent per command since the last reset (scripts' inner commands
    included, and also in their script's µs)."""
    stats = await client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(value["calls"]), int(value["usec"]))
        for name, value in stats.items()
        if isinstance(value, dict)
    }


WORKER_TTFT = {
    "own_s": "tokenspout_engine_own_time_to_first_token_seconds_sum",
    "worker_s": "tokenspout_engine_time_to_first_token_seconds_sum",
    "count": "tokenspout_engine_time_to_first_token_seconds_count",
}
"""The worker's running totals over first tokens: the engine's own part (preparing the
request, its first step), and all of it from the gateway's enqueue to the token's emit."""


async def metrics_of(url: str, client: httpx.AsyncClient | None = None) -> dict[str, float]:
    """A Prometheus ``/metrics`` page's samples by name (labels and all, as written)."""
    async with contextlib.AsyncExitStack() as stack:
        if client is None:
            client = await stack.enter_async_context(httpx.AsyncClient(timeout=10))
        text = (await client.get(url)).text
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and line[0] != "#")
    return {name: float(value) for name, value in samples}


async def worker_ttft(url: str) -> dict[str, float]:
    """``WORKER_TTFT`` from the worker's ``/metrics`` at ``url`` now, summed over their
    labels (model, tenant): read around a run, their growth is the run's."""
    values = await metrics_of(url)
    return {name: summed(values, metric) for name, metric in WORKER_TTFT.items()}


def summed(samples: dict[str, float], name: str) -> float:
    """A metric's value over its labels (``name{...}`` lines; a counter's ``_total``)."""
    names = (name, f"{name}_total")
    return sum(value for key, value in samples.items() if key.split("{")[0] in names)


def path_ttft(runs: list[Run]) -> dict[str, float | None] | None:
    """What the path added within each reply (run by run: a mean over its streams, the
    reply itself when it has one): its TTFT less the engine's own part, which the worker
    measures, so the engine's drift from run to run is not in it; split into the worker's
    part (the gateway's enqueue to the emit, less the engine's own) and the gateway's (the
    request to its enqueue, then the emitted token's write, relay and delivery)."""
    parts: dict[str, list[float]] = {"p50": [], "worker_p50": [], "gateway_p50": []}
    for run in runs:
        ttft = [r.arrivals[0] - r.submitted_at for r in run.records if r.arrivals]
        count = run.worker_ttft.get("count", 0)
        if not ttft or not count:
            continue
        mean, own = statistics.fmean(ttft), run.worker_ttft["own_s"] / count
        parts["p50"].append(mean - own)
        parts["worker_p50"].append(run.worker_ttft["worker_s"] / count - own)
        parts["gateway_p50"].append(mean - run.worker_ttft["worker_s"] / count)
    if not parts["p50"]:
        return None
    return {name: ms(statistics.median(values)) for name, values in parts.items()}


def machine() -> dict[str, object]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kib = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem_kib = int(line.split()[1])
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "memory_gib": round(mem_kib / 1024 / 1024, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


@dataclass
class Run:
    """One mode at one point: every stream's record, and what the processes spent."""

    records: list[StreamRecord]
    cpu_s: dict[str, float]
    wall_s: float
    redis_calls: dict[str, dict[str, int]]
    """Per Redis server, calls per command (``command_calls``)."""
    timed_out: bool
    failures: list[str]
    span_s: float
    worker_ttft: dict[str, float]
    """The growth of ``WORKER_TTFT`` over the run (empty: the engine alone's)."""
    redis_usec: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per Redis server, µs spent per command (``command_stats``; empty: not read)."""


def summarise(
    mode: str, runs: list[Run], max_tokens: int, processes: tuple[str, ...] = PROCESSES
) -> dict[str, Any]:
    """One mode's figures over its rounds (rounds pool their streams); the CPU of
    ``processes``, the names the runs' ``cpu_s`` holds."""
    records = [r for run in runs for r in run.records]
    tokens = sum(len(r.arrivals) for r in records)
    ttft = [r.arrivals[0] - r.submitted_at for r in records if r.arrivals]
    # The request's own part of TTFT: to the 202 of the message (session API), to the
    # response headers (chat completions: sent once the request is queued for a worker).
    submitted = [
        (r.accepted_at or r.headers_at) - r.submitted_at
        for r in records
        if r.accepted_at or r.headers_at
    ]
    gaps = [b - a for r in records for a, b in zip(r.arrivals, r.arrivals[1:], strict=False)]
    span = sum(run.span_s for run in runs)
    cpu = {name: sum(run.cpu_s[name] for run in runs) for name in processes}
    calls = sum(sum(c.values()) for run in runs for c in run.redis_calls.values())
    complete = sum(1 for r in records if r.final == "done" and len(r.arrivals) == max_tokens)
    wall = sum(run.wall_s for run in runs)
    return {
        "mode": mode,
        "rounds": len(runs),
        "streams": len(records) // max(1, len(runs)),
        "max_tokens": max_tokens,
        "tokens": tokens,
        "tokens_expected": max_tokens * len(records),
        "complete_streams": complete,
        "timed_out": any(run.timed_out for run in runs),
        "failures": sorted({f for run in runs for f in run.failures})[:5],
        "wall_s": round(wall, 2),
        "tokens_per_s": round(tokens / span, 1) if span else None,
        "ttft_ms": {"p50": ms(pct(ttft, 50)), "p99": ms(pct(ttft, 99))},
        "request_ms": {"p50": ms(pct(submitted, 50)), "p99": ms(pct(submitted, 99))},
        "itl_ms": {
            "p50": ms(pct(gaps, 50)),
            "p99": ms(pct(gaps, 99)),
            "mean": ms(statistics.fmean(gaps) if gaps else None),
        },
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "cpu_us_per_token": {name: per_token_us(value, tokens) for name, value in cpu.items()},
        "cpu_utilisation": {
            name: round(value / wall, 3) if wall else None for name, value in cpu.items()
        },
        "redis_calls_per_token": round(calls / tokens, 2) if tokens else None,
        "redis_usec_per_stream": usec_by_command(runs, len(records)),
        "redis_servers": server_figures(runs, tokens, wall),
        "path_ttft_ms": path_ttft(runs),
    }


def usec_by_command(runs: list[Run], streams: int, most: int = 12) -> dict[str, float]:
    """The ``most`` costliest Redis commands, in µs per stream over every server (a
    script's own time is its ``fcall``, or ``evalsha``, less its inner commands')."""
    spent: dict[str, int] = {}
    for run in runs:
        for per_server in run.redis_usec.values():
            for name, usec in per_server.items():
                spent[name] = spent.get(name, 0) + usec
    top = sorted(spent.items(), key=lambda item: -item[1])[:most]
    return {name: round(usec / max(1, streams), 1) for name, usec in top}


def server_figures(runs: list[Run], tokens: int, wall_s: float) -> dict[str, dict[str, Any]]:
    """Per Redis server (a cluster's shards): its CPU, the events written on it (XADD calls,
    the scripts' included), its share of them, and its CPU per token over every token and
    over its own share of them."""
    names = list(runs[0].redis_calls)
    events = {n: sum(run.redis_calls[n].get("xadd", 0) for run in runs) for n in names}
    figures = {}
    for name in names:
        cpu = sum(run.cpu_s[name] for run in runs)
        share = events[name] / (sum(events.values()) or 1)
        figures[name] = {
            "cpu_s": round(cpu, 3),
            "events": events[name],
            "share": round(share, 3),
            "cpu_utilisation": round(cpu / wall_s, 3) if wall_s else None,
            "cpu_us_per_token": per_token_us(cpu, tokens),
            "cpu_us_per_own_token": per_token_us(cpu, round(tokens * share)),
        }
    return figures


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def added(path: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """A gateway path against the engine alone at the same point (the issue's columns)."""
    per_token = path["cpu_us_per_token"]
    path_cpu = [per_token[name] for name in ("gateway", "worker", "redis")]
    ratio = None
    if path["tokens_per_s"] and alone["tokens_per_s"]:
        ratio = round(path["tokens_per_s"] / alone["tokens_per_s"], 3)
    return {
        "added_ttft_p50_ms": _diff(path["ttft_ms"]["p50"], alone["ttft_ms"]["p50"]),
        "added_ttft_p99_ms": _diff(path["ttft_ms"]["p99"], alone["ttft_ms"]["p99"]),
        "added_itl_p99_ms": _diff(path["itl_ms"]["p99"], alone["itl_ms"]["p99"]),
        "tokens_per_s_ratio": ratio,
        "cpu_us_per_token": {
            "gateway": per_token["gateway"],
            "worker": per_token["worker"],
            "redis": per_token["redis"],
            "total": round(sum(path_cpu), 1) if None not in path_cpu else None,
            "engine_alone": alone["cpu_us_per_token"]["engine"],
        },
    }


def describe(point: dict[str, Any]) -> str:
    parts = [f"{point['streams']} x {point['tokens_per_s_per_stream']:g} tok/s:"]
    paths = [(mode, m) for mode, m in point["modes"].items()]
    paths += [(f"cluster {mode}", m) for mode, m in point.get("cluster", {}).items()]
    for mode, m in paths:
        cpu = m["cpu_us_per_token"]
        own = (
            cpu["engine"]
            if mode == "engine"
            else f"{cpu['gateway']}+{cpu['worker']}+{cpu['redis']}"
        )
        parts.append(
            f"{mode} {m['tokens']}/{m['tokens_expected']} tok, {m['tokens_per_s']} tok/s, "
            f"ttft {m['ttft_ms']['p50']}/{m['ttft_ms']['p99']} ms, itl p99 {m['itl_ms']['p99']} "
            f"ms, cpu {own} us/tok;"
        )
    return " ".join(parts)
