"""``bench.e2e --cancels N``: how fast a cancel stops a generation, on the bench rig.

N generations over one WebSocket, each cancelled after 3 to 10 tokens, alternately with a
WebSocket ``cancel`` frame (``ws``) and ``POST .../cancel`` (``rest``). For each:

- latency: from sending the cancel to the ``cancelled`` frame reaching the client;
- the tokens the engine made after the worker received the cancel (the worker's
  ``tokenspout_engine_tokens_after_cancel`` counter; never delivered);
- the tokens delivered after ``cancelled``: on the socket, and in the session's Redis stream.

One generation first, not counted: a fresh engine's first request pays for its warm-up.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect

from bench.rig import Rig
from bench.stats import metrics_of, pct
from stack.rig import HOST
from wire import Keys, entries_of

AFTER_CANCEL = "tokenspout_engine_tokens_after_cancel_total"
RUNNING = "tokenspout_engine_running"
MAX_TOKENS = 400
"""Past any cancel point: every generation is still running when its cancel goes."""
FRAME_WAIT_S = 60.0
"""The longest wait for one frame (vLLM on a busy CPU: a first token within seconds)."""
ENDS = {"done", "cancelled", "error"}


async def worker_metric(http: httpx.AsyncClient, rig: Rig, name: str) -> float:
    return (await metrics_of(rig.worker_metrics, http))[name]


async def frame_of(ws: ClientConnection, cid: str) -> dict[str, Any]:
    """The next frame of generation ``cid``."""
    while True:
        frame: dict[str, Any] = json.loads(await ws.recv())
        if frame.get("id") == cid:
            return frame


async def wait_for_frame(
    ws: ClientConnection, cid: str, kind: str, min_count: int = 0
) -> dict[str, Any]:
    """The first frame of ``cid`` of type ``kind`` (a ``token`` frame: with ``count`` at
    least ``min_count``). A generation that ends or is refused first, or sends nothing
    more for ``FRAME_WAIT_S``, is an error that names the frame it sent instead."""
    last: dict[str, Any] | None = None
    try:
        async with asyncio.timeout(FRAME_WAIT_S):
            while True:
                last = frame = await frame_of(ws, cid)
                if frame["type"] == kind and frame.get("count", 0) >= min_count:
                    return frame
                if frame["type"] in ENDS:
                    raise AssertionError(f"{cid}: waiting for {kind!r}, it sent {frame}")
    except TimeoutError:
        raise AssertionError(
            f"{cid}: no {kind!r} frame in {FRAME_WAIT_S:g} s; the last one: {last}"
        ) from None


async def one(
    rig: Rig, ws: ClientConnection, http: httpx.AsyncClient, cid: str, via: str, after: int
) -> dict[str, Any]:
    asked = {"type": "generate", "id": cid, "content": rig.prompt}
    await ws.send(json.dumps(asked | {"max_tokens": MAX_TOKENS, "temperature": 0}))
    ack = await wait_for_frame(ws, cid, "ack")
    await wait_for_frame(ws, cid, "token", min_count=after)
    before = await worker_metric(http, rig, AFTER_CANCEL)
    started = time.perf_counter()
    if via == "ws":
        await ws.send(json.dumps({"type": "cancel", "id": cid}))
        posted = None
    else:
        generation = f"/v1/sessions/{ack['session_id']}/generations/{ack['generation_id']}"
        url = f"http://{HOST}:{rig.gateway_port}{generation}/cancel"
        posted = asyncio.create_task(http.post(url, headers={"X-Session-Token": ack["token"]}))
    frame = await wait_for_frame(ws, cid, "cancelled")
    latency = time.perf_counter() - started
    if posted is not None:
        assert (await posted).status_code == 200
    async with asyncio.timeout(60):  # the engine idle again: its count is final
        while await worker_metric(http, rig, RUNNING):
            await asyncio.sleep(0.1)
    late = 0
    try:
        while True:
            late += (await asyncio.wait_for(frame_of(ws, cid), 0.3))["type"] == "token"
    except TimeoutError:
        pass
    redis = rig.servers["redis"].client
    events = entries_of(await redis.xrange(Keys(rig.prefix).events(ack["session_id"])))
    ours = str(ack["generation_id"]).encode()
    kinds = [fields[b"t"] for _id, fields in events if fields[b"g"] == ours]
    return {
        "via": via,
        "cancel_after_tokens": after,
        "latency_ms": round(latency * 1000, 2),
        "completion_tokens": frame["usage"]["completion_tokens"],
        "engine_tokens_after_cancel": int(await worker_metric(http, rig, AFTER_CANCEL) - before),
        "tokens_delivered_after_cancelled": late + len(kinds) - 1 - kinds.index(b"cancelled"),
    }


async def measure(rig: Rig, cancels: int) -> dict[str, Any]:
    """``cancels`` cancelled generations on ``rig`` (one Redis), and their summary."""
    rows = []
    url = f"ws://{HOST}:{rig.gateway_port}/v1/ws"
    async with httpx.AsyncClient(timeout=60) as http, connect(url, max_size=None) as ws:
        await one(rig, ws, http, "warm-up", "ws", 3)
        for n in range(cancels):
            rows.append(await one(rig, ws, http, f"c{n}", ("ws", "rest")[n % 2], 3 + n % 8))
    return summary(rows)


def latency(rows: list[dict[str, Any]]) -> dict[str, float | int | None]:
    values = [row["latency_ms"] for row in rows]
    return {
        "p50": round(statistics.median(values), 1) if values else None,
        "p99": round(pct(values, 99) or 0.0, 1) if values else None,
        "max": max(values, default=None),
        "n": len(values),
    }


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    waste = [row["engine_tokens_after_cancel"] for row in rows]
    return {
        "cancels": len(rows),
        "latency_ms": {
            "all": latency(rows),
            **{via: latency([r for r in rows if r["via"] == via]) for via in ("ws", "rest")},
        },
        "engine_tokens_after_cancel": {
            "total": sum(waste),
            "max": max(waste, default=0),
            "mean": round(statistics.fmean(waste), 2) if waste else 0,
        },
        "tokens_delivered_after_cancelled": sum(
            row["tokens_delivered_after_cancelled"] for row in rows
        ),
        "runs": rows,
    }


def markdown(s: dict[str, Any]) -> list[str]:
    waste = s["engine_tokens_after_cancel"]
    return [
        f"{s['cancels']} generations over the WebSocket, each cancelled after 3 to 10 tokens, "
        "alternately with a WebSocket `cancel` frame (`ws`) and `POST .../cancel` (`rest`). "
        "Latency: from sending the cancel to the `cancelled` frame reaching the client "
        "(nearest-rank percentiles: with 20 samples p99 is the largest).",
        "",
        "| cancel via | n | p50 ms | p99 ms | max ms |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {via} | {v['n']} | {v['p50']} | {v['p99']} | {v['max']} |"
            for via, v in s["latency_ms"].items()
        ),
        "",
        "Tokens the engine made after the worker received the cancel (never delivered; the "
        f"worker's `tokenspout_engine_tokens_after_cancel`): total {waste['total']}, at most "
        f"{waste['max']} for one cancel, {waste['mean']} on average. Tokens delivered to a "
        "client after `cancelled` (on the socket or in the session's Redis stream): "
        f"{s['tokens_delivered_after_cancelled']}.",
    ]
