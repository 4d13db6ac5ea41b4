"""docs/bench/e2e.md and e2e.png from the results of ``python -m bench.e2e`` (bench/report.py
writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import cancels
from bench.report import fmt, pyplot, save

PATHS = {
    "openai": "OpenAI `POST /v1/chat/completions`",
    "session": "session API (POST + SSE)",
    "grpc": "gRPC `ModelStreamInfer` (KServe v2 / Triton)",
    "responses": "OpenAI Responses `POST /v1/responses`",
    "ws": "WebSocket `WS /v1/ws`",
}
TARGETS = "the lean token path"


def _cpu(c: dict[str, Any]) -> str:
    parts = [c["gateway"], c["worker"], c["redis"]]
    if None in parts:
        return "-"
    return f"{c['gateway']:.0f} + {c['worker']:.0f} + {c['redis']:.0f} = {c['total']:.0f} us"


def _label(point: dict[str, Any]) -> str:
    if point["tokens_per_s_per_stream"] == 0:
        return f"{point['streams']:,} unpaced"
    return f"{point['streams']:,}"


def _complete(point: dict[str, Any], mode: str) -> str:
    m = point["modes"][mode]
    mark = "" if m["tokens"] == m["tokens_expected"] else " (short)"
    return f"{m['tokens']:,}/{m['tokens_expected']:,}{mark}"


def added_table(points: list[dict[str, Any]], mode: str) -> list[str]:
    rows = [
        "| streams | added TTFT p50 | added TTFT p99 | added ITL p99 | delivered tokens/s vs "
        "the engine alone | CPU per token (gateway + worker + Redis) | engine alone CPU per "
        "token | tokens delivered (path) | load avg |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        if mode not in p.get("added", {}):
            continue
        a = p["added"][mode]
        rows.append(
            f"| {_label(p)} | {fmt(a['added_ttft_p50_ms'], 1, True)} ms "
            f"| {fmt(a['added_ttft_p99_ms'], 1, True)} ms "
            f"| {fmt(a['added_itl_p99_ms'], 1, True)} ms "
            f"| {fmt(a['tokens_per_s_ratio'], 2)} | {_cpu(a['cpu_us_per_token'])} "
            f"| {fmt(a['cpu_us_per_token']['engine_alone'], 0)} us | {_complete(p, mode)} "
            f"| {p['loadavg_before_after'][0]:.1f} -> {p['loadavg_before_after'][1]:.1f} |"
        )
    return rows


def raw_table(points: list[dict[str, Any]]) -> list[str]:
    rows = [
        "| streams | path | tokens | tokens/s | TTFT p50 / p99 ms | of which the request p50 / "
        "p99 ms | ITL p50 / p99 ms | CPU us per token: gateway / worker / Redis / engine alone "
        "/ load generator | Redis calls per token |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        for mode, m in p["modes"].items():
            c = m["cpu_us_per_token"]
            cpu = " / ".join(fmt(c[name], 0) for name in ("gateway", "worker", "redis", "engine"))
            rows.append(
                f"| {_label(p)} | {mode} | {_complete(p, mode)} | {fmt(m['tokens_per_s'], 0)} "
                f"| {fmt(m['ttft_ms']['p50'], 2)} / {fmt(m['ttft_ms']['p99'], 2)} "
                f"| {fmt(m['request_ms']['p50'], 2)} / {fmt(m['request_ms']['p99'], 2)} "
                f"| {fmt(m['itl_ms']['p50'], 2)} / {fmt(m['itl_ms']['p99'], 2)} "
                f"| {cpu} / {fmt(c['loadgen'], 0)} | {fmt(m['redis_calls_per_token'], 2)} |"
            )
    return rows


def own_ttft(points: list[dict[str, Any]], mode: str) -> list[str]:
    """The path's own part of TTFT at each point, when the worker reported its part."""
    own = [(p, p["modes"][mode].get("path_ttft_ms")) for p in points if mode in p["modes"]]
    if not any(o for _, o in own):
        return []
    return [
        "",
        "The path's own TTFT p50 (each reply's TTFT less the engine's own part, which the "
        "worker measures, so the engine's drift is not in it; a mean per run past one stream), "
        "worker part + gateway part: "
        + "; ".join(
            f"{_label(p)} streams {fmt(o['p50'])} ms ({fmt(o['worker_p50'])} + "
            f"{fmt(o['gateway_p50'])})"
            for p, o in own
            if o
        )
        + ".",
    ]


def _at(points: list[dict[str, Any]], streams: int) -> dict[str, Any] | None:
    return next((p for p in points if p["streams"] == streams), None)


def targets(points: list[dict[str, Any]], mode: str) -> list[str]:
    rows = ["| target | measured | verdict |", "| --- | --- | --- |"]

    def row(name: str, value: float | None, limit: float, unit: str, above: bool) -> None:
        if value is None:
            rows.append(f"| {name} | not measured | - |")
            return
        met = value >= limit if above else value <= limit
        rows.append(f"| {name} | {value:,.2f} {unit} | {'met' if met else 'missed'} |")

    one, five = _at(points, 1), _at(points, 500)
    a1 = one["added"].get(mode) if one and "added" in one else None
    a5 = five["added"].get(mode) if five and "added" in five else None
    row("added TTFT p50, 1 stream <= 1.5 ms", a1 and a1["added_ttft_p50_ms"], 1.5, "ms", False)
    row(
        "delivered tokens/s at 500 streams >= 0.95 of the engine alone",
        a5 and a5["tokens_per_s_ratio"],
        0.95,
        "x",
        True,
    )
    row("added TTFT p99, 500 streams <= 50 ms", a5 and a5["added_ttft_p99_ms"], 50, "ms", False)
    row("added ITL p99, 500 streams <= 5 ms", a5 and a5["added_itl_p99_ms"], 5, "ms", False)
    total = a5["cpu_us_per_token"]["total"] if a5 else None
    row("CPU per token at 500 streams (gateway + worker + Redis) <= 70 us", total, 70, "us", False)
    worker = a5["cpu_us_per_token"]["worker"] if a5 else None
    row("worker CPU per token at 500 streams <= 15 us (publishing alone)", worker, 15, "us", False)
    return rows


def _points(results: dict[str, Any]) -> list[dict[str, Any]]:
    points = list(results["points"])
    return [*points, results["saturation"]] if results.get("saturation") else points


def before_after(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Each point and gateway path in both runs: the issue's columns, before -> after."""
    rows = [
        "| streams | path | tokens/s vs alone | added TTFT p50 | added TTFT p99 | added ITL p99 "
        "| CPU us per token: gateway | worker | Redis | total |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    old = {(_label(p), mode): a for p in _points(before) for mode, a in p.get("added", {}).items()}
    for p in _points(after):
        for mode, a in p.get("added", {}).items():
            b = old.get((_label(p), mode))
            if b is None:
                continue

            def pair(key: str, digits: int, sign: bool, a: Any = a, b: Any = b) -> str:
                return f"{fmt(b[key], digits, sign)} -> {fmt(a[key], digits, sign)}"

            cb, ca = b["cpu_us_per_token"], a["cpu_us_per_token"]
            cpu = " | ".join(
                f"{fmt(cb[name], 0)} -> {fmt(ca[name], 0)}"
                for name in ("gateway", "worker", "redis", "total")
            )
            rows.append(
                f"| {_label(p)} | {mode} | {pair('tokens_per_s_ratio', 2, False)} "
                f"| {pair('added_ttft_p50_ms', 1, True)} ms | {pair('added_ttft_p99_ms', 1, True)} "
                f"ms | {pair('added_itl_p99_ms', 1, True)} ms | {cpu} us |"
            )
    return rows


def _engine(s: dict[str, Any]) -> str:
    if s.get("engine") == "vllm":
        return (
            f"Each stream: {s['tokens_per_stream']} tokens from vLLM on the CPU "
            "(SmolLM2-135M-Instruct, float32, eager, greedy) as fast as it makes them."
        )
    return (
        f"Each stream: {s['tokens_per_stream']} tokens at {s['tokens_per_s_per_stream']:g} "
        "tokens/s from the synthetic engine."
    )


def _pinned(results: dict[str, Any]) -> str:
    settings = results["settings"]
    if settings.get("engine") == "vllm":
        return "Nothing pinned (vLLM binds its engine core itself)."
    if settings.get("floating"):
        processes = settings.get("gateway_workers", 1)
        return f"Nothing pinned (`--floating`); the gateway as {processes} process(es)."
    return (
        "Gateway pinned to CPU 1, engine worker + Redis + reference engine + load generator "
        f"to CPU 0 (pinned: {results.get('pinned')})."
    )


def markdown(results: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    s = results["settings"]
    points = _points(results)
    m = results["machine"]
    run = "a reduced run" if s.get("reduced") else "a full run"
    lines = [
        "# End to end: through the gateway vs the engine alone",
        "",
        f"`python -m bench.e2e` ({run}: {', '.join(str(n) for n in s['streams'])} streams; "
        f"saturation {s['saturation'][0]} x {s['saturation'][1]} unpaced). {_engine(s)} "
        f"Streams started at {s['start_rate_streams_per_s']:g}/s; the 1-stream point is "
        f"{s['single_stream_rounds']} rounds. {_pinned(results)} {m['nproc']} CPUs "
        f"({m['cpu_model']}), load average {m['loadavg_at_start'][0]} at the start, "
        f"{m.get('loadavg_at_end', ['?'])[0]} at the end, shared with other work: wall-clock "
        "figures carry that noise, CPU per token much less. Method: docs/bench.md.",
        "",
        "Added = the path minus the engine alone (bench/reference_engine.py: the worker's own "
        "backend streamed as OpenAI SSE, no gateway, no Redis) at the same point. "
        "CPU per token is each process's CPU time (utime + stime of its tree) over the tokens "
        "the path delivered.",
    ]
    for mode, title in PATHS.items():
        if not any(mode in p.get("added", {}) for p in points):
            continue
        lines += ["", f"## {title}", "", *added_table(points, mode), *own_ttft(points, mode)]
        lines += ["", f"Targets of {TARGETS}:", "", *targets(points, mode)]
    if before is not None:
        bm = before["machine"]
        lines += [
            "",
            "## Before and after",
            "",
            f"Before: {before.get('label', 'the run before')} (load average "
            f"{bm['loadavg_at_start'][0]} at the start, {bm.get('loadavg_at_end', ['?'])[0]} "
            "at the end); after: this run. Each figure against the engine alone of its own run.",
            "",
            *before_after(before, results),
        ]
    if any("cluster" in p for p in points):
        lines += [
            "",
            f"## One Redis vs a Redis Cluster of {s['cluster_primaries']} primaries",
            "",
            "The same streams on a second gateway and worker whose Redis is a cluster (no "
            "replicas; the one Redis has none either), the two taking turns path by path. A "
            "shard's share: the events (XADD) written on it; its CPU per own token: its CPU "
            "over that share of the tokens.",
            "",
            *cluster_table(points),
        ]
    lines += ["", "## Every path, absolute figures", "", *raw_table(points)]
    if "cancels" in results:
        lines += ["", "## Cancels", "", *cancels.markdown(results["cancels"])]
    profile = results.get("profile")
    if profile:
        lines += [
            "",
            f"## Profile ({profile['streams']} streams, py-spy, busy samples)",
            "",
            f"Speedscope files in `{profile['dir']}` (`summary.txt` there has more). Per "
            "process: the functions of ours that the busy samples fall under (the innermost "
            "frame of gateway/ or engine/ code on the stack: a Redis call or a GC pass counts "
            "against the function that made it), then the top frames by self time.",
            "",
        ]
        for mode, by_process in profile["top"].items():
            for process, summary in by_process.items():
                samples = summary.get("samples", 0)
                for kind, title in (("ours", "under"), ("self", "self")):
                    shares = summary.get(kind, [])[:8]
                    top = ", ".join(f"{name} {share} %" for name, share in shares)
                    lines.append(f"- **{mode}, {process}, {title}** ({samples} samples): {top}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    points = [p for p in results["points"] if "added" in p]
    if not points:
        return
    streams = [p["streams"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ttft, ratio, cpu = axes
    for mode, style in (("openai", "o-"), ("session", "s--"), ("grpc", "^:")):
        if mode not in points[0]["added"]:
            continue
        rows = [p["added"][mode] for p in points]
        for key, label in (("added_ttft_p50_ms", "p50"), ("added_ttft_p99_ms", "p99")):
            ys = [max(0.1, r[key]) if r[key] is not None else None for r in rows]
            ttft.plot(streams, ys, style, label=f"{mode} TTFT {label}")
        ratio.plot(streams, [r["tokens_per_s_ratio"] for r in rows], style, label=mode)
    ttft.set(xscale="log", yscale="log", xlabel="streams", ylabel="added ms (floor 0.1)")
    ttft.set_title("added TTFT vs the engine alone")
    ttft.legend(fontsize=8)
    ratio.axhline(0.95, color="grey", linestyle=":", label="target 0.95")
    ratio.set(xscale="log", xlabel="streams", ylabel="tokens/s ratio", ylim=(0, 1.1))
    ratio.set_title("delivered tokens/s vs the engine alone")
    ratio.legend(fontsize=8)
    mode = "openai" if "openai" in points[0]["added"] else next(iter(points[0]["added"]))
    labels = [str(n) for n in streams]
    bottom = [0.0] * len(points)
    for name in ("gateway", "worker", "redis"):
        values: list[float] = [p["added"][mode]["cpu_us_per_token"][name] or 0 for p in points]
        cpu.bar(labels, values, bottom=bottom, label=f"{name} ({mode} path)")
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    alone = [p["added"][mode]["cpu_us_per_token"]["engine_alone"] or 0 for p in points]
    cpu.plot(labels, alone, "k^-", label="engine alone")
    cpu.axhline(70, color="grey", linestyle=":", label="target 70 us")
    cpu.set(xlabel="streams", ylabel="CPU us per delivered token", yscale="log")
    cpu.set_title("CPU per token, by process")
    cpu.legend(fontsize=8)
    save(fig, out, dpi=100)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def cluster_table(points: list[dict[str, Any]]) -> list[str]:
    """``--cluster``: each gateway path on one Redis and on the cluster, same point."""
    rows = [
        "| streams | path | tokens/s: one Redis / cluster (ratio) | Redis CPU per token: one "
        "Redis / shards summed (ratio) | per shard: share of events, CPU per own token | "
        "gateway + worker CPU per token: one Redis / cluster |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for p in points:
        for mode, b in p.get("cluster", {}).items():
            a = p["modes"][mode]
            ca, cb = a["cpu_us_per_token"], b["cpu_us_per_token"]
            shards = "; ".join(
                f"{name} {v['share']:.2f}, {fmt(v['cpu_us_per_own_token'])} us"
                for name, v in b["redis_servers"].items()
            )
            rate = fmt(_ratio(b["tokens_per_s"], a["tokens_per_s"]), 2)
            redis = fmt(_ratio(cb["redis"], ca["redis"]), 2)
            rows.append(
                f"| {_label(p)} | {mode} | {fmt(a['tokens_per_s'], 0)} / "
                f"{fmt(b['tokens_per_s'], 0)} ({rate}) | {fmt(ca['redis'])} / "
                f"{fmt(cb['redis'])} us ({redis}) | {shards} | {fmt(ca['gateway'], 0)} + "
                f"{fmt(ca['worker'], 0)} / {fmt(cb['gateway'], 0)} + {fmt(cb['worker'], 0)} us |"
            )
    return rows
