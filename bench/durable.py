"""``python -m bench.durable``: what keeping a request's submit costs
(``TOKENSPOUT_WAIT_REPLICAS``, ``TOKENSPOUT_WAIT_AOF``: gateway/core/store/durable.py).

One Redis primary with AOF (``appendfsync everysec``, as compose.yaml runs it) and a
replica, one synthetic worker unpaced, and three gateways on them: ``plain`` (Redis's own
acknowledgement), ``wait replica`` (``WAIT 1``) and ``wait aof`` (``WAITAOF 1 0``). In
turns for ``--rounds``, each sends ``--requests`` whole one-token chat completions,
``--concurrency`` at a time on kept-alive connections, and the session turns the same way
(a message, then its reply read to its end); per side: requests/s, latency p50 and p99,
and the CPU each gateway and the primary spent per request (from /proc). Results:
docs/bench/durable.json and durable.md.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import httpx

from bench import report, stats
from stack.redis_server import EmbeddedRedis, free_port
from stack.rig import Rig

ROOT = Path(__file__).resolve().parent.parent
SIDES = {
    "plain": {},
    "wait replica": {"TOKENSPOUT_WAIT_REPLICAS": "1"},
    "wait aof": {"TOKENSPOUT_WAIT_AOF": "1"},
}


def say(message: str) -> None:
    print(f"[bench.durable] {message}", flush=True)


async def one_shot(client: httpx.AsyncClient, url: str) -> None:
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    answer = await client.post(f"{url}/v1/chat/completions", json=body)
    answer.raise_for_status()


async def session_turn(client: httpx.AsyncClient, url: str) -> None:
    made = (await client.post(f"{url}/v1/sessions")).json()
    headers = {"X-Session-Token": made["token"]}
    sent = await client.post(
        f"{url}/v1/sessions/{made['session_id']}/messages",
        json={"content": "hi", "max_tokens": 1},
        headers=headers,
    )
    sent.raise_for_status()
    async with client.stream(
        "GET", f"{url}/v1/sessions/{made['session_id']}/events", headers=headers
    ) as events:
        async for line in events.aiter_lines():
            if line.startswith("event: done"):
                return


async def side(
    url: str, kind: str, requests: int, concurrency: int, pids: dict[str, int]
) -> dict[str, Any]:
    call = one_shot if kind == "one-shot" else session_turn
    latencies: list[float] = []
    left = iter(range(requests))

    async def sender(client: httpx.AsyncClient) -> None:
        for _ in left:
            began = time.perf_counter()
            await call(client, url)
            latencies.append(time.perf_counter() - began)

    before = stats.cpu_of(pids)
    began = time.perf_counter()
    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(sender(client) for _ in range(concurrency)))
    wall = time.perf_counter() - began
    after = stats.cpu_of(pids)
    return {
        "requests_per_s": requests / wall,
        "p50_ms": stats.ms(stats.pct(latencies, 50)),
        "p99_ms": stats.ms(stats.pct(latencies, 99)),
        "cpu_us_per_request": {
            name: (after[name] - before[name]) / requests * 1e6 for name in pids
        },
    }


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    primary = EmbeddedRedis(data_dir=args.logs / "primary", persist=True)
    replica = EmbeddedRedis(
        data_dir=args.logs / "replica", extra_args=["--replicaof", "127.0.0.1", str(primary.port)]
    )
    for server in (primary, replica):
        server.data_dir.mkdir(parents=True, exist_ok=True)
    with primary, replica:
        rig = Rig(primary.url, "durable", args.logs)
        try:
            rig.synthetic(0, "--capacity", "64")
            gateways = {name: rig.gateway(free_port(), **env) for name, env in SIDES.items()}
            results: dict[str, Any] = {"machine": stats.machine(), "rounds": []}
            for round_ in range(args.rounds):
                for kind in ("one-shot", "session turn"):
                    for name, gateway in gateways.items():
                        assert primary.process is not None
                        pids = {"gateway": gateway.process.pid, "redis": primary.process.pid}
                        figures = await side(
                            gateway.url, kind, args.requests, args.concurrency, pids
                        )
                        say(
                            f"round {round_ + 1} {kind} {name}: {figures['p50_ms']:.2f} ms "
                            f"p50, {figures['requests_per_s']:.0f}/s"
                        )
                        results["rounds"].append(
                            {"round": round_, "kind": kind, "side": name, **figures}
                        )
            return results
        finally:
            rig.stop()


def markdown(results: dict[str, Any]) -> str:
    rows = [
        "| request | side | requests/s | p50 ms | p99 ms | gateway CPU µs/request "
        "| Redis CPU µs/request |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in results["rounds"]:
        cpu = row["cpu_us_per_request"]
        rows.append(
            f"| {row['kind']} (round {row['round'] + 1}) | {row['side']} | "
            f"{report.fmt(row['requests_per_s'], 0)} | {report.fmt(row['p50_ms'], 2)} | "
            f"{report.fmt(row['p99_ms'], 2)} | {report.fmt(cpu['gateway'], 0)} | "
            f"{report.fmt(cpu['redis'], 0)} |"
        )
    return (
        "# Keeping submits: WAIT and WAITAOF\n\n"
        + __doc__.split("\n\n", 1)[1]
        + "\n"
        + ("\n".join(rows) + "\n")
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.durable", description=__doc__)
    parser.add_argument("--requests", type=int, default=600, help="per side, kind and round")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench")
    parser.add_argument("--name", default="durable")
    parser.add_argument("--logs", type=Path, default=None)
    report.run(parser.parse_args(), measure, markdown, say)
