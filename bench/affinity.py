"""``python -m bench.affinity``: what a prompt's prefill costs when its beginning is in another
worker's cache.

W synthetic engine workers (``--workers 4 8``) on one model's queue, each with a prefix cache
sized like a GPU's KV cache (``--kv-cache-tokens``) and a prefill at a GPU's rate
(``--prefill-tokens-per-s``, one request after another: engine/backends/prefill.py), one
Redis, one gateway; the clients stream OpenAI chat completions (bench/affinity_load.py: ``a``
multi-turn chats, ``b`` a shared 2,000-token system prompt, ``c`` nothing shared).

The sides (``--sides``), each on W workers of its own beside the others': ``pull``, the queue
without affinity (``TOKENSPOUT_AFFINITY_WAIT_MS=0``: whichever worker has a free slot takes
the next request); ``affinity``, the queue as it runs by default (a request is taken by the
worker that holds its prefix, elsewhere only after ``--affinity-wait-ms``; docs/affinity.md);
``oracle``, every request pushed to the warmest worker, its cache and prefill queue known
exactly (bench/affinity_oracle.py).

Each point runs at ``rate`` requests (turns) a second for ``--warmup-s`` then ``--seconds``,
the sides in turns, each meeting the same requests at the same times; the load goes up from
``--start-rate`` (per worker) by ``--step`` until every side has fallen behind (``kept_up``):
the last point a side kept up with is its saturation load. Per point: TTFT p50
and p99 of the requests sent in the window, turns and tokens a second, and from each worker's
``/metrics`` (the engine's own counts) the prompt tokens it prefilled and the share of its
prompt tokens its cache held; and ``whole``, the same counts over every request the point
sent (scraped before it starts and once it drained) beside ``findable_tokens``, what those
requests would have found had each gone to the worker that held the most of it (a turn
lands in a window or not by how fast the turns before it ran, so two sides' windows may
differ by a turn; the whole point is one side's own measure). Points accumulate in
``--out``.json (``--fresh``: start over), and the report and plot are made from all of them:
a run may do one workload at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import stuck
from bench.affinity_load import WORKLOADS, Load, Send, Sent, Shape, chat_sender
from bench.affinity_oracle import Warmest, oracle_models
from bench.affinity_report import markdown, plot
from bench.options import parse_options
from bench.stats import machine, metrics_of, pct, summed
from engine.backends.prefill import Prefill
from stack.redis_server import free_port
from stack.rig import HOST, on_embedded_redis

MODEL = "synthetic"
SIDES = {
    "pull": "no affinity: whichever worker has a free slot takes the next request",
    "affinity": "the worker that holds the request's prefix takes it first; another only "
    "after the wait for affinity, or at once when the holder has no free slot",
    "oracle": "every request pushed to the worker where its first token comes soonest (its "
    "cache and prefill queue known exactly)",
}
AFFINITY_MODEL = "synthetic-affinity"
PROMPT = "tokenspout_engine_prompt_tokens_total"
CACHED = "tokenspout_engine_prompt_cached_tokens_total"
TURNS = "tokenspout_engine_time_to_first_token_seconds_count"
AFFINITY = "tokenspout_engine_affinity_total"
WAITED = "tokenspout_engine_affinity_wait_seconds_sum"
PREFILL_RATE = "tokenspout_engine_prefill_tokens_per_second"
SLOWED = 3.0
"""The ladder goes on while a side keeps up: no request failed and its TTFT p50 at most this
many times its lowest load's (or under a second). Past the knee (bench/affinity_report.py
``saturation``), requests queue and TTFT grows without bound (b and c) or the conversations
slow down (a)."""
DRAIN_S = 60.0
"""After a point, what is still under way may finish this long; then its streams close."""


@dataclass
class Options:
    workers: list[int] = field(default_factory=lambda: [4, 8])
    workloads: list[str] = field(default_factory=lambda: list(WORKLOADS))
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    rates: list[float] = field(default_factory=list)
    """Requests a second, each point's; none given: the ladder below."""
    start_rate: float = 0.75
    """Per worker: the ladder's first point."""
    step: float = 1.5
    max_points: int = 6
    seconds: float = 30.0
    warmup_s: float = 8.0
    tokens_per_s: float = 50.0
    prefill_tokens_per_s: float = 5_000.0
    kv_cache_tokens: int = 65_536
    capacity: int = 32
    reply_tokens: int = 64
    think_s: float = 1.0
    affinity_wait_ms: int = 100
    out: Path | None = Path("docs/bench/affinity")
    fresh: bool = False

    def shape(self) -> Shape:
        return Shape(reply_tokens=self.reply_tokens, think_s=self.think_s)


@dataclass
class Side:
    """One side's workers (their ``/metrics``) and how its clients send."""

    name: str
    send: Send
    worker_metrics: list[str]
    oracle: Warmest | None = None


@contextlib.asynccontextmanager
async def rig(options: Options, workers: int, logs: Path) -> AsyncIterator[list[Side]]:
    """A Redis, a gateway, and for each side ``workers`` synthetic workers: the pull side's on
    one model's queue, the oracle's each on a model of its own."""
    env = {"TOKENSPOUT_LOG_LEVEL": "WARNING", "TOKENSPOUT_MAX_INFLIGHT": "100000"}
    with on_embedded_redis(logs, f"affinity-{secrets.token_hex(3)}", env) as (procs, _):

        def worker(*served: str, wait_ms: int = 0) -> str:
            port = free_port()
            procs.synthetic(
                options.tokens_per_s,
                *("--capacity", str(options.capacity), "--metrics-port", str(port)),
                *("--prefill-tokens-per-s", str(options.prefill_tokens_per_s)),
                *("--kv-cache-tokens", str(options.kv_cache_tokens), *served),
                TOKENSPOUT_AFFINITY_WAIT_MS=str(wait_ms),
            )
            return f"http://{HOST}:{port}/metrics"

        pull = [worker() for _ in range(workers)] if "pull" in options.sides else []
        wait, named = options.affinity_wait_ms, ("--served-model-name", AFFINITY_MODEL)
        on = "affinity" in options.sides
        affine = [worker(*named, wait_ms=wait) for _ in range(workers)] if on else []
        models = oracle_models(MODEL, workers) if "oracle" in options.sides else []
        oracle = [worker("--served-model-name", model) for model in models]
        port = procs.gateway().port
        sides = []
        for name, model, urls in (("pull", MODEL, pull), ("affinity", AFFINITY_MODEL, affine)):
            if urls:
                sides.append(Side(name, chat_sender(port, model, options.reply_tokens), urls))
        if oracle:
            prefill = (options.prefill_tokens_per_s, options.kv_cache_tokens)
            warmest = Warmest(port, models, options.reply_tokens, prefill)
            sides.append(Side("oracle", warmest.send, oracle, warmest))
        yield sides


async def scrape(side: Side) -> list[dict[str, float]]:
    return list(await asyncio.gather(*(metrics_of(url) for url in side.worker_metrics)))


async def run_point(
    side: Side, workload: str, rate: float, options: Options, seed: int
) -> dict[str, Any]:
    """One point of one side: ``rate`` requests a second of ``workload``."""
    first = await scrape(side)
    oracle_first = side.oracle.expected if side.oracle else 0
    start = time.perf_counter()
    begin = start + options.warmup_s
    end = begin + options.seconds
    shape, decode = options.shape(), options.tokens_per_s
    everywhere = Prefill(0.0, options.kv_cache_tokens * len(side.worker_metrics))
    load = Load(side.send, shape, rate, end, seed, decode, everywhere)
    running = asyncio.create_task(load.run(workload), name=f"load {workload}")
    await asyncio.sleep(options.warmup_s)
    before, expected = await scrape(side), side.oracle.expected if side.oracle else 0
    await asyncio.sleep(max(0.0, end - time.perf_counter()))
    after = await scrape(side)
    if side.oracle is not None:
        expected = side.oracle.expected - expected
    drained = True
    try:
        async with asyncio.timeout(DRAIN_S):
            await asyncio.shield(running)
    except TimeoutError:
        drained = False
        running.cancel()  # its streams close: the gateway cancels what they asked
        await asyncio.gather(running, return_exceptions=True)
    point = figures(load.sent, before, after, begin, end) | {"rate": rate}
    if side.oracle is not None:  # how well its copies of the caches kept up
        point["oracle_expected_cached"] = expected
    whole = sum_workers(first, await scrape(side))
    point["whole"] = whole | {
        "requests": len(load.sent),
        "drained": drained,
        "findable_tokens": load.findable,
        "oracle_expected_cached": side.oracle.expected - oracle_first if side.oracle else None,
    }
    return point


def sum_workers(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, int]:
    """The side's workers' counts between two scrapes, summed."""
    workers = [worker_figures(was, now) for was, now in zip(before, after, strict=True)]
    return {
        name: sum(worker[name] for worker in workers)
        for name in ("prompt_tokens", "cached_tokens", "affinity_hits", "affinity_misses")
    }


def figures(
    sent: list[Sent],
    before: list[dict[str, float]],
    after: list[dict[str, float]],
    begin: float,
    end: float,
) -> dict[str, Any]:
    """A point's figures: its requests sent in [begin, end), its workers' counts between
    the two scrapes."""
    seconds = end - begin
    window = [s.record for s in sent if begin <= s.record.submitted_at < end]
    ttfts = [r.arrivals[0] - r.submitted_at for r in window if r.arrivals]
    tokens = sum(1 for s in sent for t in s.record.arrivals if begin <= t < end)
    workers = [worker_figures(was, now) for was, now in zip(before, after, strict=True)]
    done = sum(1 for r in window if r.final == "done")
    prompt = sum(w["prompt_tokens"] for w in workers)
    cached = sum(w["cached_tokens"] for w in workers)
    turns = sum(w["turns"] for w in workers)
    return {
        "requests": len(window),
        "failed": sum(1 for r in window if r.failure is not None),
        "done_per_s": round(done / seconds, 2),
        "ttft_p50_ms": round(1000 * (pct(ttfts, 50) or 0), 1),
        "ttft_p99_ms": round(1000 * (pct(ttfts, 99) or 0), 1),
        "tokens_per_s": round(tokens / seconds, 1),
        "prefilled_per_s": round((prompt - cached) / seconds),
        "prefilled_per_turn": round((prompt - cached) / turns) if turns else None,
        "cache_hit_share": round(cached / prompt, 3) if prompt else None,
        "affinity_hits": sum(w["affinity_hits"] for w in workers),
        "affinity_misses": sum(w["affinity_misses"] for w in workers),
        "affinity_wait_ms": {
            outcome: mean_wait_ms(workers, outcome, count)
            for outcome, count in (("hit", "affinity_hits"), ("miss", "affinity_misses"))
        },
        "per_worker": workers,
    }


def mean_wait_ms(workers: list[dict[str, Any]], outcome: str, count: str) -> float | None:
    """The mean time queued of the requests taken with ``outcome``, over ``workers``."""
    taken = sum(w[count] for w in workers)
    waited = sum(w["affinity_waited_s"][outcome] for w in workers)
    return round(1000 * waited / taken, 1) if taken else None


def worker_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    prompt = summed(after, PROMPT) - summed(before, PROMPT)
    cached = summed(after, CACHED) - summed(before, CACHED)

    def grew(name: str, outcome: str) -> float:
        sample = f'{name}{{outcome="{outcome}"}}'
        return after.get(sample, 0) - before.get(sample, 0)

    return {
        "turns": int(summed(after, TURNS) - summed(before, TURNS)),
        "prompt_tokens": int(prompt),
        "cached_tokens": int(cached),
        "cache_hit_share": round(cached / prompt, 3) if prompt else None,
        "affinity_hits": int(grew(AFFINITY, "hit")),
        "affinity_misses": int(grew(AFFINITY, "miss")),
        "affinity_waited_s": {outcome: grew(WAITED, outcome) for outcome in ("hit", "miss")},
        "prefill_tokens_per_s": round(after.get(PREFILL_RATE, 0)),
    }


def kept_up(point: dict[str, Any], lowest: dict[str, Any]) -> bool:
    """Whether the side kept up with the point's load (``lowest``: its lowest load's point)."""
    slowed = point["ttft_p50_ms"] > max(1000.0, SLOWED * lowest["ttft_p50_ms"])
    return not (point["failed"] or slowed)


def rates(options: Options, workers: int) -> list[float]:
    if options.rates:
        return list(options.rates)
    first = options.start_rate * workers
    return [round(first * options.step**n, 2) for n in range(options.max_points)]


async def ladder(
    sides: list[Side], workload: str, workers: int, options: Options
) -> list[dict[str, Any]]:
    """The points of one workload and W, the sides in turns at each load, up the ladder
    until every side has fallen behind (a side that has is not run at higher loads)."""
    points: list[dict[str, Any]] = []
    lowest: dict[str, dict[str, Any]] = {}
    behind: set[str] = set()
    for n, rate in enumerate(rates(options, workers)):
        for side in sides:
            if side.name in behind:
                continue
            say(f"{side.name}, {workload}, W={workers}: {rate:g} requests/s")
            point = await run_point(side, workload, rate, options, seed=n)
            point |= {"side": side.name, "workload": workload, "workers": workers}
            point["kept_up"] = kept_up(point, lowest.setdefault(side.name, point))
            point["loadavg"] = [round(x, 2) for x in os.getloadavg()]
            say(json.dumps({k: v for k, v in point.items() if k != "per_worker"}))
            points.append(point)
            if not point["kept_up"] and not options.rates:
                behind.add(side.name)
        if len(behind) == len(sides):
            break
    return points


async def run(options: Options) -> list[dict[str, Any]]:
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-affinity-") as logs:
        say(f"process logs in {logs}; load average {os.getloadavg()[0]:.2f}")
        for workers in options.workers:
            async with rig(options, workers, Path(logs)) as sides:
                for workload in options.workloads:
                    points += await ladder(sides, workload, workers, options)
    return points


def merged(
    old: dict[str, Any] | None, points: list[dict[str, Any]], options: Options
) -> dict[str, Any]:
    """The results file's points with this run's (a point of the same side, workload, W
    and rate replaced), and this run's settings and machine."""

    def key(point: dict[str, Any]) -> tuple[Any, ...]:
        return point["side"], point["workload"], point["workers"], point["rate"]

    kept = {key(p): p for p in (old or {}).get("points", [])}
    kept |= {key(p): p for p in points}
    settings = {k: v for k, v in vars(options).items() if k not in ("out", "fresh")}
    return {
        "settings": settings,
        "machine": machine(),
        "sides": SIDES,
        "points": sorted(kept.values(), key=key),
    }


def say(message: str) -> None:
    print(f"[bench.affinity] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> Options:
    choices = {"workloads": WORKLOADS, "sides": tuple(SIDES)}
    return parse_options(Options, argv, "python -m bench.affinity", __doc__, choices)


def main(argv: list[str] | None = None) -> None:
    options = parse(sys.argv[1:] if argv is None else argv)
    points = stuck.run(run(options))
    out = options.out
    if out is None:
        return
    path = out.with_suffix(".json")
    old = None if options.fresh or not path.exists() else json.loads(path.read_text())
    results = merged(old, points, options)
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(results))
    plot(results, out.with_suffix(".png"))
    say(f"results in {out}.json, .md, .png")


if __name__ == "__main__":
    main()
