"""The fault schedule of a chaos run, drawn from its seed, and the faults that are not a
signal to a process: bursts of hostile input and slow readers.

Every fault kind comes round in turn (shuffled anew each round), one every 1 to 3 s, so a
run of a few minutes injects each kind many times and a short one still injects each kind
at least once."""

from __future__ import annotations

import asyncio
import random
import secrets
from dataclasses import dataclass

from websockets.asyncio.client import connect

from bench.chaos.clients import BROKEN, Context
from bench.chaos.fleet import Fleet
from bench.chaos.network import HOWS, Cut

PROCESS = [
    "worker_kill",
    "worker_term",
    "worker_stop",
    "gateway_kill",
    "gateway_term",
    "gateway_stop",
    "gateway_process_kill",
]
PARTITIONS = [f"{side}_{how}" for side in ("worker", "gateway", "client") for how in HOWS]
"""A worker's or a gateway's links to Redis, or the clients' links to a gateway, cut as
bench/chaos/network.py says."""
COMMON = [*PROCESS, *PARTITIONS, "redis_pause", "redis_full", "slow_readers", "hostile_burst"]
KINDS = {
    "single": [*COMMON, "redis_restart", "redis_crash", "redis_wipe"],
    "volatile": [*COMMON, "redis_wipe"],
    "cluster": [*COMMON, "primary_kill"],
    "sentinel": [*COMMON, "sentinel_failover"],
}
GAP_S = (0.6, 2.0)
"""Between two faults: every kind (some 30) comes round about every 40 s."""
PAUSE_S = {"sentinel": (0.3, 0.8)}
"""A pause's length on a Redis kind, if not 0.5 to 3 s. Sentinel calls a primary that
pauses its writes past ``down-after-milliseconds`` (1 s here) down and fails over, and
two primaries then take writes until it is converted (measured: still two after 9 s):
that is a failover, ``sentinel_failover``'s part, with a split brain no client of Redis
can be kept from losing writes in (docs/reliability.md)."""
CLIENT_SHARE = (0.3, 1.0)
"""Of the clients' links to a gateway, the share a client partition strikes."""


@dataclass(frozen=True)
class Planned:
    at_s: float
    kind: str
    pick: int
    """Which target, as an index taken modulo the candidates when the fault fires."""
    held_s: float
    cut: Cut | None = None
    """A partition's: how, how long, how late (bench/chaos/network.py)."""
    share: float = 1.0


def schedule(seed: int, redis_kind: str, duration_s: float) -> list[Planned]:
    rng = random.Random(f"faults-{seed}")
    planned: list[Planned] = []
    at = 2.0
    kinds: list[str] = []
    while at < duration_s - 2:
        if not kinds:
            kinds = list(KINDS[redis_kind])
            rng.shuffle(kinds)
        kind = kinds.pop()
        held = {
            "worker_stop": rng.uniform(1.0, 8.0),  # past the 5 s worker timeout at times
            "gateway_stop": rng.uniform(1.0, 6.0),
            "redis_pause": rng.uniform(*PAUSE_S.get(redis_kind, (0.5, 3.0))),
            "redis_full": rng.uniform(0.5, 3.0),
            "redis_restart": rng.uniform(0.5, 2.0),
            "redis_crash": rng.uniform(0.5, 2.0),
            "redis_wipe": rng.uniform(0.5, 2.0),
        }.get(kind, 0.0)
        side, _, how = kind.partition("_")
        cut = Cut.draw(how, rng) if kind in PARTITIONS else None
        share = rng.uniform(*CLIENT_SHARE) if side == "client" else 1.0
        planned.append(Planned(round(at, 2), kind, rng.randrange(1 << 16), held, cut, share))
        at += rng.uniform(*GAP_S)
    return planned


async def hostile_burst(ctx: Context, fleet: Fleet, rng: random.Random) -> list[str]:
    """Bad requests at one replica, sent with one of the run's keys (so they reach what
    they test) but one with a key nobody made: each must get a 4xx (or a 503 with
    ``Retry-After`` while Redis is away), never another 5xx and never a hang."""
    url = rng.choice(ctx.urls)
    key = rng.choice(fleet.api_keys)
    fleet.note("hostile_burst", url.rsplit(":", 1)[1])
    unknown = secrets.token_hex(8)
    finished = rng.choice(ctx.finished) if ctx.finished else None
    requests: list[tuple[str, str, dict[str, object]]] = [
        (
            "POST",
            "/v1/chat/completions",
            {"content": b"{not json", "headers": {"content-type": "application/json"}},
        ),
        ("POST", "/v1/chat/completions", {"json": {"model": "alpha", "messages": "nope"}}),
        (
            "POST",
            "/v1/chat/completions",
            {"json": {"model": "nobody", "messages": [{"role": "user", "content": "x"}]}},
        ),
        ("POST", "/v1/completions", {"content": b"x" * 300_000}),
        ("POST", f"/v1/sessions/{unknown}/messages", {"json": {"content": "hi"}}),
        ("GET", f"/v1/sessions/{unknown}/events", {}),
        (
            "POST",
            "/v1/responses",
            {"json": {"model": "alpha", "input": [], "max_output_tokens": -1}},
        ),
        ("GET", f"/v1/responses/resp_{unknown}", {}),
        (
            "POST",
            "/v1/chat/completions",
            {
                "json": {"model": "alpha", "messages": [{"role": "user", "content": "x"}]},
                "headers": {"Authorization": f"Bearer tsk_{unknown}"},
            },
        ),
    ]
    if finished is not None:
        sid, token, gid = finished
        requests.append(
            (
                "POST",
                f"/v1/sessions/{sid}/generations/{gid}/cancel",
                {"headers": {"X-Session-Token": token}},
            )
        )
    problems: list[str] = []
    for method, path, options in requests:
        headers = {**key.bearer, **options.pop("headers", {})}  # type: ignore[dict-item]
        try:
            response = await ctx.http.request(method, url + path, headers=headers, **options)  # type: ignore[arg-type]
        except BROKEN:
            continue  # that replica is down or being replaced: nothing to judge
        if response.status_code >= 500 and not (
            response.status_code == 503 and "retry-after" in response.headers
        ):
            problems.append(f"{method} {path}: {response.status_code} {response.text[:200]}")
    try:
        async with connect(url.replace("http://", "ws://") + "/v1/ws", open_timeout=5) as ws:
            for frame in ('{"type": "generate"}', "[1, 2", '{"type": "cancel", "id": "nope"}'):
                await ws.send(frame)
                answer = await asyncio.wait_for(ws.recv(), 10)
                if '"type":"error"' not in str(answer).replace(" ", ""):
                    problems.append(f"WebSocket {frame!r}: {answer!r}")
    except BROKEN:
        pass
    return problems
