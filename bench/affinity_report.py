"""bench.affinity's report (docs/bench/affinity.md) and plot (affinity.png), made from every
point its results file holds."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import groupby
from pathlib import Path
from typing import Any

from bench import report
from bench.report import fmt

WORKLOAD_NAMES = {
    "a": "a: multi-turn chats",
    "b": "b: a shared system prompt",
    "c": "c: nothing shared",
}


def series(
    points: list[dict[str, Any]],
) -> Iterator[tuple[tuple[str, int, str], list[dict[str, Any]]]]:
    """The points by (workload, W, side), each series by rate."""
    ordered = sorted(points, key=lambda p: (p["workload"], p["workers"], p["side"], p["rate"]))
    for key, group in groupby(ordered, key=lambda p: (p["workload"], p["workers"], p["side"])):
        yield key, list(group)


KNEE = 2.0
"""A side saturates where its TTFT p50 passes this many times its lowest load's (and half a
second): requests wait in a queue as long as they are served."""


def saturation(points: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last point of a series (by load) before its knee; None if it never got there."""
    limit = max(500.0, KNEE * points[0]["ttft_p50_ms"])
    for before, point in zip([None, *points], points, strict=False):
        if point["failed"] or point["ttft_p50_ms"] > limit:
            return before or point
    return None


def hit_range(point: dict[str, Any]) -> str:
    shares = [w["cache_hit_share"] for w in point["per_worker"] if w["cache_hit_share"] is not None]
    return f"{min(shares):.2f}-{max(shares):.2f}" if shares else "-"


def settings_line(results: dict[str, Any]) -> str:
    s, m = results["settings"], results["machine"]
    return (
        f"Synthetic workers, each: {s['capacity']} slots, {fmt(s['tokens_per_s'], 0)} tokens/s a "
        f"reply, prefill {fmt(s['prefill_tokens_per_s'], 0)} tokens/s (one prompt at a time), "
        f"a KV cache of {fmt(s['kv_cache_tokens'])} tokens in blocks of 16; replies of "
        f"{s['reply_tokens']} tokens, think time {s['think_s']:g} s on average; each point "
        f"{s['seconds']:g} s after {s['warmup_s']:g} s of warm-up. The last run: "
        f"{m['nproc']} CPUs ({m['cpu_model']}), load {m['loadavg_at_start']} at its start; each "
        "point's own load average is in the JSON. Everything shares this machine's 2 cores: "
        "compare within a table, not with a GPU."
    )


def markdown(results: dict[str, Any]) -> str:
    lines = [
        "# Where a prompt's prefill goes (python -m bench.affinity)",
        "",
        settings_line(results),
        "",
        "Sides: " + "; ".join(f"**{name}**: {what}" for name, what in results["sides"].items()),
        "",
        "Prefilled: prompt tokens the engines computed (their prompt tokens less those their "
        "prefix cache held, in their own count). Cache hit share: of the prompt tokens, those "
        "the cache held; per worker, the lowest and highest.",
        "",
        "## The load each side kept up with",
        "",
        "The highest load at which the side still served every request with a TTFT p50 at most "
        "twice its lowest load's (or half a second): past it, requests wait in a queue longer "
        "than they are served. (For the chats, the turns asked a second are the rate at which "
        "users would send them: a side that serves slowly gets fewer, done/s below.)",
        "",
        "| workload | W | side | saturation (requests/s) | TTFT p50 / p99 there | prefilled per "
        "request | cache hit share |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (workload, workers, side), points in series(results["points"]):
        top = saturation(points)
        if top is None:
            reached = f"above {fmt(points[-1]['rate'], 2)}"
            top = points[-1]
        else:
            reached = fmt(top["rate"], 2)
        lines.append(
            f"| {WORKLOAD_NAMES[workload]} | {workers} | {side} | {reached} | "
            f"{fmt(top['ttft_p50_ms'], 0)} / {fmt(top['ttft_p99_ms'], 0)} ms | "
            f"{fmt(top['prefilled_per_turn'])} | {fmt(top['cache_hit_share'], 3)} |"
        )
    lines += against_pull(results["points"])
    lines += [
        "",
        "## Every point",
        "",
        "| workload | W | side | requests/s asked | done/s | TTFT p50 | TTFT p99 | tokens/s "
        "| prefilled tokens/s | prefilled per request | cache hit share (per worker) | failed "
        "| affinity hits / misses | mean time queued, hit / miss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for (workload, workers, side), points in series(results["points"]):
        for p in points:
            lines.append(
                f"| {workload} | {workers} | {side} | {fmt(p['rate'], 2)} | "
                f"{fmt(p['done_per_s'], 2)} | {fmt(p['ttft_p50_ms'], 0)} ms | "
                f"{fmt(p['ttft_p99_ms'], 0)} ms | {fmt(p['tokens_per_s'], 0)} | "
                f"{fmt(p['prefilled_per_s'])} | {fmt(p['prefilled_per_turn'])} | "
                f"{fmt(p['cache_hit_share'], 3)} ({hit_range(p)}) | {p['failed']} | "
                f"{p.get('affinity_hits', '-')} / {p.get('affinity_misses', '-')} | "
                f"{waits(p)} |"
            )
    return "\n".join(lines) + "\n"


def waits(point: dict[str, Any]) -> str:
    """The mean time queued of the hits and of the misses (points before it was measured:
    -)."""
    wait = point.get("affinity_wait_ms") or {}
    return " / ".join(
        f"{fmt(wait[o], 0)} ms" if wait.get(o) is not None else "-" for o in ("hit", "miss")
    )


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value and base else "-"


def against_pull(points: list[dict[str, Any]]) -> list[str]:
    """Each other side against today's pull at the same load (the same requests, in turns):
    how many times faster its TTFT, and its prefill and tokens a second as shares of pull's."""
    pulled = {(p["workload"], p["workers"], p["rate"]): p for p in points if p["side"] == "pull"}
    rows = []
    for (workload, workers, side), group in series(points):
        for point in group if side != "pull" else []:
            pull = pulled.get((workload, workers, point["rate"]))
            if pull is None:
                continue
            rows.append(
                f"| {workload} | {workers} | {side} | {fmt(point['rate'], 2)} | "
                f"{ratio(pull['ttft_p50_ms'], point['ttft_p50_ms'])} | "
                f"{ratio(pull['ttft_p99_ms'], point['ttft_p99_ms'])} | "
                f"{ratio(point['prefilled_per_turn'], pull['prefilled_per_turn'])} | "
                f"{ratio(point['tokens_per_s'], pull['tokens_per_s'])} |"
            )
    if not rows:
        return []
    return [
        "",
        "## Against pull (no affinity), at the same load",
        "",
        "TTFT: pull's over the side's (2.00: twice as fast); prefilled per request and tokens/s: "
        "the side's over pull's.",
        "",
        "| workload | W | side | requests/s | TTFT p50 x | TTFT p99 x | prefilled per request "
        "| tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
    ]


def plot(results: dict[str, Any], path: Path) -> None:
    """TTFT p99 and the prefill per request against the load, a column per workload."""
    plt = report.pyplot()
    workloads = sorted({p["workload"] for p in results["points"]})
    fig, axes = plt.subplots(2, len(workloads), figsize=(4.5 * len(workloads), 7), squeeze=False)
    for column, workload in enumerate(workloads):
        ttft, prefill = axes[0][column], axes[1][column]
        for (of, workers, side), points in series(results["points"]):
            if of != workload:
                continue
            label = f"{side}, W={workers}"
            loads = [p["rate"] for p in points]
            ttft.plot(loads, [p["ttft_p99_ms"] for p in points], "o-", label=label)
            prefill.plot(loads, [p["prefilled_per_turn"] or 0 for p in points], "o-", label=label)
        ttft.set_title(WORKLOAD_NAMES[workload])
        ttft.set_yscale("log")
        ttft.set_ylabel("TTFT p99 (ms)")
        prefill.set_ylabel("prompt tokens prefilled per request")
        prefill.set_xlabel("requests/s asked")
        ttft.legend(fontsize=8)
    report.save(fig, path)
