"""The one report writer of the benchmarks: a figure as table text (``fmt``), the results as
NAME.json and NAME.md and their plots (``write``, ``pyplot``, ``save``); then the report of
``python -m bench`` (open streams and fan-out saturation against its targets) and its
memory plot."""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import stuck

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def fmt(value: object, digits: int = 1, sign: bool = False) -> str:
    """A figure in a table: "-" for none, thousands separated, ``sign``: always signed."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:+,.{digits}f}" if sign else f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:+,}" if sign else f"{value:,}"
    return str(value)


def run(
    args: argparse.Namespace,
    measure: Callable[[argparse.Namespace], Coroutine[Any, Any, dict[str, Any]]],
    markdown: Callable[[dict[str, Any]], str],
    say: Callable[[str], None],
) -> None:
    """A benchmark's run from its arguments: its processes' logs in ``args.logs`` (a fresh
    folder unless given), its results measured, written (NAME.json, NAME.md) and shown."""
    args.logs = args.logs or Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    say(f"process logs in {args.logs}")
    results = stuck.run(measure(args))
    write(args.out, args.name, results, markdown(results))
    print(markdown(results))


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
    """(figure, target, measured, verdict) for the targets this suite measures."""
    rows: list[tuple[str, str, str, str]] = []

    def verdict(ok: bool | None) -> str:
        return "n/a" if ok is None else ("met" if ok else "missed")

    sat = results.get("saturation")
    if sat:
        rate, cpu = sat["steady_tokens_per_s"], sat["cpu_us_per_token"]["gateway"]
        use = sat["cpu_utilisation"]["gateway"]
        measured = f"{fmt(rate, 0)} (the gateway at {fmt(use, 2)} of a core)"
        rows.append(("relayed tokens/s per gateway process", ">= 40,000", measured,
                     verdict(rate >= 40_000 if rate else None)))  # fmt: skip
        rows.append(("gateway CPU per relayed token (fan-out)", "<= 20 us", f"{fmt(cpu)} us",
                     verdict(cpu <= 20 if cpu else None)))  # fmt: skip
    hold: list[dict[str, Any]] = results.get("hold", [])
    if hold:
        last, kib = hold[-1], marginal_kib(hold)
        probe = f"probe TTFT p99 {fmt(last['probe']['ttft_ms']['p99'])} ms"
        rows.append(("open streams per process", ">= 10,000",
                     f"{fmt(last['alive'])} held open ({probe})",
                     verdict(last["alive"] >= 10_000)))  # fmt: skip
        growth = f"RSS growth from {fmt(hold[0]['open_streams'])} to {fmt(last['open_streams'])}"
        rows.append(("gateway memory per open stream", "<= 20 KiB",
                     f"{fmt(kib)} KiB ({growth} open streams)",
                     verdict(kib <= 20 if kib is not None else None)))  # fmt: skip
        connections = sorted({h["gateway_redis_connections"] for h in hold})
        at = [h["open_streams"] for h in hold]
        rows.append(("Redis connections per gateway process", "constant",
                     f"{connections} at {at} open streams (pool of 64 + 1 pub/sub)",
                     verdict(max(connections) <= 65)))  # fmt: skip
    return rows


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    out = [
        "# tokenspout: open streams and fan-out saturation of one gateway process",
        "",
        f"`python -m bench` on {m['nproc']} CPUs ({m['cpu_model']}), {m['memory_gib']} GiB "
        f"RAM, Python {m['python']}; load average at start {m['loadavg_at_start'][0]} (a "
        "shared machine). The gateway pinned to CPU 1, the load generator to CPU 0, the "
        f"worker and Redis floating: {'yes' if results.get('pinned') else 'no'}. Suite time "
        f"{results.get('suite_s')} s. Method: docs/bench.md.",
        *(["", results["note"]] if "note" in results else []),
        "",
        "## Targets",
        "",
        "| figure | target | measured | verdict |",
        "| --- | --- | --- | --- |",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in targets(results)),
    ]
    sat = results.get("saturation")
    if sat:
        out += [
            "",
            "## Fan-out saturation (every session read by several clients)",
            "",
            "| sessions x readers | tokens | tok/s (all reading) | TTFT p99 ms | ITL p99 ms | "
            "gateway CPU us/token | gateway CPU use | load generator CPU use | load avg |",
            "| " + " | ".join(["---"] * 9) + " |",
            f"| {sat['sessions']} x {sat['readers_per_session']} | {sat['tokens']:,}/"
            f"{sat['tokens_expected']:,} | {fmt(sat['steady_tokens_per_s'], 0)} | "
            f"{fmt(sat['ttft_ms']['p99'])} | {fmt(sat['itl_ms']['p99'])} | "
            f"{fmt(sat['cpu_us_per_token']['gateway'])} | "
            f"{fmt(sat['cpu_utilisation']['gateway'], 2)} | "
            f"{fmt(sat['cpu_utilisation']['loadgen'], 2)} | {sat['loadavg_before_after']} |",
        ]
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
        out += ["", "Plot: memory.png (same folder)."]
    return "\n".join(out) + "\n"


def memory_plot(results: dict[str, Any], out: Path) -> None:
    hold: list[dict[str, Any]] = results.get("hold", [])
    if not hold:
        return
    fig, ax = pyplot().subplots(figsize=(6, 4.5))
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
