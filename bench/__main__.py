"""``python -m bench`` (``make bench``): gateway overhead, scale and cost, against baselines.

Every point runs three ways on the same synthetic engine and the same token schedule: no
gateway (tokens read straight from Redis), the reference relay (bench/reference_relay.py),
and tokenspout's gateway. Results go to ``docs/bench/`` as JSON, a markdown table and PNG
plots. The full suite takes about 6-8 minutes on 2 cores; ``--quick`` about 1-2.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

from bench import profile_top, report, stats
from bench.hold import hold_sweep
from bench.rig import rig
from bench.runner import MODES, SWEEP_MODES, run_point, single_stream_ttft

ROOT = Path(__file__).resolve().parent.parent
SATURATION_RATE = 100.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a 1-2 minute run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--concurrency", type=int, nargs="+", default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="tokens/s/stream")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sweep-modes", nargs="+", choices=MODES, default=list(SWEEP_MODES))
    parser.add_argument("--duration", type=float, default=None, help="seconds per stream")
    parser.add_argument("--hold", type=int, nargs="*", default=None, help="open-stream steps")
    parser.add_argument(
        "--saturation",
        type=int,
        nargs=2,
        default=None,
        metavar=("SESSIONS", "READERS"),
        help="fan-out point at 100 tokens/s: sessions x readers per session (0 0: skip)",
    )
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the gateway into")
    parser.add_argument("--ttft-rounds", type=int, default=None, help="single-stream TTFTs")
    parser.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def suite(args: argparse.Namespace) -> dict[str, object]:
    quick = args.quick
    concurrency = args.concurrency or ([1, 10, 100] if quick else [1, 10, 100, 500, 1000])
    rates = args.rates or ([100.0] if quick else [10.0, 100.0])
    duration = args.duration or (3.0 if quick else 6.0)
    args.ttft_rounds = args.ttft_rounds if args.ttft_rounds is not None else (5 if quick else 10)
    hold = args.hold if args.hold is not None else ([500, 1000] if quick else [1000, 5000, 10000])
    results: dict[str, object] = {
        "machine": stats.machine(),
        "settings": {
            "quick": quick,
            "concurrency": concurrency,
            "tokens_per_s_per_stream": rates,
            "seconds_per_stream": duration,
            "hold_steps": hold,
            "gateway_server": "uvicorn",
        },
        "points": [],
        "hold": [],
    }
    points: list[dict[str, object]] = results["points"]  # type: ignore[assignment]
    began = time.monotonic()
    for rate in rates:
        async with rig(rate, args.logs) as the_rig:
            results["pinned"] = the_rig.pinned
            profiler = None
            if args.profile is not None:
                profiler = profile_top.record(
                    the_rig.gateway.pid, args.profile.with_suffix(f".{rate:g}.json")
                )
            sweep_modes = [m for m in args.sweep_modes if m in args.modes]
            if args.ttft_rounds:
                single = await single_stream_ttft(the_rig, sweep_modes, args.ttft_rounds, rate)
                results.setdefault("single_stream_ttft", {})[f"{rate:g}"] = single  # type: ignore[index]
                say(f"single-stream TTFT at {rate:g} tok/s: {single}")
            for streams in concurrency:
                for mode in sweep_modes:
                    point = await run_point(the_rig, mode, streams, rate, duration)
                    points.append(point)
                    say(
                        f"{mode:9} {streams:5} x {rate:5.0f} tok/s: "
                        f"{point['tokens']}/{point['tokens_expected']} tokens, "
                        f"{point['tokens_per_s']} tok/s, ttft {point['ttft_ms']}, "
                        f"itl {point['itl_ms']}, cpu/token {point['relay_cpu_us_per_token']} us, "
                        f"redis/token {point['redis_calls_per_token']}"
                    )
            if hold and rate == min(rates) and "gateway" in args.modes:
                results["hold"] = await hold_sweep(the_rig, hold, rate, min(duration, 5.0))
            if profiler is not None:
                profile_top.stop(profiler)
    sessions, readers = args.saturation or ((10, 20) if quick else (20, 25))
    if sessions and readers:
        saturation: list[dict[str, object]] = []
        results["saturation"] = saturation
        async with rig(SATURATION_RATE, args.logs) as the_rig:
            for mode in [m for m in args.modes if m in ("reference", "reference-spin", "gateway")]:
                profiler = None
                if args.profile is not None and mode == "gateway":
                    profiler = profile_top.record(the_rig.gateway.pid, args.profile)
                point = await run_point(
                    the_rig, mode, sessions, SATURATION_RATE, min(duration, 4.0), readers
                )
                if profiler is not None:
                    profile_top.stop(profiler)
                saturation.append(point)
                say(
                    f"saturation {mode:9} {sessions} x {readers} readers: "
                    f"{point['tokens']}/{point['tokens_expected']} tokens, "
                    f"{point['tokens_per_s']} tok/s, cpu/token "
                    f"{point['relay_cpu_us_per_token']} us, cpu use "
                    f"{point['relay_cpu_utilisation']}, loadgen {point['loadgen_cpu_utilisation']}"
                )
    results["suite_s"] = round(time.monotonic() - began, 1)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    say(f"process logs in {args.logs}")
    results = asyncio.run(suite(args))
    plot = None if args.no_plots else (lambda out: report.plots(results, out))
    report.write(args.out, "results", results, report.markdown(results), plot)
    say(f"done in {results['suite_s']} s: {args.out}/results.md")


if __name__ == "__main__":
    main()
