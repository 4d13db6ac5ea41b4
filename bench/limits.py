"""``python -m bench.limits``: a key limited to ``--rpm`` requests a minute, sending through
two gateways, gets that many in a minute.

Two gateway processes on one Redis (the embedded one), the synthetic engine unpaced, and a
key made through the admin API with only ``requests_per_minute`` set. ``--clients`` loops,
half on each gateway, send one-shot chat completions (one token) for ``--minutes``
minutes as fast as the limit lets them: each refusal waits a random 0 to ``--pause-ms``
before the next try (far more tries than the limit admits, all the time). Every request's
send time, gateway and answer are kept, and the key's admission log in Redis (each
admitted request by the millisecond of Redis's clock, kept a minute) is read every 5 s;
from them:

- per whole minute from the first send: requests served (through each gateway), refused;
- the most admitted in any 60 s window on Redis's clock (the limit's own window, exact),
  and per whole minute of it;
- each refusal's ``Retry-After`` against the requests sent after it and served.

Results: docs/bench/limits.json and limits.md.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import random
import secrets
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench import report, stats
from stack.rig import on_embedded_redis
from wire import Keys

ROOT = Path(__file__).resolve().parent.parent
ADMIN_KEY = f"bench-admin-{secrets.token_hex(8)}"
WINDOW_S = 60.0


def say(message: str) -> None:
    print(f"[bench.limits] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Try:
    sent: float
    """Unix seconds, just before the request left."""
    answered: float
    """Unix seconds, when its answer had arrived (its admission was in between)."""
    gateway: int
    status: int
    retry_after_s: int | None


async def client_loop(
    client: httpx.AsyncClient, url: str, gateway: int, secret: str, until: float, pause_ms: int
) -> list[Try]:
    body = {
        "model": "synthetic",
        "messages": [{"role": "user", "content": "limit"}],
        "max_tokens": 1,
    }
    headers = {"Authorization": f"Bearer {secret}"}
    tries: list[Try] = []
    while time.time() < until:
        sent = time.time()
        answer = await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        retry = answer.headers.get("retry-after")
        status, retry_s = answer.status_code, int(retry) if retry else None
        tries.append(Try(sent, time.time(), gateway, status, retry_s))
        if answer.status_code == 429:
            await asyncio.sleep(random.uniform(0, pause_ms / 1000))
        elif answer.status_code != 200:
            raise RuntimeError(f"gateway {gateway} answered {answer.status_code}: {answer.text}")
    return tries


def most_in_a_window(served: list[float]) -> int:
    """The most served in any 60 s window (each starting at a served request)."""
    return max(
        (bisect.bisect_left(served, start + WINDOW_S) - i for i, start in enumerate(served)),
        default=0,
    )


def analyse(
    tries: list[Try], admitted: list[float], began: float, minutes: int, rpm: int
) -> dict[str, Any]:
    """``admitted``: the admissions' times on Redis's clock (unix seconds), sorted."""
    per_minute = []
    for minute in range(minutes):
        start, end = began + minute * WINDOW_S, began + (minute + 1) * WINDOW_S
        inside = [t for t in tries if start <= t.sent < end]
        per_minute.append(
            {
                "minute": minute + 1,
                "served": sum(t.status == 200 for t in inside),
                "served_per_gateway": [
                    sum(t.status == 200 and t.gateway == g for t in inside) for g in (0, 1)
                ],
                "refused": sum(t.status == 429 for t in inside),
            }
        )
    first = admitted[0] if admitted else began
    latency = [t.answered - t.sent for t in tries]
    refusals = [t for t in tries if t.status == 429 and t.retry_after_s is not None]
    return {
        "limit": rpm,
        "tries": len(tries),
        "served": sum(t.status == 200 for t in tries),
        "per_minute": per_minute,
        "admitted_in_redis": len(admitted),
        "window_most_on_redis_clock": most_in_a_window(admitted),
        "per_minute_on_redis_clock": [
            sum(first + m * WINDOW_S <= a < first + (m + 1) * WINDOW_S for a in admitted)
            for m in range(minutes)
        ],
        "refusals_with_retry_after": len(refusals),
        "served_over_1s_before_a_retry_after": early_retries(tries, refusals),
        "latency_p50_ms": stats.ms(stats.pct(latency, 50)),
        "latency_p99_ms": stats.ms(stats.pct(latency, 99)),
    }


def early_retries(tries: list[Try], refusals: list[Try]) -> int:
    """Refusals whose ``Retry-After`` was wrong. A request sent after a refusal's answer was
    admitted after the refusal was decided: its answer comes no sooner than the refusal's
    send plus its ``Retry-After``, less the second it rounds up by."""
    by_send = sorted((t.sent, t.answered) for t in tries if t.status == 200)
    sends = [sent for sent, _ in by_send]
    soonest_after = [0.0] * len(by_send)  # the soonest answer of those sent from i on
    soonest = float("inf")
    for i in range(len(by_send) - 1, -1, -1):
        soonest = min(soonest, by_send[i][1])
        soonest_after[i] = soonest
    early = 0
    for refusal in refusals:
        after = bisect.bisect_right(sends, refusal.answered)
        retry_s = refusal.retry_after_s or 0
        if after < len(by_send) and soonest_after[after] < refusal.sent + retry_s - 1:
            early += 1
    return early


async def read_log(redis_url: str, log: str, into: dict[bytes, float], until: float) -> None:
    """The key's admission log (members by the millisecond), read every 5 s until ``until``
    and once more: every admission stays in it a minute, so none is missed."""
    redis = aioredis.Redis.from_url(redis_url)
    try:
        while True:
            last = time.time() >= until
            into.update(await redis.zrange(log, 0, -1, withscores=True))
            if last:
                return
            await asyncio.sleep(5)
    finally:
        await redis.aclose()


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    env = {"TOKENSPOUT_ADMIN_KEY": ADMIN_KEY, "TOKENSPOUT_LOG_LEVEL": "WARNING"}
    with on_embedded_redis(args.logs, f"bl-{secrets.token_hex(4)}", env) as (rig, _):
        rig.synthetic(0)
        gateways = [rig.gateway(), rig.gateway()]
        async with httpx.AsyncClient(timeout=30) as client:
            made = await client.post(
                f"{gateways[0].url}/v1/admin/keys",
                json={"name": "bench", "limits": {"requests_per_minute": args.rpm}},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
            made.raise_for_status()
            secret = made.json()["key"]
            await asyncio.sleep(1.0)  # every gateway reads the keys every 250 ms
            began = time.time()
            until = began + args.minutes * WINDOW_S
            say(f"{args.clients} clients for {args.minutes} min, limit {args.rpm}/min")
            log = Keys(rig.prefix).tenant(made.json()["id"], "requests")
            admissions: dict[bytes, float] = {}
            reading = asyncio.create_task(read_log(rig.redis_url, log, admissions, until))
            loops = [
                client_loop(client, gateways[i % 2].url, i % 2, secret, until, args.pause_ms)
                for i in range(args.clients)
            ]
            tries = [t for part in await asyncio.gather(*loops) for t in part]
            await reading
    admitted = sorted(ms / 1000 for ms in admissions.values())
    return {
        "machine": stats.machine(),
        "settings": {
            "rpm": args.rpm,
            "minutes": args.minutes,
            "clients": args.clients,
            "pause_ms": args.pause_ms,
            "gateways": 2,
        },
        **analyse(tries, admitted, began, args.minutes, args.rpm),
    }


def markdown(results: dict[str, Any]) -> str:
    s = results["settings"]
    rows = [
        f"| {m['minute']} | {m['served']} | {m['served_per_gateway'][0]} |"
        f" {m['served_per_gateway'][1]} | {m['refused']:,} |"
        for m in results["per_minute"]
    ]
    machine = results["machine"]
    return (
        "# A key's requests per minute across two gateways\n\n"
        f"`python -m bench.limits`: a key limited to {s['rpm']} requests a minute;"
        f" {s['clients']} clients, half on each of {s['gateways']} gateway processes (one"
        " Redis), send one-token chat completions for"
        f" {s['minutes']} minutes, each refusal followed by a random pause of 0 to"
        f" {s['pause_ms']} ms ({results['tries']:,} tries in all). Minutes count from the"
        " first send.\n\n"
        "| minute | served | via gateway 1 | via gateway 2 | refused (429) |\n"
        "| --- | --- | --- | --- | --- |\n" + "\n".join(rows) + "\n\n"
        "On Redis's clock (the key's admission log, read every 5 s:"
        f" {results['admitted_in_redis']} admissions, {results['served']} served): the most"
        f" admitted in any 60 s window {results['window_most_on_redis_clock']} (the limit:"
        f" {results['limit']}); per whole minute from the first admission"
        f" {', '.join(map(str, results['per_minute_on_redis_clock']))}. The clients' minutes"
        " above count by send time, which precedes an admission by up to a request's latency"
        f" (p50 {results['latency_p50_ms']:.0f} ms, p99 {results['latency_p99_ms']:.0f} ms)."
        f" Of {results['refusals_with_retry_after']:,} refusals, each with `Retry-After`,"
        f" {results['served_over_1s_before_a_retry_after']} saw a request sent after it"
        " served more than a second (its rounding up) before their `Retry-After` said.\n\n"
        f"Machine: {machine['cpu_model']}, {machine['nproc']} cores.\n"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.limits", description=__doc__)
    parser.add_argument("--rpm", type=int, default=60, help="the key's requests per minute")
    parser.add_argument("--minutes", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8, help="half on each gateway")
    parser.add_argument("--pause-ms", type=int, default=200, help="most a refusal waits")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="limits", help="file names: NAME.json, NAME.md")
    parser.add_argument("--logs", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    report.run(parse_args(argv), measure, markdown, say)


if __name__ == "__main__":
    main()
