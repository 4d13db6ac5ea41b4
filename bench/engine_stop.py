"""``python -m bench.gpu``'s stops: a stream the client closes, and a worker killed.

**Cancels**, on each side alike: one streamed chat completion at a time, its connection
closed by the client as the ``after``-th token arrives; then the engine's running requests
are read from its ``/metrics`` until they are 0 (vLLM's server: ``vllm:num_requests_running``;
the stack: the worker's ``tokenspout_engine_generations_running``, a generation leaving it
once vLLM has ended the request and the worker its reply). Measured: from the close to the
first read of 0 (an upper bound: the read's own round trip, ``poll_ms``, is the resolution),
and the tokens the engine made past those the client read (vLLM's
``vllm:generation_tokens``; the worker's tokens published plus those made after the cancel).

**Kill** (the stack only: a second worker must take the reply over): bench/takeover.py's
``sigkill`` run on vLLM workers: a second worker started beside the first, a reply streamed
over the session API, the worker running it SIGKILLed after ``tokens_before`` tokens; the
time from the kill to the next token at the reader.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any, ClassVar

import httpx

from bench import takeover
from bench.loadgen import OpenAIStream, StreamRecord, open_stream, sse_request
from bench.stats import metrics_of, ms, pct, summed
from bench.vllm_sides import StackSide, Target, say
from stack.rig import HOST

IDLE_S = 120.0
"""The longest the engine may take to end its requests before a cancel is measured."""


class ClosingStream(OpenAIStream):
    """An OpenAI stream whose client closes the connection as its ``after``-th token
    arrives (``closed_at``: just before it closes)."""

    after: ClassVar[int] = 16
    closed_at = 0.0

    def on_frame(self, frame: bytes, now: float) -> None:
        if self.closed_at:  # a later frame of the read that brought the last one
            return
        super().on_frame(frame, now)
        if len(self.record.arrivals) >= self.after:
            self.closed_at = time.perf_counter()
            self.close()


def closing_after(tokens: int) -> type[ClosingStream]:
    return type(f"ClosingAfter{tokens}", (ClosingStream,), {"after": tokens})


async def running(http: httpx.AsyncClient, target: Target) -> float:
    return summed(await metrics_of(target.metrics_url, http), target.running_metric)


async def tokens_made(http: httpx.AsyncClient, target: Target) -> float:
    samples = await metrics_of(target.metrics_url, http)
    return sum(summed(samples, name) for name in target.token_metrics)


async def idle(http: httpx.AsyncClient, target: Target) -> None:
    deadline = time.monotonic() + IDLE_S
    while await running(http, target):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{target.name}: the engine still runs requests after {IDLE_S} s")
        await asyncio.sleep(0.05)


async def cancel_once(
    http: httpx.AsyncClient, target: Target, body: bytes, after: int
) -> dict[str, Any]:
    await idle(http, target)
    made = await tokens_made(http, target)
    record = StreamRecord()
    request = sse_request(HOST, target.port, "/v1/chat/completions", {}, body)
    stream = await open_stream(HOST, target.port, request, record, closing_after(after))
    assert isinstance(stream, ClosingStream) and record.finished is not None
    await record.finished
    if not stream.closed_at:
        raise RuntimeError(
            f"{target.name}: the stream ended after {len(record.arrivals)} tokens, before"
            f" {after}: {record.final or record.failure}"
        )
    polls = 0
    while True:
        sent = time.perf_counter()
        left = await running(http, target)
        read, polls = time.perf_counter(), polls + 1
        if not left:
            break
        if read - stream.closed_at > IDLE_S:
            raise TimeoutError(f"{target.name}: the engine still runs {left} after the close")
        await asyncio.sleep(0.002)
    return {
        "after_tokens": after,
        "read_tokens": len(record.arrivals),
        "stop_ms": ms(read - stream.closed_at),
        "poll_ms": ms(read - sent),
        "polls": polls,
        "tokens_past_read": round(await tokens_made(http, target) - made - len(record.arrivals)),
    }


async def cancels(target: Target, body: bytes, count: int, after: int) -> dict[str, Any]:
    """``count`` streams closed after ``after`` tokens each, one at a time, on ``target``."""
    async with httpx.AsyncClient(timeout=60) as http:
        rows = [await cancel_once(http, target, body, after) for _ in range(count)]
    stops = [row["stop_ms"] for row in rows]
    past = [row["tokens_past_read"] for row in rows]
    return {
        "cancels": len(rows),
        "after_tokens": after,
        "stop_ms": {
            "p50": round(statistics.median(stops), 2),
            "p99": pct(stops, 99),
            "max": max(stops),
        },
        "poll_ms_p50": round(statistics.median(row["poll_ms"] for row in rows), 2),
        "tokens_past_read": {"total": sum(past), "max": max(past)},
        "runs": rows,
    }


async def kills(
    side: StackSide, worker_args: list[str], runs: int, tokens_before: int
) -> dict[str, Any]:
    """``runs`` kills of the worker running a reply, each with a second worker started
    first; the side's first worker may be the one killed, so this comes last."""
    rig = takeover.Rig(side.procs, worker_args)
    rig.workers[side.worker_id] = side.worker
    asked = {"ignore_eos": True, "temperature": 0}
    gaps = []
    try:
        async with httpx.AsyncClient(timeout=IDLE_S) as client:
            for n in range(runs):
                say(f"kill {n + 1}/{runs}: starting a second worker to take the reply over")
                began = time.monotonic()
                await rig.start_worker()
                say(f"kill {n + 1}/{runs}: second worker ready in {time.monotonic() - began:.1f} s")
                gap = await takeover.one_run(
                    rig, client, side.gateway_url(), "sigkill", asked, tokens_before
                )
                say(f"kill {n + 1}/{runs}: the next token came {gap * 1000:.0f} ms after the kill")
                gaps.append(gap)
    finally:
        await rig.redis.aclose()
    return {"tokens_before": tokens_before, **takeover.summary(gaps)}
