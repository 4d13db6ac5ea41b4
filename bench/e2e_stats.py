"""bench.e2e's figures: one run's records and CPU (``Run``), a mode's percentiles and CPU
per token over its rounds (``summarise``), a gateway path against the engine alone at the
same point (``added``, the columns of issue 12's table), and the one-line progress report."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from bench.loadgen import StreamRecord
from bench.runner import pct

PROCESSES = ("gateway", "worker", "redis", "engine", "loadgen")


@dataclass
class Run:
    """One mode at one point: every stream's record, and what the processes spent."""

    records: list[StreamRecord]
    cpu_s: dict[str, float]
    wall_s: float
    redis_calls: int
    timed_out: bool
    failures: list[str]
    span_s: float


def summarise(mode: str, runs: list[Run], max_tokens: int) -> dict[str, Any]:
    """One mode's figures over its rounds (rounds pool their streams)."""
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
    cpu = {name: sum(run.cpu_s[name] for run in runs) for name in PROCESSES}
    calls = sum(run.redis_calls for run in runs)
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
        "ttft_ms": {"p50": _ms(pct(ttft, 50)), "p99": _ms(pct(ttft, 99))},
        "request_ms": {"p50": _ms(pct(submitted, 50)), "p99": _ms(pct(submitted, 99))},
        "itl_ms": {
            "p50": _ms(pct(gaps, 50)),
            "p99": _ms(pct(gaps, 99)),
            "mean": _ms(statistics.fmean(gaps) if gaps else None),
        },
        "cpu_s": {name: round(value, 3) for name, value in cpu.items()},
        "cpu_us_per_token": {
            name: round(value / tokens * 1e6, 1) if tokens else None for name, value in cpu.items()
        },
        "cpu_utilisation": {
            name: round(value / wall, 3) if wall else None for name, value in cpu.items()
        },
        "redis_calls_per_token": round(calls / tokens, 2) if tokens else None,
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000, 3)


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
    for mode, m in point["modes"].items():
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
