"""``python -m bench.preempt_cost``: what preemption costs (``python -m engine --preempt``).

The fairness bench's crowded point (bench/fairness.py, ``noisy, fair``: three quiet keys
and a noisy one on one synthetic worker with ``--capacity`` slots, the fair gateway), once
on a worker that preempts and once on one that does not, in turns (``--turns``: ABBA...),
each on a fresh Redis with the same client. Per turn: the CPU seconds of the worker, Redis
and the gateway over the point, per token served; the script calls Redis ran (FCALL or
EVALSHA:
the takes, charges and, preempting, the looks at the queue while full); the replies the
worker stopped (its ``tokenspout_engine_preemptions_total``); and the quiet keys' TTFT p99.
Results: docs/bench/preempt-cost.json, .md, .png.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis

from bench import fairness, report, stuck
from bench.stats import machine, metrics_of
from stack import procfs
from stack.redis_server import free_port
from stack.rig import on_embedded_redis

PROCESSES = ("worker", "redis", "gateway")


def script_calls(client: redis.Redis) -> int:
    stats: dict[str, dict[str, int]] = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("fcall", "evalsha"))


async def one_turn(preempt: bool, options: fairness.Options, logs: Path) -> dict[str, Any]:
    """The crowded point on a fresh rig whose worker preempts (or not)."""
    with on_embedded_redis(logs, "preempt-cost", fairness.rig_env()) as (procs, embedded):
        metrics = free_port()
        flags = ["--capacity", str(options.capacity), "--metrics-port", str(metrics)]
        flags.append("--preempt" if preempt else "--no-preempt")
        worker = procs.synthetic(options.tokens_per_s, *flags)
        gateway = procs.gateway(TOKENSPOUT_SCHEDULER="fair")
        names = (*fairness.QUIET, fairness.NOISY)
        loads = await fairness.make_keys(gateway, dict.fromkeys(names, 1.0), {})
        rates = fairness.crowded_rates(options)
        point = fairness.Point("noisy, fair", gateway, [loads[n] for n in names], rates)
        assert embedded.process is not None
        pids = {"worker": worker.pid, "redis": embedded.process.pid, "gateway": gateway.process.pid}
        with redis.Redis.from_url(embedded.url) as client:
            cpu_before = {name: procfs.cpu_seconds(pid) for name, pid in pids.items()}
            calls_before = script_calls(client)
            measured = await fairness.run_point(point, options)
            cpu = {name: procfs.cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()}
            calls = script_calls(client) - calls_before
        samples = await metrics_of(f"http://127.0.0.1:{metrics}/metrics")
    stops = int(samples["tokenspout_engine_preemptions_total"])
    # Every token of the point, its warm-up and its last replies too, as the CPU counts.
    tokens = sum(len(record.arrivals) for load in point.loads for record in load.records)
    return {
        "preempt": preempt,
        "tokens": tokens,
        "cpu_s": {name: round(seconds, 2) for name, seconds in cpu.items()},
        "cpu_us_per_token": {name: round(1e6 * s / tokens, 1) for name, s in cpu.items()},
        "script_calls": calls,
        "preemptions": stops,
        "quiet_ttft_p99_ms": [measured["keys"][n]["ttft_p99_ms"] for n in fairness.QUIET],
    }


def summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    """Per process, the median CPU per token with and without, and the difference."""
    rows = {}
    for name in PROCESSES:
        on = statistics.median(t["cpu_us_per_token"][name] for t in turns if t["preempt"])
        off = statistics.median(t["cpu_us_per_token"][name] for t in turns if not t["preempt"])
        rows[name] = {"preempt": on, "no_preempt": off, "added": round(on - off, 1)}
    return rows


async def run(options: fairness.Options, turns: int, logs: Path) -> dict[str, Any]:
    order = [turn % 4 in (0, 3) for turn in range(turns)]  # ABBA: True is A, preempting
    results = []
    for number, preempt in enumerate(order, 1):
        print(f"[preempt-cost] turn {number} of {turns}: preempt={preempt}", flush=True)
        results.append(await one_turn(preempt, options, logs))
    return {
        "machine": machine(),
        "options": {**vars(options), "out": str(options.out), "turns": turns},
        "turns": results,
        "summary": summary(results),
    }


def markdown(results: dict[str, Any]) -> str:
    o, m = results["options"], results["machine"]
    lines = [
        "# What preemption costs (python -m bench.preempt_cost)",
        "",
        f"bench.fairness's `noisy, fair` point ({o['capacity']} slots, {o['tokens_per_s']:g} "
        f"tokens/s a reply, three quiet keys at {o['quiet_rate']:g} requests/s, a noisy key "
        f"at ten times that), {o['seconds']:g} s after {o['warmup_s']:g} s of warm-up, on a "
        "worker with `--preempt` and one without, in turns on fresh processes. CPU over the "
        "point, its warm-up and its last replies, per token they served. "
        f"{m['nproc']} CPUs ({m['cpu_model']}), load {m['loadavg_at_start']} at the start.",
        "",
        "| turn | preempt | tokens | worker µs/token | Redis µs/token | gateway µs/token "
        "| script calls | replies stopped | quiet TTFT p99 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for number, t in enumerate(results["turns"], 1):
        us = t["cpu_us_per_token"]
        p99 = ", ".join(f"{v} ms" for v in t["quiet_ttft_p99_ms"])
        lines.append(
            f"| {number} | {'yes' if t['preempt'] else 'no'} | {t['tokens']:,} "
            f"| {us['worker']} | {us['redis']} | {us['gateway']} | {t['script_calls']:,} "
            f"| {t['preemptions']} | {p99} |"
        )
    lines += ["", "| process | µs/token, preempting | not preempting | added |"]
    lines.append("| --- | --- | --- | --- |")
    for name, row in results["summary"].items():
        lines.append(f"| {name} | {row['preempt']} | {row['no_preempt']} | {row['added']:+} |")
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    rows = results["summary"]
    where = range(len(PROCESSES))
    ax.bar([i - 0.2 for i in where], [rows[n]["no_preempt"] for n in PROCESSES], 0.4,
           label="--no-preempt")  # fmt: skip
    ax.bar([i + 0.2 for i in where], [rows[n]["preempt"] for n in PROCESSES], 0.4,
           label="--preempt")  # fmt: skip
    ax.set_xticks(list(where), list(PROCESSES))
    ax.set_ylabel("CPU µs per token (median of turns)")
    ax.legend()
    report.save(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.preempt_cost", description=__doc__)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--turns", type=int, default=4, help="ABBA...: an even number")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/preempt-cost"))
    parser.add_argument("--logs", type=Path, default=None, help="the processes' logs here")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.turns < 2 or args.turns % 2:
        parser.error("--turns: an even number, at least 2 (each way once)")
    options = fairness.Options(seconds=args.seconds, warmup_s=args.warmup_s, out=args.out)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="bench-preempt-cost-"))
    print(f"[preempt-cost] process logs in {logs}", flush=True)
    results = stuck.run(run(options, args.turns, logs))
    text = markdown(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(text)
    plot(results, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
