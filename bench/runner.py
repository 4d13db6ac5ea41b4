"""One measured run on the bench rig (bench/rig.py): N streams of one path started on one
schedule, every token's arrival recorded, and what each process and Redis spent meanwhile.

The paths (``MODES``):

- ``engine``: ``POST /v1/chat/completions`` (``stream: true``) on the engine alone;
- ``openai``: the same request on the gateway (one request = one stateless session);
- ``session``: ``POST /v1/sessions`` beforehand (not timed), its SSE stream
  ``GET /v1/sessions/{id}/events`` opened (``fanout`` readers of it), then
  ``POST /v1/sessions/{id}/messages`` (timed from here);
- ``grpc``: the KServe v2 / Triton ``ModelStreamInfer``, one call per stream, all on one
  channel (bench/grpc_stream.py);
- ``responses``: ``POST /v1/responses`` (``stream: true``), one stored response each;
- ``ws``: ``WS /v1/ws``, one socket per stream and one ``generate`` frame (which also makes
  the session), timed from just before the socket opens.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import WebSocketException

from bench.grpc_stream import open_grpc_stream, stream_request
from bench.loadgen import (
    TERMINAL,
    OpenAIStream,
    ResponsesStream,
    SSEStream,
    StreamRecord,
    TaskStream,
    open_stream,
    sse_request,
)
from bench.rig import Rig
from bench.stats import Run, command_stats, cpu_of, worker_ttft
from stack.rig import HOST

MODES = ("engine", "openai", "session", "grpc", "responses", "ws")


def chat_body(rig: Rig, max_tokens: int, top_logprobs: int | None = None) -> bytes:
    """A streamed chat completion of ``rig``'s prompt, greedy (vLLM: the same tokens on
    every path)."""
    extra = {} if top_logprobs is None else {"logprobs": True, "top_logprobs": top_logprobs}
    return chat_request(rig.model, rig.prompt, max_tokens, **extra)


def chat_request(model: str, prompt: str, max_tokens: int, **extra: object) -> bytes:
    """The body of a streamed, greedy chat completion of ``prompt`` (usage at the end),
    with ``extra`` fields (``ignore_eos``, ``logprobs``...)."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body | extra).encode()


async def create_session(rig: Rig) -> tuple[str, str]:
    status, body = await rig.posts.post("/v1/sessions", b"{}", {})
    if status not in (200, 201):
        raise RuntimeError(f"POST /v1/sessions answered {status}: {body[:200]!r}")
    created = json.loads(body)
    return created["session_id"], created["token"]


async def open_events(rig: Rig, session: tuple[str, str], record: StreamRecord) -> Any:
    """A session's SSE stream, open (its headers read) when this returns."""
    sid, token = session
    path = f"/v1/sessions/{sid}/events"
    request = sse_request(HOST, rig.gateway_port, path, {"X-Session-Token": token})
    reader = await open_stream(HOST, rig.gateway_port, request, record)
    assert record.ready is not None
    await record.ready
    return reader


async def read_ws(socket: ClientConnection, record: StreamRecord) -> None:
    """One generation's frames: the ack, then tokens (``count`` says how many a coalesced
    frame holds), until the final frame."""
    async for raw in socket:
        now = time.perf_counter()
        frame = json.loads(raw)
        kind = frame["type"]
        if kind == "ack":
            record.accepted_at = now
        elif kind == "token":
            record.arrive(now, max(len(record.arrivals) + 1, frame["count"]))
        elif kind == "error" and "event_id" not in frame:
            record.end(failure=f"refused: {frame.get('message')}")
            return
        elif kind.encode() in TERMINAL:
            record.end(final=kind)
            return
    record.end(failure="WebSocket closed")


async def open_ws(rig: Rig, max_tokens: int, record: StreamRecord) -> TaskStream:
    loop = asyncio.get_running_loop()
    record.finished = loop.create_future()
    record.submitted_at = time.perf_counter()
    socket = await ws_connect(f"ws://{HOST}:{rig.gateway_port}/v1/ws")
    frame = {"type": "generate", "id": "b", "content": rig.prompt, "max_tokens": max_tokens}
    frame["temperature"] = 0
    await socket.send(json.dumps(frame))

    async def read() -> None:
        try:
            await read_ws(socket, record)
        finally:
            socket.transport.abort()

    return TaskStream(asyncio.create_task(read(), name="ws stream"))


async def one_stream(
    rig: Rig,
    mode: str,
    max_tokens: int,
    records: list[StreamRecord],
    session: tuple[str, str] | None,
    all_open: asyncio.Barrier | None = None,
) -> list[Any]:
    """Open one stream of ``mode`` (``records``: one per reader, several only for
    ``session``); each is counted into its record until its final frame. ``all_open``: the
    session's message waits until every session's readers are open."""
    if mode == "grpc":
        return [open_grpc_stream(rig.grpc_channel, stream_request(rig, max_tokens), records[0])]
    if mode == "ws":
        return [await open_ws(rig, max_tokens, records[0])]
    if mode != "session":
        port = rig.engine_port if mode == "engine" else rig.gateway_port
        kind: type[SSEStream] = OpenAIStream
        path, raw = "/v1/chat/completions", chat_body(rig, max_tokens, rig.top_logprobs)
        if mode == "engine":
            raw = chat_body(rig, max_tokens)
        elif mode == "responses":
            path, kind = "/v1/responses", ResponsesStream
            asked = {"model": rig.model, "input": rig.prompt, "max_output_tokens": max_tokens}
            raw = json.dumps(asked | {"temperature": 0, "stream": True}).encode()
        request = sse_request(HOST, port, path, {}, raw)
        return [await open_stream(HOST, port, request, records[0], kind)]
    assert session is not None
    readers = await asyncio.gather(*(open_events(rig, session, record) for record in records))
    if all_open is not None:
        try:
            await all_open.wait()
        except BaseException:
            for reader in readers:
                reader.close()
            raise
    submitted_at = time.perf_counter()
    sid, token = session
    body = json.dumps({"content": rig.prompt, "max_tokens": max_tokens, "temperature": 0})
    status, reply = await rig.posts.post(
        f"/v1/sessions/{sid}/messages", body.encode(), {"X-Session-Token": token}
    )
    if status != 202:
        raise RuntimeError(f"POST messages answered {status}: {reply[:200]!r}")
    for record in records:
        record.submitted_at, record.accepted_at = submitted_at, time.perf_counter()
    return list(readers)


async def run_once(
    rig: Rig,
    mode: str,
    streams_n: int,
    max_tokens: int,
    spread_s: float,
    bound_s: float,
    fanout: int = 1,
) -> Run:
    """``streams_n`` streams of ``mode`` started evenly over ``spread_s``, bounded by
    ``bound_s``; ``fanout`` readers per session (``session`` only: the engine makes
    ``streams_n`` streams of tokens and the gateway delivers ``streams_n * fanout``). A
    fan-out's readers all open before the first message: opening them under the load of
    the sessions already streaming took longer than the spread, and the first session's
    readers had ended before the last's began, so no moment saw them all."""
    sessions: list[tuple[str, str] | None] = [None] * streams_n
    if mode == "session":
        sessions = list(await asyncio.gather(*(create_session(rig) for _ in range(streams_n))))
    records = [[StreamRecord() for _ in range(fanout)] for _ in range(streams_n)]
    readers: list[Any] = []
    failures: list[str] = []
    pids = rig.pids()
    for server in rig.servers.values():
        await server.client.config_resetstat()
    first_tokens = await worker_ttft(rig.worker_metrics) if mode != "engine" else {}
    before = cpu_of(pids)
    loop = asyncio.get_running_loop()
    began = loop.time() + 0.05
    all_open = asyncio.Barrier(streams_n) if fanout > 1 else None

    async def stream(index: int) -> None:
        await asyncio.sleep(max(0.0, began + index * spread_s / streams_n - loop.time()))
        try:
            opened = await one_stream(
                rig, mode, max_tokens, records[index], sessions[index], all_open
            )
            readers.extend(opened)
            for record in records[index]:
                assert record.finished is not None
                await record.finished
        except (OSError, RuntimeError, WebSocketException) as exc:
            failures.append(f"{type(exc).__name__}: {exc}")
            if all_open is not None:
                await all_open.abort()  # the others' messages would wait for this one
            for record in records[index]:
                record.end(failure=str(exc))

    wall_began = time.perf_counter()
    try:
        await asyncio.wait_for(asyncio.gather(*(stream(i) for i in range(streams_n))), bound_s)
        timed_out = False
    except TimeoutError:
        timed_out = True
    wall = time.perf_counter() - wall_began
    after = cpu_of(pids)
    if first_tokens:
        now = await worker_ttft(rig.worker_metrics)
        first_tokens = {name: now[name] - first_tokens[name] for name in now}
    spent = {name: await command_stats(s.client) for name, s in rig.servers.items()}
    calls = {name: {c: n for c, (n, _) in stats.items()} for name, stats in spent.items()}
    usec = {name: {c: u for c, (_, u) in stats.items()} for name, stats in spent.items()}
    for reader in readers:
        reader.close()
    flat = [r for rs in records for r in rs]
    arrivals = [t for r in flat for t in r.arrivals]
    starts = [r.submitted_at for r in flat if r.submitted_at]
    span = max(arrivals) - min(starts) if arrivals and starts else 0.0
    failures += [r.failure for r in flat if r.failure]
    cpu = {name: after[name] - before[name] for name in pids}
    cpu["redis"] = sum(cpu[name] for name in rig.servers)  # a cluster's: every shard's
    failed = sorted(set(failures))[:5]
    return Run(flat, cpu, wall, calls, timed_out, failed, span, first_tokens, usec)
