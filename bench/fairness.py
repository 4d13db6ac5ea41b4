"""``python -m bench.fairness``: many tenants on one engine, through the gateway.

One synthetic engine worker with ``--capacity`` slots, replies of ``--reply-tokens`` tokens
on average (half to one and a half times that) at ``--tokens-per-s``, one Redis, and two
gateways: one serving each model's queue by the Virtual Token Counter
(``TOKENSPOUT_SCHEDULER=fair``), one first come, first served (``fifo``). The worker
preempts (``--preempt``; ``--no-preempt``: it does not): with every slot busy it stops a
noisy reply for a quiet request, which only the fair queue asks of it. Each tenant is an
API key made through the admin API; its client streams chat completions through the OpenAI
endpoint with its key.

The points, each ``--seconds`` long after a warm-up, in turns on the same processes:

- ``quiet alone`` (fair): three quiet keys, each sending ``--quiet-rate`` requests a second
  (Poisson arrivals): what a quiet key gets when nobody crowds it;
- ``noisy, fifo`` and ``noisy, fair``: the same three, and a noisy key sending ten times
  as many: more than the engine can serve, so requests wait;
- ``weights 1:2:4`` (fair): three keys of weights 1, 2 and 4, each keeping
  ``--backlog`` requests in flight (always more than its share): the tokens each is served;
- ``noisy, slots to spare`` (fair; ``--no-bound`` leaves it out): the quiet keys and a noisy
  key capped at the slots they leave it, on a second worker with twice the slots: no quiet
  request waits for a slot, what the best preemptive scheduler would give them, so their
  TTFT there is the least any scheduler gets on this machine under this load.

Per key it reports time to first token (p50, p99), tokens per second, its share of the
tokens served and its fair share (max-min by weight: a key that asks less than its share
gets all it asks, the rest is split among the others by weight); per point, the engine's
tokens per second. Results: docs/bench/fairness.json, fairness.md, fairness.png.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import math
import random
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import report, stuck
from bench.loadgen import OpenAIStream, StreamRecord, http_request, open_stream
from bench.options import parse_options
from bench.stats import machine, pct
from stack.rig import HOST, Gateway, on_embedded_redis

ADMIN_KEY = "bench-admin-" + secrets.token_hex(8)
QUIET = ("quiet-1", "quiet-2", "quiet-3")
NOISY = "noisy"
CAPPED = "noisy-capped"
MODEL, SPARE = "synthetic", "synthetic-spare"
SPARE_POINT = "noisy, slots to spare"
REFUSED = "HTTP 429"
"""A request over its key's limit (the capped noisy key's, past its concurrent ones)."""
WEIGHTED = {"weight-1": 1.0, "weight-2": 2.0, "weight-4": 4.0}


@dataclass
class Options:
    capacity: int = 8
    tokens_per_s: float = 100.0
    reply_tokens: int = 40
    quiet_rate: float = 2.0
    seconds: float = 30.0
    warmup_s: float = 5.0
    backlog: int = 12
    bound: bool = True
    """Also the point no scheduler beats (``SPARE_POINT``)."""
    preempt: bool = True
    """The worker stops a noisy reply for a quiet request (``python -m engine --preempt``)."""
    workers: int = 1
    """Engine workers on the model's queue, each with ``capacity`` slots."""
    conversations: int = 0
    """Per key: each request is the next turn of one of the key's this many conversations in
    turn (up to ``TURNS`` turns, then a new one), so the worker that ran a turn holds the next
    one's history and cache affinity places it (docs/affinity.md); 0: every request the
    same one-word message."""
    affinity: bool = True
    """The workers take with cache affinity (the default); ``--no-affinity``: in the queue's
    order (``TOKENSPOUT_AFFINITY_WAIT_MS=0``)."""
    out: Path | None = Path("docs/bench/fairness")


TURNS = 8
"""Turns of a conversation (``Options.conversations``) before it starts over."""


@dataclass
class KeyLoad:
    """One key's client: its requests' records, by when they were sent, and the tokens
    each asked for (replies vary in length, so the worker's slots free at different
    times, as an engine's do)."""

    name: str
    secret: str
    weight: float = 1.0
    records: list[StreamRecord] = field(default_factory=list)
    asked: list[int] = field(default_factory=list)
    lengths: random.Random = field(default_factory=random.Random)
    histories: list[list[str]] = field(default_factory=list)
    """Its conversations' messages so far (``Options.conversations``)."""
    turns: int = 0

    def reset(self) -> None:
        self.records, self.asked = [], []
        self.lengths = random.Random(self.name)
        self.histories, self.turns = [], 0

    def next_messages(self, conversations: int) -> list[dict[str, str]]:
        """The messages of this key's next request: its next conversation's turn so far
        (user messages only: a turn's prefix is the one before it, whatever its reply)."""
        if not conversations:
            return [{"role": "user", "content": "fair"}]
        if not self.histories:
            self.histories = [[] for _ in range(conversations)]
        number, self.turns = self.turns, self.turns + 1
        history = self.histories[number % conversations]
        if len(history) == TURNS:
            history.clear()
        history.append(f"{self.name}, message {number}: go on")
        return [{"role": "user", "content": content} for content in history]

    def demand(self, begin: float, end: float) -> float:
        """Tokens per second the requests sent in [begin, end) asked for."""
        sent = zip(self.records, self.asked, strict=True)
        return sum(tokens for record, tokens in sent if begin <= record.submitted_at < end) / (
            end - begin
        )


@dataclass
class Point:
    name: str
    gateway: Gateway
    loads: list[KeyLoad]
    rates: dict[str, float]
    """Key -> requests a second (Poisson); a key not here keeps ``backlog`` in flight."""
    model: str = MODEL


def chat_request(
    gateway: Gateway, secret: str, reply_tokens: int, model: str, messages: list[dict[str, str]]
) -> bytes:
    body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "stream": True}
    headers = {"Authorization": f"Bearer {secret}", "Accept": "text/event-stream"}
    path = "/v1/chat/completions"
    return http_request("POST", HOST, gateway.port, path, headers, json.dumps(body).encode())


async def one_request(point: Point, load: KeyLoad, options: Options) -> None:
    record = StreamRecord()
    tokens = load.lengths.randint(options.reply_tokens // 2, options.reply_tokens * 3 // 2)
    load.records.append(record)
    load.asked.append(tokens)
    messages = load.next_messages(options.conversations)
    request = chat_request(point.gateway, load.secret, tokens, point.model, messages)
    stream = await open_stream(HOST, point.gateway.port, request, record, OpenAIStream)
    try:
        assert record.finished is not None
        await record.finished
    finally:
        stream.close()


async def poisson(point: Point, load: KeyLoad, rate: float, until: float, o: Options) -> None:
    """Requests at ``rate`` a second on average, each on its own, until ``until``."""
    pending: set[asyncio.Task[None]] = set()
    gaps = random.Random(load.name)
    while time.perf_counter() < until:
        task = asyncio.create_task(one_request(point, load, o))
        pending.add(task)
        task.add_done_callback(pending.discard)
        await asyncio.sleep(gaps.expovariate(rate))
    await asyncio.gather(*pending)


async def closed_loop(point: Point, load: KeyLoad, until: float, o: Options) -> None:
    """``backlog`` requests in flight, each followed by the next, until ``until``."""

    async def loop() -> None:
        while time.perf_counter() < until:
            await one_request(point, load, o)

    await asyncio.gather(*(loop() for _ in range(o.backlog)))


def key_figures(load: KeyLoad, begin: float, end: float, frees: list[float]) -> dict[str, Any]:
    """TTFT of the requests sent in [begin, end), tokens that arrived in it; and of each
    request's TTFT, the part past the next slot the engine freed after it was sent (``frees``:
    when every reply of the point ended, sorted): what no scheduler that lets a started reply
    run to its end can take off, a request sent to an engine whose every slot is busy."""
    sent = [r for r in load.records if begin <= r.submitted_at < end]
    ttfts = [r.arrivals[0] - r.submitted_at for r in sent if r.arrivals]
    beyond = [
        r.arrivals[0] - frees[i]
        for r in sent
        if r.arrivals
        and (i := bisect.bisect_left(frees, r.submitted_at)) < len(frees)
        and frees[i] < r.arrivals[0]
    ]
    tokens = sum(1 for r in load.records for t in r.arrivals if begin <= t < end)
    refused = sum(1 for r in sent if r.failure == REFUSED)
    failed = sum(1 for r in sent if r.failure is not None) - refused
    return {
        "requests": len(sent),
        "failed": failed,
        "refused": refused,
        "ttft_p50_ms": round(1000 * (pct(ttfts, 50) or 0), 1),
        "ttft_p99_ms": round(1000 * (pct(ttfts, 99) or 0), 1),
        "after_free_slot_p50_ms": round(1000 * (pct(beyond, 50) or 0), 1),
        "after_free_slot_p99_ms": round(1000 * (pct(beyond, 99) or 0), 1),
        "tokens_per_s": round(tokens / (end - begin), 1),
    }


def fair_shares(
    demand: dict[str, float | None], weights: dict[str, float], total: float
) -> dict[str, float]:
    """Max-min fair shares of ``total`` tokens/s by weight: a key asking less than its
    share (``demand``; None: unbounded) gets what it asks, the rest is split again."""
    shares: dict[str, float] = {}
    left, open_keys = total, set(demand)
    while open_keys:
        unit = left / sum(weights[k] for k in open_keys)
        capped = {k for k in open_keys if (d := demand[k]) is not None and d <= unit * weights[k]}
        if not capped:
            shares |= {k: round(unit * weights[k], 1) for k in open_keys}
            break
        for key in capped:
            shares[key] = round(demand[key] or 0.0, 1)
            left -= demand[key] or 0.0
        open_keys -= capped
    return shares


async def run_point(point: Point, options: Options) -> dict[str, Any]:
    print(f"[fairness] {point.name}: {options.warmup_s + options.seconds:.0f} s", flush=True)
    start = time.perf_counter()
    begin, end = start + options.warmup_s, start + options.warmup_s + options.seconds
    clients = [
        poisson(point, load, point.rates[load.name], end, options)
        if load.name in point.rates
        else closed_loop(point, load, end, options)
        for load in point.loads
    ]
    await asyncio.gather(*clients)
    frees = sorted(r.arrivals[-1] for load in point.loads for r in load.records if r.arrivals)
    keys = {load.name: key_figures(load, begin, end, frees) for load in point.loads}
    total = sum(figures["tokens_per_s"] for figures in keys.values())
    demand = {
        load.name: load.demand(begin, end) if load.name in point.rates else None
        for load in point.loads
    }
    weights = {load.name: load.weight for load in point.loads}
    for name, share in fair_shares(demand, weights, total).items():
        keys[name]["fair_share_tokens_per_s"] = share
        keys[name]["share"] = round(keys[name]["tokens_per_s"] / total, 4) if total else None
    print(f"[fairness] {point.name}: {total:.0f} tokens/s: {json.dumps(keys)}", flush=True)
    return {"name": point.name, "tokens_per_s": round(total, 1), "keys": keys}


async def make_keys(
    gateway: Gateway, weights: dict[str, float], limits: dict[str, dict[str, int]]
) -> dict[str, KeyLoad]:
    loads = {}
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(base_url=gateway.url, headers=headers, timeout=30) as admin:
        for name, weight in weights.items():
            key = {"name": name, "weight": weight, "limits": limits.get(name, {})}
            made = await admin.post("/v1/admin/keys", json=key)
            made.raise_for_status()
            loads[name] = KeyLoad(name, made.json()["key"], weight)
    return loads


def capped_slots(options: Options) -> int:
    """The noisy key's concurrent generations in the ``SPARE_POINT``: the slots the quiet
    keys leave it on average (what a scheduler that stops noisy replies for quiet requests
    would leave it), so the engine is about as busy as at capacity."""
    quiet_slots = len(QUIET) * options.quiet_rate * options.reply_tokens / options.tokens_per_s
    return max(1, options.capacity - math.ceil(quiet_slots))


def rig_env() -> dict[str, str]:
    """Every process of a fairness rig: keys made through the admin API, warnings only,
    no cap on the requests in flight (the noisy key's backlog is the point)."""
    return {
        "TOKENSPOUT_ADMIN_KEY": ADMIN_KEY,
        "TOKENSPOUT_LOG_LEVEL": "WARNING",
        "TOKENSPOUT_MAX_INFLIGHT": "100000",
    }


def crowded_rates(options: Options) -> dict[str, float]:
    """Requests a second of each quiet key, and of the noisy key: ten times as many."""
    return dict.fromkeys(QUIET, options.quiet_rate) | {NOISY: 10 * options.quiet_rate}


@contextlib.asynccontextmanager
async def gateways(logs: Path, options: Options) -> AsyncIterator[tuple[Gateway, Gateway]]:
    env = rig_env() | ({} if options.affinity else {"TOKENSPOUT_AFFINITY_WAIT_MS": "0"})
    with on_embedded_redis(logs, f"fair-{secrets.token_hex(3)}", env) as (procs, _):
        preempt = ["--preempt"] if options.preempt else []
        for _ in range(options.workers):
            procs.synthetic(options.tokens_per_s, "--capacity", str(options.capacity), *preempt)
        if options.bound:  # twice the slots: a quiet request never waits for one
            spare = ["--capacity", str(2 * options.capacity), "--served-model-name", SPARE]
            procs.synthetic(options.tokens_per_s, *spare)
        fair = procs.gateway(TOKENSPOUT_SCHEDULER="fair")
        fifo = procs.gateway(TOKENSPOUT_SCHEDULER="fifo")
        yield fair, fifo


async def run(options: Options) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as logs:
        async with gateways(Path(logs), options) as (fair, fifo):
            every = {**dict.fromkeys((*QUIET, NOISY, CAPPED), 1.0), **WEIGHTED}
            loads = await make_keys(fair, every, {CAPPED: {"concurrent": capped_slots(options)}})
            quiet = [loads[name] for name in QUIET]
            rates = crowded_rates(options)
            points = [
                Point("quiet alone", fair, quiet, rates),
                Point("noisy, fifo", fifo, [*quiet, loads[NOISY]], rates),
                Point("noisy, fair", fair, [*quiet, loads[NOISY]], rates),
                Point("weights 1:2:4", fair, [loads[name] for name in WEIGHTED], {}),
            ]
            if options.bound:
                capped = rates | {CAPPED: rates[NOISY]}
                loads_then = [*quiet, loads[CAPPED]]
                points.append(Point(SPARE_POINT, fair, loads_then, capped, model=SPARE))
            results = []
            for point in points:
                for load in point.loads:
                    load.reset()
                results.append(await run_point(point, options))
    return {
        "machine": machine(),
        "options": {**vars(options), "out": str(options.out)},
        "capped_slots": capped_slots(options),
        "points": results,
    }


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 46's targets, each with what was measured."""
    points = {point["name"]: point for point in results["points"]}
    alone, fair, fifo = points["quiet alone"], points["noisy, fair"], points["noisy, fifo"]
    rows = []
    for name in QUIET:
        base, crowded = alone["keys"][name], fair["keys"][name]
        rows.append(
            {
                "target": f"{name}: TTFT p99 within +20% of alone",
                "measured": f"{crowded['ttft_p99_ms']} ms vs {base['ttft_p99_ms']} ms alone "
                f"(fifo: {fifo['keys'][name]['ttft_p99_ms']} ms)",
                "met": crowded["ttft_p99_ms"] <= 1.2 * base["ttft_p99_ms"],
            }
        )
        share = crowded["fair_share_tokens_per_s"]
        rows.append(
            {
                "target": f"{name}: tokens/s >= 0.95 of its fair share",
                "measured": f"{crowded['tokens_per_s']} of {share}",
                "met": crowded["tokens_per_s"] >= 0.95 * share,
            }
        )
    rows.append(
        {
            "target": "engine tokens/s >= 0.97 of FIFO's",
            "measured": f"{fair['tokens_per_s']} vs {fifo['tokens_per_s']}",
            "met": fair["tokens_per_s"] >= 0.97 * fifo["tokens_per_s"],
        }
    )
    weighted = points["weights 1:2:4"]["keys"]
    for name, weight in WEIGHTED.items():
        share = weighted[name]["share"] or 0.0
        rows.append(
            {
                "target": f"{name}: share within ±5% of {weight:g}/7",
                "measured": f"{share:.3f} (wanted {weight / 7:.3f})",
                "met": abs(share - weight / 7) <= 0.05 * weight / 7,
            }
        )
    return rows


def bound(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each quiet key's TTFT p99 when it never waits for a slot (``SPARE_POINT``), against
    alone: the least any scheduler gives it on this machine under this load."""
    points = {point["name"]: point for point in results["points"]}
    if SPARE_POINT not in points:
        return []
    alone, spare = points["quiet alone"]["keys"], points[SPARE_POINT]["keys"]
    rows = []
    for name in QUIET:
        base, best = alone[name]["ttft_p99_ms"], spare[name]["ttft_p99_ms"]
        rows.append(
            {
                "key": name,
                "ttft_p99_ms": best,
                "alone_ttft_p99_ms": base,
                "added": f"{100 * (best / base - 1):+.0f}%" if base else None,
                "within_20_percent": best <= 1.2 * base,
            }
        )
    return rows


def markdown(results: dict[str, Any]) -> str:
    o, m = results["options"], results["machine"]
    lines = [
        "# Many tenants on one engine (python -m bench.fairness)",
        "",
        f"{workers_line(o)}, replies of {o['reply_tokens']} tokens "
        "on average "
        f"at {o['tokens_per_s']:g} tokens/s each; quiet keys {o['quiet_rate']:g} requests/s "
        f"each, the noisy key ten times that; {o['seconds']:g} s a point after "
        f"{o['warmup_s']:g} s of warm-up. {m['nproc']} CPUs ({m['cpu_model']}), load "
        f"{m['loadavg_at_start']} at the start: the figures compare within this run.",
        "",
        "TTFT after a free slot: the part of a request's TTFT past the first slot the engine "
        "freed after it was sent (only requests that waited for one).",
        "",
        "| point | key | requests | TTFT p50 | TTFT p99 | after a free slot p50 / p99 "
        "| tokens/s | share | fair share tokens/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for point in results["points"]:
        for name, k in point["keys"].items():
            lines.append(
                f"| {point['name']} | {name} | {k['requests']} | {k['ttft_p50_ms']} ms "
                f"| {k['ttft_p99_ms']} ms | {k['after_free_slot_p50_ms']} / "
                f"{k['after_free_slot_p99_ms']} ms | {k['tokens_per_s']} | {k['share']} "
                f"| {k['fair_share_tokens_per_s']} |"
            )
        lines.append(f"| {point['name']} | **engine** | | | | | **{point['tokens_per_s']}** | | |")
    lines += ["", "| target | measured | met |", "| --- | --- | --- |"]
    lines += [
        f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |"
        for t in targets(results)
    ]
    if rows := bound(results):
        lines += [
            "",
            f"{SPARE_POINT}: the quiet keys on a worker with twice the slots, the noisy key "
            f"capped at {results['capped_slots']} concurrent generations (the "
            "slots they leave it): no quiet request waits for a slot, as with a scheduler that "
            "stops a noisy reply at once for it (the engine makes fewer tokens: the noisy "
            "key's refused requests make none). What remains is the path's own latency "
            "under that load: no scheduler takes it off.",
            "",
            "| key | TTFT p99, never waiting for a slot | alone | added | within +20% |",
            "| --- | --- | --- | --- | --- |",
            *(
                f"| {r['key']} | {r['ttft_p99_ms']} ms | {r['alone_ttft_p99_ms']} ms "
                f"| {r['added']} | {'yes' if r['within_20_percent'] else 'no'} |"
                for r in rows
            ),
        ]
    return "\n".join(lines) + "\n"


def workers_line(o: dict[str, Any]) -> str:
    """The engine side of a run, as its options say (a run from before an option was one
    worker without conversations)."""
    workers, conversations = o.get("workers", 1), o.get("conversations", 0)
    line = f"{workers} synthetic worker{'s' if workers > 1 else ''}: {o['capacity']} slots"
    if workers > 1:
        line += " each, cache affinity " + ("on" if o.get("affinity", True) else "off")
    if conversations:
        line += f"; each key's requests turns of its {conversations} conversations"
    return line


def plot(results: dict[str, Any], path: Path) -> None:
    plt = report.pyplot()
    fig, (ttft, shares) = plt.subplots(1, 2, figsize=(11, 4))
    points = [p for p in results["points"] if p["name"] != "weights 1:2:4"]
    width = 0.8 / len(points)
    for offset, point in enumerate(points):
        names = list(QUIET)
        values = [point["keys"][name]["ttft_p99_ms"] for name in names]
        where = [i + offset * width for i in range(len(names))]
        ttft.bar(where, values, width, label=point["name"])
    ttft.set_xticks(range(len(QUIET)), QUIET)
    ttft.set_ylabel("quiet key TTFT p99 (ms)")
    ttft.set_yscale("log")
    ttft.legend()
    weighted = next(p for p in results["points"] if p["name"] == "weights 1:2:4")["keys"]
    shares.bar(list(WEIGHTED), [weighted[n]["share"] for n in WEIGHTED], label="measured")
    shares.plot(list(WEIGHTED), [w / 7 for w in WEIGHTED.values()], "k_", ms=30, label="1:2:4")
    shares.set_ylabel("share of the tokens served")
    shares.legend()
    report.save(fig, path)


def parse(argv: list[str]) -> Options:
    return parse_options(Options, argv, "python -m bench.fairness", __doc__)


def main(argv: list[str] | None = None) -> None:
    options = parse(sys.argv[1:] if argv is None else argv)
    results = stuck.run(run(options))
    results["targets"] = targets(results)
    results["bound"] = bound(results)
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
        options.out.with_suffix(".md").write_text(markdown(results))
        plot(results, options.out.with_suffix(".png"))
        print(f"[fairness] results in {options.out}.json, .md, .png")
    print(markdown(results))


if __name__ == "__main__":
    main()
