"""``python -m bench.burst``: a burst of streams at a GPU's rate, against the engine alone.

On a GPU a burst of hundreds of requests meets an engine that admits them in one step and
then makes thousands of tokens a second; the CPU engine never does that here. This bench
makes it with the synthetic engine: N streams (256 and 1,024 by default) all start within
``--within-s`` (0.1 s), the engine paced so that all N together make ``--total-rate``
tokens/s (10,240: 40 tokens/s each for 256, 10 each for 1,024), and each request's prepare
spends ``--prepare-cpu-ms`` of CPU on the engine's event loop (0.25: what vLLM's chat
template and tokenizer cost the worker for a 170-token chat here; docs/bench.md), so a
burst is admitted one request after another as vLLM admits it.

Both sides get the same requests from the same client, one process of bench/loadgen.py's
readers (its CPU is reported: it must not be the bottleneck): the gateway's
``/v1/chat/completions`` (gateway, Redis, the engine worker), and the engine alone
(bench/reference_engine.py: the same backend from the same flags, in one process), in turns
within each round, on the bench rig (bench/rig.py). Added TTFT is the gateway's percentile
less the engine alone's; the ratio is of tokens/s over each run's span. ``--profile DIR``
runs each burst once more under py-spy, two tokens a stream so that the profile is the
admission's (gateway and worker; not measured).
Results: docs/bench/burst.json, burst.md, burst.png; docs/bench.md has the method.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench import profile_top, report, stats, stuck
from bench.report import fmt
from bench.rig import Rig, rig, run_logs
from bench.runner import run_once
from bench.stats import Run, added, summarise

ROOT = Path(__file__).resolve().parent.parent
MODES = ("engine", "openai")
TARGET_ADDED_P99_MS = 150.0
TARGET_RATIO = 0.95


def say(message: str) -> None:
    print(f"[bench.burst] {message}", file=sys.stderr, flush=True)


def ttfts_ms(runs: list[Run]) -> list[float]:
    return sorted(
        round((r.arrivals[0] - r.submitted_at) * 1000, 2)
        for run in runs
        for r in run.records
        if r.arrivals
    )


async def point(args: argparse.Namespace, streams_n: int) -> dict[str, Any]:
    """One burst size: its rig (the engine paced for it), then ``rounds`` rounds of each
    side in turn."""
    per_stream = args.total_rate / streams_n
    bound = args.tokens / per_stream + args.within_s + 60
    flags = ("--prepare-cpu-ms", str(args.prepare_cpu_ms))
    logs = args.logs / f"burst-{streams_n}"
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[Run]] = {mode: [] for mode in MODES}
    async with rig(per_stream, logs, backend_args=flags, **placement(args)) as the_rig:
        for mode in MODES:  # not measured: a fresh process's first requests pay for imports
            await run_once(the_rig, mode, 16, 4, 0.01, 30)
        for round_n in range(args.rounds):
            for mode in MODES if round_n % 2 == 0 else MODES[::-1]:
                run = await run_once(the_rig, mode, streams_n, args.tokens, args.within_s, bound)
                runs[mode].append(run)
                await asyncio.sleep(0.5)
        if args.profile is not None:
            await profile(the_rig, args, streams_n, bound)
    modes = {mode: summarise(mode, done, args.tokens) for mode, done in runs.items()}
    rounds = []
    for engine_run, openai_run in zip(runs["engine"], runs["openai"], strict=True):
        alone = summarise("engine", [engine_run], args.tokens)
        rounds.append(added(summarise("openai", [openai_run], args.tokens), alone))
    return {
        "streams": streams_n,
        "tokens_per_s_per_stream": round(per_stream, 2),
        "max_tokens": args.tokens,
        "start_spread_s": args.within_s,
        "modes": modes,
        "added": {"openai": added(modes["openai"], modes["engine"])},
        "rounds": rounds,
        "ttft_ms": {mode: ttfts_ms(done) for mode, done in runs.items()},
    }


def placement(args: argparse.Namespace) -> dict[str, Any]:
    return {"rest_cpu": None, "gateway_cpu": None} if args.floating else {}


async def profile(the_rig: Rig, args: argparse.Namespace, streams_n: int, bound: float) -> None:
    pids = {"gateway": the_rig.gateway.pid, "worker": the_rig.worker.pid}
    assert args.profile is not None
    async with profile_top.profiling(pids, args.profile, f"burst-{streams_n}") as summary:
        # Two tokens a stream: the burst's admission, not the streaming after it.
        await run_once(the_rig, "openai", streams_n, 2, args.within_s, bound)
    (args.profile / f"burst-{streams_n}.txt").write_text(profile_top.text({"openai": summary}))


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {
            "streams": args.streams,
            "total_tokens_per_s": args.total_rate,
            "within_s": args.within_s,
            "tokens_per_stream": args.tokens,
            "prepare_cpu_ms": args.prepare_cpu_ms,
            "rounds": args.rounds,
            "floating": args.floating,
            "reduced": args.reduced,
        },
        "points": [],
    }
    began = time.monotonic()
    for streams_n in args.streams:
        done = await point(args, streams_n)
        results["points"].append(done)
        say(describe(done))
    results["suite_s"] = round(time.monotonic() - began, 1)
    results["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    return results


def describe(done: dict[str, Any]) -> str:
    a = done["added"]["openai"]
    loadgen = [done["modes"][m]["cpu_utilisation"]["loadgen"] for m in MODES]
    return (
        f"{done['streams']} streams: added ttft p50 {a['added_ttft_p50_ms']} ms, p99 "
        f"{a['added_ttft_p99_ms']} ms, tokens/s {a['tokens_per_s_ratio']} of the engine "
        f"alone's; client cpu {loadgen}; per round: "
        + "; ".join(
            f"{r['added_ttft_p99_ms']} ms {r['tokens_per_s_ratio']}" for r in done["rounds"]
        )
    )


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    lines = [
        "# Bursts at a GPU's rate (python -m bench.burst)",
        "",
        f"{', '.join(map(str, s['streams']))} streams starting within {s['within_s']} s, "
        f"{s['total_tokens_per_s']:,.0f} tokens/s in all, {s['tokens_per_stream']} tokens "
        f"each, {s['prepare_cpu_ms']} ms of CPU per request's prepare; {s['rounds']} rounds, "
        f"the gateway's `/v1/chat/completions` and the engine alone in turns, the same client. "
        f"Targets: added TTFT p99 <= {TARGET_ADDED_P99_MS:g} ms and >= "
        f"{TARGET_RATIO} of the engine alone's tokens/s. Method: docs/bench.md.",
        "",
        f"Machine: {results['machine']['cpu_model']}, {results['machine']['nproc']} CPUs, "
        f"load {results['machine']['loadavg_at_start']} at start; "
        f"{'nothing pinned' if s['floating'] else 'gateway on CPU 1, the rest on CPU 0'}.",
        "",
        "| streams | tok/s each | side | tokens | tok/s | TTFT p50 / p99 ms | added p50 / p99 ms "
        "| tok/s ratio | CPU us/token gateway / worker / Redis (engine alone) | client CPU |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for p in results["points"]:
        a = p["added"]["openai"]
        for mode in MODES:
            m = p["modes"][mode]
            cpu = m["cpu_us_per_token"]
            own = (
                f"({fmt(cpu['engine'])})"
                if mode == "engine"
                else f"{fmt(cpu['gateway'])} / {fmt(cpu['worker'])} / {fmt(cpu['redis'])}"
            )
            side = "engine alone" if mode == "engine" else "gateway"
            extra = (
                ("", "")
                if mode == "engine"
                else (
                    f"{fmt(a['added_ttft_p50_ms'], sign=True)} / "
                    f"{fmt(a['added_ttft_p99_ms'], sign=True)}",
                    fmt(a["tokens_per_s_ratio"], 3),
                )
            )
            lines.append(
                f"| {p['streams']} | {fmt(p['tokens_per_s_per_stream'])} | {side} | "
                f"{fmt(m['tokens'])}/{fmt(m['tokens_expected'])} | {fmt(m['tokens_per_s'])} | "
                f"{fmt(m['ttft_ms']['p50'])} / {fmt(m['ttft_ms']['p99'])} | {extra[0]} | "
                f"{extra[1]} | {own} | {fmt(m['cpu_utilisation']['loadgen'], 2)} |"
            )
    lines += ["", "Each round alone (added TTFT p99 ms, tokens/s ratio):", ""]
    for p in results["points"]:
        pairs = ", ".join(
            f"{fmt(r['added_ttft_p99_ms'], sign=True)} ms {fmt(r['tokens_per_s_ratio'], 3)}"
            for r in p["rounds"]
        )
        lines.append(f"- {p['streams']} streams: {pairs}")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], png: Path) -> None:
    """Each point's TTFT distribution, both sides."""
    plt = report.pyplot()
    points = results["points"]
    fig, axes = plt.subplots(1, len(points), figsize=(5 * len(points), 3.6), squeeze=False)
    for ax, p in zip(axes[0], points, strict=True):
        for mode, label in (("engine", "engine alone"), ("openai", "through the gateway")):
            values = p["ttft_ms"][mode]
            ax.plot(values, [i / max(1, len(values) - 1) for i in range(len(values))], label=label)
        ax.set_title(f"{p['streams']} streams within {p['start_spread_s']} s")
        ax.set_xscale("log")
        ax.set_xlabel("time to first token, ms (log scale)")
        ax.set_ylabel("share of streams")
        ax.grid(alpha=0.3)
        ax.legend()
    report.save(fig, png)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.burst", description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="burst", help="file names: NAME.json, .md, .png")
    parser.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--total-rate", type=float, default=10_240.0, help="tokens/s in all")
    parser.add_argument("--within-s", type=float, default=0.1, help="every stream starts within")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    parser.add_argument(
        "--prepare-cpu-ms", type=float, default=0.25, help="CPU of each request's prepare"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--floating", action="store_true", help="pin nothing")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy speedscopes into DIR")
    parser.add_argument("--reduced", action="store_true", help="mark the results as reduced")
    parser.add_argument("--no-plot", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = run_logs("burst", args.profile, say)
    results = stuck.run(suite(args))
    png = args.out / f"{args.name}.png"
    report.write(
        args.out,
        args.name,
        results,
        markdown(results),
        None if args.no_plot else (lambda _out: plot(results, png)),
    )
    say(f"done in {results['suite_s']} s: {args.out}/{args.name}.md")


if __name__ == "__main__":
    main()
