"""``python -m bench`` (``make bench``): what one gateway process holds and relays.

Two questions bench.e2e does not ask, each on a bench rig of its own (bench/rig.py), pinned
as its first suite was: the gateway on CPU 1, the load generator on CPU 0, the worker and
Redis floating (on CPU 0 beside a load generator that reads 50,000 tokens/s they delayed the
fan-out's messages until its readers never all read at once):

- **open streams**: 1,000, 5,000 and 10,000 idle SSE streams held by one gateway process,
  its RSS and its Redis connections at each step, and a probe of 10 active streams
  (bench/hold.py);
- **fan-out saturation**: 20 sessions x 25 readers at 100 tokens/s: the engine makes 2,000
  tokens/s and the gateway must deliver 50,000/s: the tokens/s one gateway process relays
  and its CPU per relayed token.

Results: docs/bench/results.json, results.md and memory.png. ``--quick``: 500 and 1,000
streams, 10 x 20 readers; under a minute.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import profile_top, report, stats, stuck
from bench.hold import hold_sweep
from bench.rig import Rig, rig
from bench.runner import run_once

ROOT = Path(__file__).resolve().parent.parent
HOLD_RATE, SATURATION_RATE = 10.0, 100.0
START_RATE = 200.0
"""Fan-out readers opened per second: all of them are open together for a while."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--hold", type=int, nargs="*", default=None, help="open-stream steps")
    parser.add_argument(
        "--saturation",
        type=int,
        nargs=2,
        default=None,
        metavar=("SESSIONS", "READERS"),
        help="fan-out point at 100 tokens/s: sessions x readers per session (0 0: skip)",
    )
    parser.add_argument("--duration", type=float, default=5.0, help="fan-out: s of tokens")
    parser.add_argument("--profile", type=Path, default=None, help="py-spy the fan-out into")
    parser.add_argument("--no-plots", action="store_true")
    return parser.parse_args(argv)


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


async def fan_out(the_rig: Rig, sessions: int, readers: int, seconds: float) -> dict[str, Any]:
    """Every session read by ``readers`` clients, all open before the first message;
    tokens/s counted while all of them read."""
    spread = sessions * readers / START_RATE
    max_tokens = max(2, round(SATURATION_RATE * seconds))
    bound = max_tokens / SATURATION_RATE + spread + 20
    load = round(os.getloadavg()[0], 2)
    run = await run_once(the_rig, "session", sessions, max_tokens, spread, bound, readers)
    return {
        "sessions": sessions,
        "readers_per_session": readers,
        "tokens_per_s_per_session": SATURATION_RATE,
        "steady_tokens_per_s": stats.steady_rate(run.records),
        "loadavg_before_after": [load, round(os.getloadavg()[0], 2)],
        **stats.summarise("session", [run], max_tokens),
    }


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    default_hold = [500, 1000] if args.quick else [1000, 5000, 10000]
    hold = default_hold if args.hold is None else args.hold
    sessions, readers = args.saturation or ((10, 20) if args.quick else (20, 25))
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {"quick": args.quick, "hold_steps": hold, "saturation": [sessions, readers]},
        "hold": [],
    }
    began = time.monotonic()
    if hold:
        async with rig(HOLD_RATE, args.logs, rest_cpu=None) as the_rig:
            results["pinned"] = the_rig.pinned
            results["hold"] = await hold_sweep(the_rig, hold, HOLD_RATE, 5.0)
    if sessions and readers:
        async with rig(SATURATION_RATE, args.logs, rest_cpu=None) as the_rig:
            results["pinned"] = the_rig.pinned
            spy = None
            if args.profile is not None:
                spy = profile_top.record(the_rig.gateway.pid, args.profile)
            point = results["saturation"] = await fan_out(the_rig, sessions, readers, args.duration)
            if spy is not None:
                profile_top.stop(spy)
            say(
                f"saturation {sessions} x {readers} readers: {point['tokens']}/"
                f"{point['tokens_expected']} tokens, {point['steady_tokens_per_s']} tok/s, "
                f"gateway {point['cpu_us_per_token']['gateway']} us/token at "
                f"{point['cpu_utilisation']['gateway']} of a core"
            )
    results["suite_s"] = round(time.monotonic() - began, 1)
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    say(f"process logs in {args.logs}")
    results = stuck.run(suite(args))
    plot = None if args.no_plots else (lambda out: report.memory_plot(results, out))
    report.write(args.out, "results", results, report.markdown(results), plot)
    say(f"done in {results['suite_s']} s: {args.out}/results.md")


if __name__ == "__main__":
    main()
