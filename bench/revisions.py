"""``python -m bench.revisions REV REV...``: the same benchmark against several revisions of
tokenspout, in turns.

Each revision (a commit, a branch, a tag; ``.``: this checkout as it is) is checked out once
into a scratch folder (bench/checkouts.py) and its gateway and engine worker run from there,
on the pinned two-core layout (bench/rig.py: the gateway on CPU 1; the worker, Redis, the
engine alone and the load generator on CPU 0); this checkout's client sends the same
requests to each, one revision after the other within each round, the order reversed
every other round (A/B, B/A: use an even ``--rounds``), so a noisy machine, and its drift
within a round, weigh on every side alike. The first revision is the baseline of the
ratios.

Workloads (``--workloads``):

- ``oneshot``: ``--requests`` streamed chat completions of ``--tokens`` token(s) with no
  API key, ``--concurrency`` at a time, the synthetic engine unpaced (bench/requests.py's);
- ``keyed``: the same with a key that has every limit set (none reached) and a weight
  (``--weight``), made by the revision's own ``python -m gateway keys`` (none: no side);
- ``paced``: ``--streams`` streams of ``--stream-tokens`` tokens at ``--rate`` tokens/s each,
  started over ``--streams / --start-rate`` s (bench/e2e.py's point);
- ``burst``: ``--burst`` streams within ``--within-s``, the engine making ``--total-rate``
  tokens/s in all, each request's prepare spending ``--prepare-cpu-ms`` (bench/burst.py's).

Per side: requests/s (tokens/s for the streamed ones, and against the engine alone measured
in the same round), TTFT p50 and p99 (added TTFT over the engine alone's), CPU per request
of the gateway, the worker and Redis, Redis commands per request (in the JSON also by
command, with Redis's time in each: a script's includes its inner commands'); each round's
figures and each revision's ratios to the baseline. Results: docs/bench/NAME.json,
NAME.md, NAME.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import checkouts, profile_top, report, requests, revisions_report, stats, stuck
from bench.checkouts import Checkout
from bench.rig import Rig, rig, run_logs
from bench.runner import run_once

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ("oneshot", "keyed", "paced", "burst")
STREAMED = ("paced", "burst")
ENGINE = "engine alone"
PATH = ["gateway", "worker", "redis"]


def say(message: str) -> None:
    print(f"[bench.revisions] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Pace:
    """How a rig's engine runs; the workloads that share such rigs, in turns."""

    tokens_per_s: float
    backend_args: tuple[str, ...]
    workloads: tuple[str, ...]


def paces(args: argparse.Namespace) -> list[Pace]:
    asked = args.workloads
    found = [
        Pace(0, (), tuple(w for w in ("oneshot", "keyed") if w in asked)),
        Pace(args.rate, (), ("paced",) if "paced" in asked else ()),
        Pace(
            args.total_rate / args.burst,
            ("--prepare-cpu-ms", str(args.prepare_cpu_ms)),
            ("burst",) if "burst" in asked else (),
        ),
    ]
    return [pace for pace in found if pace.workloads]


@dataclass
class Side:
    """One revision on one pace: its rig, and its key's headers (None: it has no keys)."""

    checkout: Checkout
    rig: Rig
    key_headers: dict[str, str] | None

    def headers(self, workload: str) -> dict[str, str] | None:
        """A turn's request headers: the key's for ``keyed``."""
        return self.key_headers if workload == "keyed" else None


async def turn(side_rig: Rig, workload: str, args: argparse.Namespace, **kw: Any) -> Any:
    """One measured run of ``workload`` on ``side_rig`` (``engine``: the engine alone's)."""
    if workload in STREAMED:
        streams, tokens, spread = _stream_shape(workload, args)
        mode = "engine" if kw.get("engine") else "openai"
        bound = spread + tokens / (args.rate if workload == "paced" else _burst_rate(args)) + 60
        return await run_once(side_rig, mode, streams, tokens, spread, bound)
    port = side_rig.engine_port if kw.get("engine") else side_rig.gateway_port
    for server in side_rig.servers.values():
        await server.client.config_resetstat()
    run = await requests.run_side(
        side_rig, port, args, kept=args.connections == requests.KEPT, headers=kw.get("headers")
    )
    spent = {name: await stats.command_stats(s.client) for name, s in side_rig.servers.items()}
    return (*run, spent)


def _burst_rate(args: argparse.Namespace) -> float:
    return float(args.total_rate / args.burst)


def _stream_shape(workload: str, args: argparse.Namespace) -> tuple[int, int, float]:
    """(streams, tokens each, the spread of their starts) of a streamed workload."""
    if workload == "paced":
        return args.streams, args.stream_tokens, args.streams / args.start_rate
    return args.burst, args.burst_tokens, args.within_s


def figures(workload: str, runs: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    """A side's figures over ``runs`` (its turns): the same names for every workload."""
    if workload in STREAMED:
        streams, tokens, _ = _stream_shape(workload, args)
        s = stats.summarise("openai", runs, tokens)
        n = streams * len(runs)
        return {
            "rate": s["tokens_per_s"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"],
            "cpu_us_per_request": {p: round(s["cpu_s"][p] / n * 1e6) for p in [*PATH, "engine"]},
            "cpu_us_per_token": {p: s["cpu_us_per_token"][p] for p in [*PATH, "engine"]},
            "redis_calls_per_request": round(s["redis_calls_per_token"] * tokens, 1)
            if s["redis_calls_per_token"] is not None
            else None,
            "failed": s["tokens_expected"] - s["tokens"],
            "failures": s["failures"],
            "summary": s,
        }
    s = requests.summary([run[:3] for run in runs], PATH)
    n = s["requests"]
    calls: dict[str, int] = {}
    usec: dict[str, int] = {}
    for run in runs:
        for per_server in run[3].values():
            for name, (count, spent_us) in per_server.items():
                calls[name] = calls.get(name, 0) + count
                usec[name] = usec.get(name, 0) + spent_us
    return {
        "rate": s["requests_per_s"],
        "ttft_p50_ms": s["ttft_p50_ms"],
        "ttft_p99_ms": s["ttft_p99_ms"],
        "cpu_us_per_request": s["cpu_us_per_request"],
        "redis_calls_per_request": round(sum(calls.values()) / n, 1) if n else None,
        "redis_commands_per_request": {c: round(k / n, 2) for c, k in sorted(calls.items())},
        "redis_command_us_per_request": {c: round(k / n, 1) for c, k in sorted(usec.items())},
        "failed": s["failed"],
        "failures": s["failures"],
    }


def compared(workload: str, side: dict[str, Any], alone: dict[str, Any]) -> dict[str, Any]:
    """A streamed side against the engine alone (``figures`` of both)."""
    if workload not in STREAMED:
        return {"vs_engine": round(side["rate"] / alone["rate"], 3) if alone["rate"] else None}
    added = stats.added(side["summary"], alone["summary"])
    return {
        "vs_engine": added["tokens_per_s_ratio"],
        "added_ttft_p50_ms": added["added_ttft_p50_ms"],
        "added_ttft_p99_ms": added["added_ttft_p99_ms"],
    }


@contextlib.asynccontextmanager
async def sides_on(pace: Pace, revisions: list[Checkout], args: argparse.Namespace) -> Any:
    """Every revision's rig on ``pace`` (its key made where ``keyed`` runs), all up at once."""
    async with contextlib.AsyncExitStack() as stack:
        sides = []
        for checkout in revisions:
            flags = pace.backend_args
            worker = checkouts.worker_flags(checkout.root, flags) if flags else flags
            if worker != flags:
                say(
                    f"{checkout.label}: its engine worker has no {sorted(set(flags) - set(worker))}"
                )
            logs = args.logs / f"{checkout.commit[:12]}-{pace.tokens_per_s:g}"
            logs.mkdir(parents=True, exist_ok=True)
            side_rig = await stack.enter_async_context(
                rig(
                    pace.tokens_per_s,
                    logs,
                    backend_args=flags,
                    worker_args=worker,
                    root=checkout.root,
                )
            )
            headers = None
            if "keyed" in pace.workloads:
                headers = await _key_headers(checkout, side_rig, args.weight)
            sides.append(Side(checkout, side_rig, headers))
        yield sides


async def _key_headers(checkout: Checkout, side_rig: Rig, weight: float) -> dict[str, str] | None:
    server = next(iter(side_rig.servers.values()))
    env = {
        "REDIS_URL": f"redis://127.0.0.1:{server.port}",
        "TOKENSPOUT_KEY_PREFIX": side_rig.prefix,
    }
    made = await asyncio.to_thread(checkouts.make_key, checkout.root, env, weight)
    if made is None:
        say(f"{checkout.label} has no API keys: no keyed side")
        return None
    await asyncio.sleep(1.0)  # a gateway reads the keys every 250 ms
    return {"Authorization": f"Bearer {made[1]}"}


async def warm_up(sides: list[Side], pace: Pace, args: argparse.Namespace) -> None:
    """Not measured: a fresh process's first requests pay for imports, caches, pools."""
    small = argparse.Namespace(**{**vars(args), "requests": 50})
    for side in sides:
        for workload in pace.workloads:
            if workload in STREAMED:
                await run_once(side.rig, "openai", 16, 4, 0.01, 30)
            elif workload == "oneshot" or side.key_headers is not None:
                await turn(side.rig, workload, small, headers=side.headers(workload))
    await run_once(sides[0].rig, "engine", 16, 4, 0.01, 30)


async def measure_pace(
    pace: Pace, revisions: list[Checkout], args: argparse.Namespace
) -> dict[str, Any]:
    """Every workload of ``pace``, ``args.rounds`` rounds, the revisions in turns."""
    runs: dict[tuple[str, str], list[Any]] = {}
    rounds: list[dict[str, Any]] = []
    async with sides_on(pace, revisions, args) as sides:
        await warm_up(sides, pace, args)
        started = {s.checkout.label: _started_from(s.rig) for s in sides}
        for round_n in range(1, args.rounds + 1):
            for workload in pace.workloads:
                rounds.append(await measure_round(workload, round_n, sides, runs, args))
        profiles = await profile(sides, pace, args) if args.profile is not None else {}
    out: dict[str, Any] = {}
    for workload in pace.workloads:
        alone = figures(workload, runs[workload, ENGINE], args)
        side_figures = {
            s.checkout.label: figures(workload, runs[workload, s.checkout.label], args)
            | {"processes_from": started[s.checkout.label]}
            for s in sides
            if (workload, s.checkout.label) in runs
        }
        for f in side_figures.values():
            f |= compared(workload, f, alone)
        out[workload] = {
            "engine": alone,
            "engine_flags": list(pace.backend_args),
            "sides": side_figures,
            "rounds": [r for r in rounds if r["workload"] == workload],
        }
        if workload in profiles:
            out[workload]["profiles"] = profiles[workload]
    return out


async def profile(sides: list[Side], pace: Pace, args: argparse.Namespace) -> dict[str, Any]:
    """py-spy on each side's gateway and worker during one more turn of each workload (not
    counted in the figures: py-spy takes CPU too); speedscope files and their top frames
    into ``args.profile``."""
    args.profile.mkdir(parents=True, exist_ok=True)
    found: dict[str, Any] = {}
    for workload in pace.workloads:
        for side in sides:
            if workload == "keyed" and side.key_headers is None:
                continue
            pids = {name: side.rig.pids()[name] for name in ("gateway", "worker")}
            stem = f"{workload}-{side.checkout.commit[:7]}"
            async with profile_top.profiling(pids, args.profile, stem) as top:
                await turn(side.rig, workload, args, headers=side.headers(workload))
            found.setdefault(workload, {})[side.checkout.label] = top
    return found


async def measure_round(
    workload: str,
    round_n: int,
    sides: list[Side],
    runs: dict[tuple[str, str], list[Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One round of ``workload``: the engine alone, then each revision in turn, in the
    order of ``sides`` in an odd round and the other way round in an even one (the
    machine drifts within a round: measured, every second side was 7 to 14 % dearer,
    whichever revision it was); each turn's figures (streamed: against this round's
    engine alone)."""
    load = round(os.getloadavg()[0], 2)
    alone_run = await turn(sides[0].rig, workload, args, engine=True)
    runs.setdefault((workload, ENGINE), []).append(alone_run)
    alone = figures(workload, [alone_run], args)
    out: dict[str, Any] = {"workload": workload, "round": round_n, "loadavg": load}
    out[ENGINE] = _brief(alone)
    for side in sides if round_n % 2 else sides[::-1]:
        if workload == "keyed" and side.key_headers is None:
            continue
        label = side.checkout.label
        run = await turn(side.rig, workload, args, headers=side.headers(workload))
        runs.setdefault((workload, label), []).append(run)
        mine = figures(workload, [run], args)
        out[label] = _brief(mine | compared(workload, mine, alone))
        say(f"round {round_n}, {workload}, {label}: {revisions_report.line(out[label])}")
        await asyncio.sleep(0.2)
    return out


BULKY = ("summary", "redis_commands_per_request", "redis_command_us_per_request")


def _brief(f: dict[str, Any]) -> dict[str, Any]:
    """A turn's figures without the bulky ones."""
    return {k: v for k, v in f.items() if k not in BULKY}


def _started_from(side_rig: Rig) -> dict[str, Any]:
    """Where each process of the side runs from, and the worker's command line."""
    pids = side_rig.pids()
    where: dict[str, Any] = {
        name: checkouts.cwd_of(pids[name]) for name in ("gateway", "worker", "engine")
    }
    command = Path(f"/proc/{pids['worker']}/cmdline").read_bytes().decode().split("\0")
    return where | {"worker_args": command[1:]}


async def suite(args: argparse.Namespace) -> dict[str, Any]:
    revisions = [checkouts.checkout(ref, args.scratch) for ref in args.revisions]
    for c in revisions:
        say(f"{c.label}: {c.root}")
    results: dict[str, Any] = {
        "machine": stats.machine(),
        "settings": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}
        | {
            "revisions": [
                {"label": c.label, "ref": c.ref, "commit": c.commit, "root": str(c.root)}
                for c in revisions
            ]
        },
        "workloads": {},
    }
    began = time.monotonic()
    for pace in paces(args):
        results["workloads"] |= await measure_pace(pace, revisions, args)
    for workload in results["workloads"].values():
        revisions_report.add_ratios(workload, revisions[0].label)
    revisions_report.add_keyed_ratio(results)
    results["suite_s"] = round(time.monotonic() - began, 1)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.revisions", description=__doc__)
    parser.add_argument("revisions", nargs="*", help="commits, branches, tags; '.': this checkout")
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=2000, help="oneshot, keyed: per turn")
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1, help="oneshot, keyed: per request")
    parser.add_argument(
        "--connections", choices=(requests.NEW, requests.KEPT), default=requests.NEW
    )
    parser.add_argument("--weight", type=float, default=2.0, help="keyed: the key's weight")
    parser.add_argument("--streams", type=int, default=500, help="paced")
    parser.add_argument("--rate", type=float, default=50.0, help="paced: tokens/s per stream")
    parser.add_argument("--stream-tokens", type=int, default=100, help="paced")
    parser.add_argument("--start-rate", type=float, default=1000.0, help="paced: streams/s")
    parser.add_argument("--burst", type=int, default=1024, help="burst: streams")
    parser.add_argument("--within-s", type=float, default=0.1, help="burst")
    parser.add_argument("--total-rate", type=float, default=10_240.0, help="burst: tokens/s")
    parser.add_argument("--burst-tokens", type=int, default=128, help="burst")
    parser.add_argument("--prepare-cpu-ms", type=float, default=0.25, help="burst")
    parser.add_argument("--scratch", type=Path, default=checkouts.SCRATCH)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="revisions", help="NAME.json, NAME.md, NAME.png")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument(
        "--profile", type=Path, default=None, help="then py-spy each side once more, into DIR"
    )
    parser.add_argument(
        "--render", type=Path, default=None, help="only write NAME.md and NAME.png from this JSON"
    )
    args = parser.parse_args(argv)
    if not args.revisions and args.render is None:
        parser.error("name at least one revision (or --render a results JSON)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.render is not None:
        results = json.loads(args.render.read_text())
    else:
        args.logs = run_logs("revisions", None, say)
        args.load_processes = 1
        results = stuck.run(suite(args))
    png = args.out / f"{args.name}.png"
    plot = None if args.no_plot else (lambda _out: revisions_report.plot(results, png))
    report.write(args.out, args.name, results, revisions_report.markdown(results), plot)
    if args.profile is not None:
        tops = {
            f"{name}, {label}": top
            for name, workload in results["workloads"].items()
            for label, top in workload.get("profiles", {}).items()
        }
        (args.profile / "summary.txt").write_text(profile_top.text(tops))
    say(f"done in {results['suite_s']} s: {args.out}/{args.name}.md")


if __name__ == "__main__":
    main()
