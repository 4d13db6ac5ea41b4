"""The one report writer of the benchmarks: a figure as table text (``fmt``), the results as
NAME.json and NAME.md and their plots (``write``, ``pyplot``, ``save``); then the suite's own
report (``python -m bench``: tables, the targets of issue 8) and plots."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Point = dict[str, Any]


def _find(points: list[Point], mode: str, streams: int, rate: float) -> Point | None:
    for point in points:
        if (point["mode"], point["streams"], point["tokens_per_s_per_stream"]) == (
            mode,
            streams,
            rate,
        ):
            return point
    return None


def _sub(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def added(points: list[Point], point: Point) -> dict[str, float | None]:
    """Gateway (or reference) latency minus the no-gateway baseline of the same point."""
    base = _find(points, "direct", point["streams"], point["tokens_per_s_per_stream"])
    if base is None:
        return {"ttft_p50": None, "ttft_p99": None, "itl_p50": None, "itl_p99": None}
    return {
        f"{kind}_{q}": _sub(point[f"{kind}_ms"][q], base[f"{kind}_ms"][q])
        for kind in ("ttft", "itl")
        for q in ("p50", "p99")
    }


def upstream_kept_up(points: list[Point], point: Point) -> bool:
    """Whether the no-gateway baseline of the point got every token it asked for in time."""
    base = _find(points, "direct", point["streams"], point["tokens_per_s_per_stream"])
    return base is not None and base["tokens"] >= base["tokens_expected"]


def fmt(value: object, digits: int = 1, sign: bool = False) -> str:
    """A figure in a table: "-" for none, thousands separated, ``sign``: always signed."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:+,}" if sign else f"{value:,}"
    return str(value)


def write(
    out: Path,
    name: str,
    results: dict[str, Any],
    markdown: str,
    plot: Callable[[Path], None] | None = None,
) -> None:
    """NAME.json (every figure), NAME.md (the report) and the plots, into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    if plot is not None:
        plot(out)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display), imported only when plotting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Figure, path: Path, dpi: int = 110) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def marginal_kib(hold: list[dict[str, Any]]) -> float | None:
    """Gateway RSS growth per open stream between the first and the last hold step."""
    if len(hold) < 2:
        return hold[0]["kib_per_stream"] if hold else None
    first, last = hold[0], hold[-1]
    streams = last["open_streams"] - first["open_streams"]
    return round((last["rss_mib"] - first["rss_mib"]) * 1024 / streams, 1) if streams else None


def targets(results: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(figure, target, measured, verdict) for each target of issue 8."""
    points: list[Point] = results["points"]
    rows: list[tuple[str, str, str, str]] = []
    gateway = [p for p in points if p["mode"] == "gateway"]

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "missed")

    single: dict[str, dict[str, dict[str, Any]]] = results.get("single_stream_ttft", {})
    ones = [
        _sub(by_mode["gateway"]["p50"], by_mode["direct"]["p50"])
        for by_mode in single.values()
        if "gateway" in by_mode and "direct" in by_mode
    ]
    source = "one stream at a time, repeated; worst of the rates"
    if not ones:
        ones = [added(points, p)["ttft_p50"] for p in gateway if p["streams"] == 1]
        source = "worst of the rates"
    ones = [x for x in ones if x is not None]
    worst = max(ones) if ones else None
    rows.append(
        (
            "added TTFT p50, 1 stream",
            "<= 1 ms",
            f"{fmt(worst, 2)} ms ({source})",
            verdict(worst <= 1 if worst is not None else None),
        )
    )
    # Added latency says what the gateway adds only where the upstream kept its schedule:
    # where the engine alone (direct) fell short of it, the point measures the machine.
    kept = [p for p in gateway if upstream_kept_up(points, p)]
    dropped = [p for p in gateway if p not in kept]
    note = (
        "; not counted, the engine alone fell behind its schedule: "
        + ", ".join(f"{fmt(p['streams'])} x {p['tokens_per_s_per_stream']:g}" for p in dropped)
        if dropped
        else ""
    )
    big = [p for p in kept if p["streams"] >= 500]
    if big:
        least = min(p["streams"] for p in big)
        at = [(p, added(points, p)["ttft_p99"]) for p in big if p["streams"] == least]
        values = [v for _, v in at if v is not None]
        value = max(values) if values else None
        rates = ", ".join(f"{p['tokens_per_s_per_stream']:g} tok/s" for p, _ in at)
        rows.append(
            (
                "added TTFT p99, 500 streams",
                "<= 5 ms",
                f"{fmt(value, 2)} ms at {least} streams x {rates}{note}",
                verdict(value <= 5 if value is not None else None),
            )
        )
    itl = [(added(points, p)["itl_p99"], p) for p in kept]
    itl = [(v, p) for v, p in itl if v is not None]
    if itl:
        value, where = max(itl, key=lambda pair: pair[0])
        place = f"{fmt(where['streams'])} x {where['tokens_per_s_per_stream']:g} tok/s"
    else:
        value, place = None, "-"
    rows.append(
        (
            "added inter-token latency p99",
            "<= 1 ms",
            f"{fmt(value, 2)} ms (worst point, {place}){note}",
            verdict(value <= 1 if value is not None else None),
        )
    )
    saturation: list[Point] = results.get("saturation", [])
    sat = {p["mode"]: p for p in saturation}
    if "gateway" in sat:
        g = sat["gateway"]
        per_core = 1e6 / g["relay_cpu_us_per_token"] if g["relay_cpu_us_per_token"] else None
        rows.append(
            (
                "relayed tokens/s per gateway process",
                ">= 40,000",
                f"{fmt(g['tokens_per_s'], 0)} measured (gateway at "
                f"{fmt(g['relay_cpu_utilisation'], 2)} of a core); "
                f"{fmt(per_core, 0)} per fully used core if CPU per token held (1 s / CPU "
                "per token: a projection, not a measurement)",
                verdict((g["tokens_per_s"] or 0) >= 40_000),
            )
        )
        refs = [sat[m] for m in ("reference", "reference-spin") if m in sat]
        if refs:
            best = max(refs, key=lambda p: p["tokens_per_s"] or 0)
            ratio = (
                (g["tokens_per_s"] or 0) / best["tokens_per_s"] if best["tokens_per_s"] else None
            )
            cpu_ratio = (
                best["relay_cpu_us_per_token"] / g["relay_cpu_us_per_token"]
                if best["relay_cpu_us_per_token"] and g["relay_cpu_us_per_token"]
                else None
            )
            rows.append(
                (
                    "gateway vs reference relay",
                    ">= 1.5x",
                    f"{fmt(ratio, 1)}x tokens/s, {fmt(cpu_ratio, 1)}x less CPU per token "
                    f"(vs {best['mode']})",
                    verdict(ratio >= 1.5 if ratio else None),
                )
            )
        rows.append(
            (
                "gateway CPU per relayed token (saturation)",
                "<= 20 us",
                f"{fmt(g['relay_cpu_us_per_token'], 1)} us",
                verdict(g["relay_cpu_us_per_token"] <= 20 if g["relay_cpu_us_per_token"] else None),
            )
        )
    busiest = max(gateway, key=lambda p: p["tokens"], default=None)
    if busiest is not None:
        rows.append(
            (
                "gateway CPU per relayed token (one reader per session)",
                "<= 20 us",
                f"{fmt(busiest['relay_cpu_us_per_token'], 1)} us at {busiest['streams']} "
                f"streams x {fmt(busiest['tokens_per_s_per_stream'], 0)} tokens/s",
                verdict(
                    busiest["relay_cpu_us_per_token"] <= 20
                    if busiest["relay_cpu_us_per_token"]
                    else None
                ),
            )
        )
    hold: list[dict[str, Any]] = results.get("hold", [])
    if hold:
        last = hold[-1]
        rows.append(
            (
                "open streams per process",
                ">= 10,000",
                f"{fmt(last['alive'])} held open (probe TTFT p99 "
                f"{fmt(last['probe']['ttft_ms']['p99'])} ms)",
                verdict(last["alive"] >= 10_000),
            )
        )
        kib = marginal_kib(hold)
        rows.append(
            (
                "gateway memory per open stream",
                "<= 20 KiB",
                f"{fmt(kib, 1)} KiB (RSS growth from {fmt(hold[0]['open_streams'])} to "
                f"{fmt(last['open_streams'])} open streams; "
                f"{fmt(last['kib_per_stream'], 1)} KiB counting from before the first)",
                verdict(kib <= 20 if kib is not None else None),
            )
        )
        connections = sorted({h["gateway_redis_connections"] for h in hold})
        rows.append(
            (
                "Redis connections per gateway process",
                "constant",
                f"{connections} at {[h['open_streams'] for h in hold]} open streams "
                "(pool of 64 + 1 pub/sub)",
                verdict(max(connections) <= 65),
            )
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    machine = results["machine"]
    settings = results["settings"]
    out = [
        "# tokenspout benchmark results",
        "",
        f"Machine: {machine['nproc']} CPUs ({machine['cpu_model']}), "
        f"{machine['memory_gib']} GiB RAM, Linux {machine['kernel']}, Python "
        f"{machine['python']}; load average at start {machine['loadavg_at_start']} "
        "(the machine is shared: each point records the load average before and after it). "
        f"Gateway and reference relay pinned to CPU 1, load generator to CPU 0: "
        f"{'yes' if results.get('pinned') else 'no'}. Gateway server: "
        f"{settings['gateway_server']}. Suite time {results.get('suite_s')} s.",
        "",
        f"Each stream: {settings['seconds_per_stream']} s of tokens at the given rate from "
        "the synthetic engine; all modes of a row see the same token schedule. `direct` reads "
        "the engine's tokens straight from Redis (no gateway); `reference` is "
        "bench/reference_relay.py (FastAPI, thread + queue.Queue per request); `gateway` is "
        "tokenspout over SSE, `ws` tokenspout over its WebSocket (one socket per stream). "
        "Added latency = that mode minus direct for the same row. Targets are read from the "
        "SSE (`gateway`) rows.",
        "",
        "## Targets (issue 8)",
        "",
        "| figure | target | measured | verdict |",
        "| --- | --- | --- | --- |",
    ]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in targets(results)]
    single: dict[str, dict[str, dict[str, Any]]] = results.get("single_stream_ttft", {})
    if single:
        out += [
            "",
            "## Time to first token, one stream at a time",
            "",
            "| tok/s | mode | rounds | TTFT p50 ms | p90 ms | min ms | added p50 ms |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for rate, by_mode in single.items():
            for mode, row in by_mode.items():
                base = by_mode.get("direct", {}).get("p50")
                extra = _sub(row["p50"], base) if mode != "direct" else None
                out.append(
                    f"| {rate} | {mode} | {row['rounds']} | {fmt(row['p50'], 2)} | "
                    f"{fmt(row['p90'], 2)} | {fmt(row['min'], 2)} | {fmt(extra, 2)} |"
                )
    out += [
        "",
        "## Sweep",
        "",
        "| tok/s/stream | streams | mode | tokens | tok/s | TTFT p50 / p99 ms | "
        "ITL p50 / p99 ms | added TTFT p50 / p99 | added ITL p99 | relay CPU us/token | "
        "relay CPU use | relay RSS MiB | Redis calls/token | load avg |",
        "| " + " | ".join(["---"] * 14) + " |",
    ]
    points: list[Point] = results["points"]
    for p in points:
        add = added(points, p) if p["mode"] != "direct" else {}
        out.append(
            f"| {fmt(p['tokens_per_s_per_stream'], 0)} | {p['streams']:,} | {p['mode']} | "
            f"{p['tokens']:,}/{p['tokens_expected']:,} | {fmt(p['tokens_per_s'], 0)} | "
            f"{fmt(p['ttft_ms']['p50'])} / {fmt(p['ttft_ms']['p99'])} | "
            f"{fmt(p['itl_ms']['p50'])} / {fmt(p['itl_ms']['p99'])} | "
            f"{fmt(add.get('ttft_p50'))} / {fmt(add.get('ttft_p99'))} | "
            f"{fmt(add.get('itl_p99'))} | {fmt(p['relay_cpu_us_per_token'])} | "
            f"{fmt(p['relay_cpu_utilisation'], 2)} | {fmt(p['relay_rss_mib_peak'])} | "
            f"{fmt(p['redis_calls_per_token'], 2)} | {p['loadavg_before_after']} |"
        )
    saturation: list[Point] = results.get("saturation", [])
    if saturation:
        out += [
            "",
            "## Saturation (fan-out: every session read by several clients)",
            "",
            "| mode | sessions x readers | tokens | tok/s | TTFT p99 ms | ITL p99 ms | "
            "relay CPU us/token | relay CPU use | load generator CPU use | load avg |",
            "| " + " | ".join(["---"] * 10) + " |",
        ]
        for p in saturation:
            out.append(
                f"| {p['mode']} | {p['streams']} x {p['readers_per_stream']} | "
                f"{p['tokens']:,}/{p['tokens_expected']:,} | {fmt(p['tokens_per_s'], 0)} | "
                f"{fmt(p['ttft_ms']['p99'])} | {fmt(p['itl_ms']['p99'])} | "
                f"{fmt(p['relay_cpu_us_per_token'])} | {fmt(p['relay_cpu_utilisation'], 2)} | "
                f"{fmt(p['loadgen_cpu_utilisation'], 2)} | {p['loadavg_before_after']} |"
            )
    hold: list[dict[str, Any]] = results.get("hold", [])
    if hold:
        out += [
            "",
            "## Open streams held by one gateway process",
            "",
            "| open streams | alive | RSS MiB | KiB/stream | Redis connections | "
            "probe TTFT p50 / p99 ms | probe ITL p99 ms |",
            "| " + " | ".join(["---"] * 7) + " |",
        ]
        for h in hold:
            probe = h["probe"]
            out.append(
                f"| {h['open_streams']:,} | {h['alive']:,} | {h['rss_mib']} | "
                f"{fmt(h['kib_per_stream'])} | {h['gateway_redis_connections']} | "
                f"{fmt(probe['ttft_ms']['p50'])} / {fmt(probe['ttft_ms']['p99'])} | "
                f"{fmt(probe['itl_ms']['p99'])} |"
            )
    out += ["", "Plots: latency.png, throughput.png, memory.png (same folder).", ""]
    return "\n".join(out)


def plots(results: dict[str, Any], out: Path) -> None:
    plt = pyplot()
    points: list[Point] = results["points"]
    rates = sorted({p["tokens_per_s_per_stream"] for p in points})
    order = ("direct", "reference", "gateway", "ws")
    modes = [m for m in order if any(p["mode"] == m for p in points)]
    colours = {
        "direct": "tab:gray",
        "reference": "tab:orange",
        "gateway": "tab:blue",
        "ws": "tab:green",
    }

    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.5), squeeze=False)
    for ax, rate in zip(axes[0], rates, strict=True):
        for mode in modes:
            series = sorted(
                (p for p in points if p["mode"] == mode and p["tokens_per_s_per_stream"] == rate),
                key=lambda p: p["streams"],
            )
            xs = [p["streams"] for p in series]
            for key, q, style in (("ttft_ms", "p50", "-o"), ("ttft_ms", "p99", "--o")):
                ax.plot(xs, [p[key][q] for p in series], style, color=colours[mode],
                        label=f"{mode} TTFT {q}")  # fmt: skip
            ax.plot(xs, [p["itl_ms"]["p99"] for p in series], ":s", color=colours[mode],
                    label=f"{mode} ITL p99")  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("ms")
        ax.set_title(f"latency, {rate:.0f} tokens/s per stream")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    save(fig, out / "latency.png")

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode in modes:
        for rate, style in zip(rates, ("-o", "--s"), strict=False):
            series = sorted(
                (p for p in points if p["mode"] == mode and p["tokens_per_s_per_stream"] == rate),
                key=lambda p: p["streams"],
            )
            xs = [p["streams"] for p in series]
            left.plot(xs, [p["tokens_per_s"] or float("nan") for p in series], style,
                      color=colours[mode], label=f"{mode}, {rate:.0f} tok/s/stream")  # fmt: skip
            if mode != "direct":
                cpu = [p["relay_cpu_us_per_token"] or float("nan") for p in series]
                right.plot(xs, cpu, style, color=colours[mode],
                           label=f"{mode}, {rate:.0f} tok/s/stream")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("concurrent streams")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("delivered tokens/s (all streams)")
    left.set_title("throughput vs concurrency")
    right.set_ylabel("relay process CPU us per token")
    right.set_title("CPU per relayed token")
    save(fig, out / "throughput.png")

    hold: list[dict[str, Any]] = results.get("hold", [])
    if hold:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        xs = [h["open_streams"] for h in hold]
        ax.plot(xs, [h["rss_mib"] for h in hold], "-o", color="tab:blue")
        for before, after in itertools.pairwise(hold):
            kib = marginal_kib([before, after])
            middle = ((before["open_streams"] + after["open_streams"]) / 2,
                      (before["rss_mib"] + after["rss_mib"]) / 2)  # fmt: skip
            ax.annotate(f"+{kib:.1f} KiB/stream", middle, textcoords="offset points",
                        xytext=(-70, 10), fontsize=8)  # fmt: skip
        ax.set_xlabel("open SSE streams")
        ax.set_ylabel("gateway RSS (MiB)")
        ax.set_title("gateway memory vs open streams")
        ax.grid(True, alpha=0.3)
        save(fig, out / "memory.png")
