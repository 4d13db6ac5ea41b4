"""NAME.md and NAME.png of ``python -m bench.gpu`` (bench/report.py writes them): per vLLM
mode, each side at each number of streams against vLLM's own server, the cancels, the kill,
and the targets (judged on a GPU only)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from bench.report import fmt, pyplot, save
from bench.report import write as write_files
from bench.vllm_sides import SERVE

TARGET_C = 256


def write(out: Path, name: str, results: dict[str, Any], plot: bool) -> None:
    png = out / f"{name}.png"
    plotter = (lambda _out: plot_modes(results, png)) if plot else None
    write_files(out, name, results, markdown(results), plotter)


def on_gpu(results: dict[str, Any]) -> bool:
    return bool(results["device"]["kind"] == "gpu")


def heading(results: dict[str, Any]) -> list[str]:
    d, m = results["device"], results["machine"]
    if on_gpu(results):
        cards = "; ".join(f"{g['name']} ({g['memory']}, driver {g['driver']})" for g in d["gpus"])
        where = f"on {cards}"
        banner = []
    else:
        where = "on the CPU (vLLM's CPU build), not a GPU"
        banner = [
            f"> **CPU, not a GPU.** vLLM's CPU build on {m['nproc']} cores ({m['cpu_model']}):"
            " these figures show that the bench works end to end; they say nothing of a GPU.",
            "",
        ]
    served = [r.get("vllm_version") for r in results["modes"].values()]
    vllm = next((v for v in served if v), d["vllm"])
    model = results["model"]
    s = results["settings"]
    return [
        f"# tokenspout against vLLM's own OpenAI server, {where}",
        "",
        *banner,
        f"`python -m bench.gpu`: vLLM {vllm}, torch {d['torch']}, transformers"
        f" {d['transformers']}; {m['nproc']} CPU cores ({m['cpu_model']}), Python {m['python']};"
        f" load average at start {m['loadavg_at_start'][0]}. Model: `{model['served_name']}`"
        f" ({_weights(results)})."
        f" C streams at once ({', '.join(map(str, s['streams']))}), started over"
        f" {s['spread_s']:g} s, {s['tokens']} tokens each (greedy, `ignore_eos`), rounds:"
        f" {s['rounds_single']} at one stream, {s['rounds']} past it; the gateway as"
        f" {', '.join(map(str, s['gateways']))} process(es), in turns; {s['clients']} load"
        f" process(es). Took {results.get('elapsed_s')} s. Method: docs/bench.md.",
        "",
    ]


def _weights(results: dict[str, Any]) -> str:
    model, shape = results["model"], results["settings"]["shape"]
    if model["asked"] == "random":
        return f"random weights in the shape of {shape or 'the default model'}"
    return f"`{model['folder']}`"


def _cpu(side: str, m: dict[str, Any]) -> str:
    c = m["cpu_us_per_token"]
    if side == SERVE:
        own, core = fmt(c["server_own"], 0), fmt(c["engine_core"], 0)
        return f"server {fmt(c['engine'], 0)} ({own} + core {core})"
    return (
        f"gateway {fmt(c['gateway'], 0)}, worker {fmt(c['worker'], 0)} ({fmt(c['worker_own'], 0)}"
        f" + core {fmt(c['engine_core'], 0)}), Redis {fmt(c['redis'], 0)}"
    )


def points_table(mode: dict[str, Any]) -> list[str]:
    rows = [
        "| C | side | tokens | tokens/s | vs vllm serve | TTFT p50 / p99 ms | added TTFT p50 /"
        " p99 ms | ITL p99 ms (added) | CPU us per token | busiest client core |",
        "| " + " | ".join(["---"] * 10) + " |",
    ]
    for point in mode.get("points", []):
        for side, m in point["sides"].items():
            a = point.get("added", {}).get(side)
            ratio = fmt(a["tokens_per_s_ratio"], 3) if a else ("1" if side == SERVE else "-")
            add = (
                f"{fmt(a['added_ttft_p50_ms'], 1, True)} / {fmt(a['added_ttft_p99_ms'], 1, True)}"
                if a
                else "-"
            )
            itl = fmt(m["itl_ms"]["p99"], 1) + (
                f" ({fmt(a['added_itl_p99_ms'], 1, True)})" if a else ""
            )
            short = "" if m["tokens"] == m["tokens_expected"] else " (short)"
            rows.append(
                f"| {point['streams']:,} | {side} | {m['tokens']:,}/{m['tokens_expected']:,}{short}"
                f" | {fmt(m['tokens_per_s'], 0)} | {ratio}"
                f" | {fmt(m['ttft_ms']['p50'], 1)} / {fmt(m['ttft_ms']['p99'], 1)} | {add}"
                f" | {itl} | {_cpu(side, m)} | {fmt(m['client_busiest_core'], 3)} |"
            )
    return rows


def decode_step_ms(mode: dict[str, Any], side: str) -> float | None:
    """ITL p50 of one stream on ``side``: one decode step."""
    one = next((p for p in mode.get("points", []) if p["streams"] == 1), None)
    m = one["sides"].get(side) if one else None
    return m["itl_ms"]["p50"] if m else None


def cancels_table(mode: dict[str, Any]) -> list[str]:
    cancels = mode.get("cancels") or {}
    if not cancels:
        return []
    rows = [
        "| side | closed after | n | engine stopped p50 / max ms | in decode steps (p50) |"
        " tokens past those read: total / max | a metrics read p50 ms |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, c in cancels.items():
        step = decode_step_ms(mode, side)
        steps = c["stop_ms"]["p50"] / step if step else None
        rows.append(
            f"| {side} | {c['after_tokens']} tokens | {c['cancels']}"
            f" | {fmt(c['stop_ms']['p50'], 1)} / {fmt(c['stop_ms']['max'], 1)} | {fmt(steps, 1)} |"
            f" {c['tokens_past_read']['total']} / {c['tokens_past_read']['max']}"
            f" | {fmt(c['poll_ms_p50'], 1)} |"
        )
    return [
        "",
        "Cancels: a stream closed by the client as its Nth token arrives; then the engine's"
        " running requests read from its `/metrics` until 0 (`vllm:num_requests_running`;"
        " the worker's `tokenspout_engine_generations_running`). The time is from the close"
        " to that read's answer (its round trip is the resolution); a decode step is the"
        " side's ITL p50 at one stream.",
        "",
        *rows,
    ]


def kill_lines(mode: dict[str, Any]) -> list[str]:
    k = mode.get("kill")
    if not k:
        return []
    return [
        "",
        f"Worker SIGKILLed mid-reply after {k['tokens_before']} tokens (the stack; a second"
        f" worker takes the reply over): the next token at the reader {fmt(k['p50_ms'], 0)} ms"
        f" after the kill (p50 of {k['runs']}; max {fmt(k['max_ms'], 0)} ms), the other"
        " worker's prefill of the prompt and the streamed tokens included.",
    ]


def targets(results: dict[str, Any]) -> list[str]:
    judged = on_gpu(results)
    rows = ["| mode | target | measured | verdict |", "| --- | --- | --- | --- |"]

    def row(
        mode: str,
        name: str,
        value: float | None,
        limit: float,
        above: bool,
        unit: str,
        where: str = "",
    ) -> None:
        if value is None:
            rows.append(f"| {mode} | {name} | not measured | - |")
            return
        ok = value >= limit if above else value <= limit
        verdict = ("met" if ok else "missed") if judged else "not judged (CPU)"
        shown = fmt(float(value), 3 if abs(value) < 10 else 1) + (f" {unit}" if unit else "")
        rows.append(f"| {mode} | {name} | {shown}{where} | {verdict} |")

    for name, mode in results["modes"].items():
        points = [p for p in mode.get("points", []) if "added" in p]
        if not points:
            continue
        gateways = list(points[0]["added"])
        for gw in gateways:
            worst = min(points, key=lambda p: p["added"][gw]["tokens_per_s_ratio"] or 0)
            row(
                name,
                f"{gw}: tokens/s >= 0.97 of vllm serve at every C",
                worst["added"][gw]["tokens_per_s_ratio"],
                0.97,
                True,
                "",
                f" (lowest, at C = {worst['streams']:,})",
            )
        at = next((p for p in points if p["streams"] == TARGET_C), points[-1])
        where = f" at C = {at['streams']:,}"
        for gw in gateways:
            a = at["added"][gw]
            row(
                name,
                f"{gw}: added TTFT p50 <= 15 ms",
                a["added_ttft_p50_ms"],
                15,
                False,
                "ms",
                where,
            )
            row(
                name,
                f"{gw}: added TTFT p99 <= 50 ms",
                a["added_ttft_p99_ms"],
                50,
                False,
                "ms",
                where,
            )
            row(
                name,
                f"{gw}: gateway CPU per token <= 45 us",
                a["cpu_us_per_token"]["gateway"],
                45,
                False,
                "us",
                where,
            )
        cancels = mode.get("cancels", {})
        step = decode_step_ms(mode, SERVE)
        for side, c in cancels.items():
            if side != SERVE and step:
                row(
                    name,
                    f"{side}: the engine stops within one decode step",
                    c["stop_ms"]["p50"] / step,
                    1,
                    False,
                    "steps",
                    f" (p50; a step {step:.1f} ms)",
                )
    return rows


def markdown(results: dict[str, Any]) -> str:
    out = heading(results)
    if results.get("kill"):
        out += [f"Worker kill: {results['kill']}.", ""]
    for name, mode in results["modes"].items():
        if "skipped" in mode:
            out += [f"## {name}: skipped ({mode['skipped']})", ""]
            continue
        f = mode["flags"]
        startup = ", ".join(f"{side} {s:g} s" for side, s in mode["startup_s"].items())
        out += [
            f"## {name} (`enforce_eager={f['enforce_eager']}`)",
            "",
            f"vLLM flags on both sides: dtype `{f['dtype']}`, max_model_len {f['max_model_len']},"
            f" max_num_seqs {f['max_num_seqs']}, max_num_batched_tokens"
            f" {mode.get('max_num_batched_tokens') or 'the default'}"
            + (
                f", gpu_memory_utilization {f['gpu_memory_utilization']}"
                if f["gpu_memory_utilization"] is not None
                else ""
            )
            + f". Start-up: {startup}.",
            "",
            *points_table(mode),
            *cancels_table(mode),
            *kill_lines(mode),
            "",
        ]
    out += ["## Targets", "", *targets(results), ""]
    return "\n".join(out)


def _two_and_five(value: float, _position: int) -> str:
    """A log axis's minor label at 2 and 5 times a power of ten (the others stay bare)."""
    if value <= 0:
        return ""
    leading = round(value / 10 ** math.floor(math.log10(value)))
    return f"{value:,.0f}" if leading in (2, 5) else ""


def plot_modes(results: dict[str, Any], path: Path) -> None:
    modes = {n: m for n, m in results["modes"].items() if m.get("points")}
    if not modes:
        return
    from matplotlib import ticker

    fig, axes = pyplot().subplots(len(modes), 2, figsize=(11, 4.2 * len(modes)), squeeze=False)
    suffix = "" if on_gpu(results) else " (CPU, not a GPU)"
    for row, (name, mode) in zip(axes, modes.items(), strict=True):
        sides = list(mode["points"][0]["sides"])
        for side in sides:
            xs = [p["streams"] for p in mode["points"] if side in p["sides"]]
            ms = [p["sides"][side] for p in mode["points"] if side in p["sides"]]
            style = "-o" if side == SERVE else "--s"
            row[0].plot(xs, [m["tokens_per_s"] or 0 for m in ms], style, label=side)
            row[1].plot(xs, [m["ttft_ms"]["p50"] or 0 for m in ms], style, label=f"{side} p50")
        streams = [p["streams"] for p in mode["points"]]
        for ax, label in zip(row, ("delivered tokens/s", "TTFT p50 (ms)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(streams, [f"{n:,}" for n in streams])
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
            ax.yaxis.set_minor_formatter(ticker.FuncFormatter(_two_and_five))
            ax.set_xlabel("streams at once (C)")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        row[0].set_title(f"{name}: tokens/s{suffix}")
        row[1].set_title(f"{name}: time to first token{suffix}")
    save(fig, path)
