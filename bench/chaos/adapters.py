"""The chaos run's clients of the APIs other than the session API, each written as a user of
that API would write it from its documentation:

- ``openai_client``: chat completions, streamed (half asking for usage) or whole (some with
  two choices);
- ``tgi_client``: TGI's ``/generate_stream``;
- ``oip_client``: the Open Inference Protocol's ``generate_stream``;
- ``grpc_client``: KServe v2 ``ModelStreamInfer`` with ``tritonclient.grpc.aio``;
- ``responses_reader``: a background Responses stream, resumed with ``starting_after`` on
  another replica when it breaks or its gateway ends it ``shutting_down``.

The first four have no resume: their documented answer to a cut stream, a stream its
gateway ended ``shutting_down`` or one that Redis lost is to send the request again
(``send_again``), so each ends with a whole reply. A cut is the client's to explain: a
fault of its gateway (or of the clients' links to it) from ``SETTLE_S`` before the request
to its cut; one with none is a problem of the product.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import httpx
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.utils import InferenceServerException

from bench.chaos.clients import (
    LOSS_WORDS,
    LOSSES,
    SETTLE_S,
    SHUTTING_DOWN,
    UNAVAILABLE,
    WHOLE_TIMEOUT,
    Context,
    Record,
    Retry,
    error_code,
    rate_limited,
    refusal,
    usage_of,
    with_retries,
    words,
)
from bench.chaos.tenants import ApiKey
from bench.loadgen import sse_events

REFUSED_WORDS = ("try again", "admits again")
"""How a gRPC stream's ``error_message`` says the request was refused before it started
(it has no status of its own: a 429 or 503 elsewhere)."""
RESPONSE_FINALS = {"response.completed", "response.incomplete", "response.failed"}
SENDS = 6
"""At most this many sends of one one-shot request (each cut by a fault, or lost)."""
GRPC_TIMEOUT_S = 90.0
CUT = (
    httpx.ReadError,
    httpx.RemoteProtocolError,
    httpx.ReadTimeout,
    InferenceServerException,
    grpc.RpcError,
)
"""How a one-shot stream breaks under its client (its gateway or the link to it failed)."""
FaultsOf = Callable[[str, float], int]
Attempt = Callable[[str], Awaitable[None]]


class Lost(Exception):
    """The answer says Redis lost what the request was reading (``LOSSES``)."""


def loss_said(message: str) -> bool:
    """An error message of an API with no code (TGI, OIP, gRPC) saying Redis lost it."""
    return any(words_ in message for words_ in LOSS_WORDS)


async def send_again(
    ctx: Context, rng: random.Random, record: Record, faults_of: FaultsOf, attempt: Attempt
) -> Record:
    """``attempt(url)`` reads one request's answer into ``record``; sent again while its
    stream is cut by a fault of its gateway, ended ``shutting_down`` by it, or lost by
    Redis (``SENDS`` sends at most)."""
    url_of_send: list[str] = []
    for _ in range(SENDS):

        async def once(url: str) -> None:
            url_of_send.append(url)
            record.start_again()
            faults_before = faults_of(url, ctx.clock() - SETTLE_S)
            since = ctx.clock()
            try:
                await attempt(url)
            except CUT as exc:
                if faults_of(url, math.inf) == faults_before:
                    record.problems.append(f"cut off with no fault of its gateway: {exc!r}")
                    return
                record.interrupted = f"its gateway had a fault: {type(exc).__name__}"
                raise
            except Lost as lost:
                record.told_lost(ctx.clock(), str(lost), since, url)
                raise
            if error_code(record.final_data) == SHUTTING_DOWN or record.final == SHUTTING_DOWN:
                if faults_of(url, math.inf) == faults_before:
                    record.problems.append("shutting_down with no fault of its gateway")
                    return
                record.interrupted = "its gateway shut down mid-stream (shutting_down)"
                raise Lost(SHUTTING_DOWN)

        try:
            await with_retries(ctx, rng, record, once)
            return record
        except (*CUT, Lost) as exc:
            record.resent += 1
            record.step(ctx.clock(), f"{url_of_send[-1]} {exc!r}: sent again")
    record.problems.append(f"no whole answer in {SENDS} sends")
    return record


# --- OpenAI chat completions -------------------------------------------------------------


async def openai_client(
    ctx: Context, rng: random.Random, label: str, model: str, key: ApiKey, faults_of: FaultsOf
) -> Record:
    """One chat completion, streamed (half of them asking for usage) or whole (some with
    two choices, whose prompt is billed once)."""
    stream = rng.random() < 0.6
    kind = "openai_stream" if stream else "openai_whole"
    record = ctx.track(
        Record(kind, label, model, words(rng, label), rng.randint(5, 40), ctx.clock(), key)
    )
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": record.content}],
        "max_tokens": record.max_tokens,
        "stream": stream,
    }
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if not stream and rng.random() < 0.3:
        record.choices = body["n"] = 2

    async def attempt(url: str) -> None:
        if stream:
            await _openai_stream(ctx, url, body, record)
            return
        # No read timeout: nothing comes before the whole answer, which may take a while
        # across faults; the run's bound (90 s) tells a slow one from a hang.
        response = await ctx.http.post(
            f"{url}/v1/chat/completions", json=body, headers=key.bearer, timeout=WHOLE_TIMEOUT
        )
        record.step(
            ctx.clock(),
            f"{url} {response.status_code} after {response.elapsed.total_seconds():.1f} s"
            f" (request {response.headers.get('x-request-id')})",
        )
        refusal(response, record)
        answer = response.json()
        if response.status_code != 200:
            record.final, record.final_data = "error", answer
            if error_code(answer) in LOSSES:
                raise Lost(error_code(answer))
            return
        _whole_answer(record, answer)

    return await send_again(ctx, rng, record, faults_of, attempt)


def _whole_answer(record: Record, answer: dict[str, Any]) -> None:
    """A whole chat completion: its first choice's text; every choice the same (one
    script, the same ``max_tokens``)."""
    record.generation_id = str(answer["id"]).removeprefix("chatcmpl-")
    record.usage_told = usage_of(answer.get("usage"))
    first, *others = answer["choices"]
    record.text = first["message"]["content"]
    record.final, record.final_data = first["finish_reason"], answer
    if len(answer["choices"]) != record.choices:
        record.problems.append(f"{len(answer['choices'])} choices, {record.choices} asked for")
    for other in others:
        if (other["message"]["content"], other["finish_reason"]) != (
            record.text,
            record.final,
        ):
            record.problems.append(f"choice {other['index']} differs from choice 0: {other}")


async def _openai_stream(ctx: Context, url: str, body: dict[str, Any], record: Record) -> None:
    async for data in _stream(ctx, f"{url}/v1/chat/completions", body, record):
        if data == "[DONE]":
            if record.final is None:
                record.problems.append("[DONE] before a finish_reason")
            record.events.append(("", "[DONE]", {}))
            if error_code(record.final_data) in LOSSES:
                raise Lost(error_code(record.final_data))
            return
        chunk = json.loads(data)
        record.events.append(("", "chunk", chunk))
        if "error" in chunk:
            record.final, record.final_data = "error", chunk
            continue
        record.generation_id = str(chunk["id"]).removeprefix("chatcmpl-")
        if chunk.get("usage"):
            record.usage_told = usage_of(chunk["usage"])
        for choice in chunk["choices"]:
            record.text += choice["delta"].get("content") or ""
            if choice.get("finish_reason"):
                record.final = choice["finish_reason"]


# --- TGI and the Open Inference Protocol: one SSE stream each ----------------------------


async def tgi_client(
    ctx: Context, rng: random.Random, label: str, key: ApiKey, model: str, faults_of: FaultsOf
) -> Record:
    """TGI's ``/generate_stream`` (the default model): a token per event, the last one
    with ``generated_text``; an error is ``{"error", "error_type"}``."""
    record = ctx.track(
        Record("tgi", label, model, words(rng, label), rng.randint(5, 40), ctx.clock(), key)
    )
    body = {"inputs": record.content, "parameters": {"max_new_tokens": record.max_tokens}}

    async def attempt(url: str) -> None:
        async for data in _stream(ctx, f"{url}/generate_stream", body, record):
            event = json.loads(data)
            record.events.append(("", "chunk", event))
            if "error" in event:
                _error(record, event["error"])
                return
            record.text += event["token"]["text"]
            if event.get("generated_text") is not None:
                record.final = event["details"]["finish_reason"] if event["details"] else "end"
                if event["generated_text"] != record.text:
                    record.problems.append("generated_text is not the tokens streamed")
                return

    return await send_again(ctx, rng, record, faults_of, attempt)


async def oip_client(
    ctx: Context, rng: random.Random, label: str, key: ApiKey, model: str, faults_of: FaultsOf
) -> Record:
    """The Open Inference Protocol's ``generate_stream``: ``text_output`` per event, the
    last with a ``finish_reason``; an error is ``{"error"}``."""
    record = ctx.track(
        Record("oip", label, model, words(rng, label), rng.randint(5, 40), ctx.clock(), key)
    )
    body = {"text_input": record.content, "parameters": {"max_tokens": record.max_tokens}}

    async def attempt(url: str) -> None:
        path = f"{url}/v2/models/{model}/generate_stream"
        async for data in _stream(ctx, path, body, record):
            event = json.loads(data)
            record.events.append(("", "chunk", event))
            if "error" in event:
                _error(record, event["error"])
                return
            record.text += event["text_output"]
            if event.get("finish_reason"):
                record.final = event["finish_reason"]
                return

    return await send_again(ctx, rng, record, faults_of, attempt)


async def _stream(
    ctx: Context, url: str, body: dict[str, Any], record: Record
) -> AsyncIterator[str]:
    """The ``data`` of each event of a streamed answer (a refusal raises ``Retry``; another
    error answer is the record's final)."""
    async with ctx.http.stream("POST", url, json=body, headers=record.key.bearer) as response:
        if response.status_code != 200:
            await response.aread()
            refusal(response, record)
            record.final, record.final_data = "error", response.json()
            return
        async for _id, _event, data in sse_events(response):
            yield data


def _error(record: Record, message: str) -> None:
    """An error event of an API whose errors have no code: a loss, or its end."""
    record.final, record.final_data = "error", {"error": message}
    if loss_said(message):
        raise Lost(message[:120])
    if "shutting down" in message:
        record.final = SHUTTING_DOWN


# --- gRPC: KServe v2 ModelStreamInfer ----------------------------------------------------


async def grpc_client(
    ctx: Context, rng: random.Random, label: str, model: str, key: ApiKey, faults_of: FaultsOf
) -> Record:
    """One request on a ``ModelStreamInfer`` stream (``tritonclient.grpc.aio``), to the
    gRPC server of the gateway a URL names: ``text_output`` per response, the last one
    ``triton_final_response``; an error is the response's ``error_message``."""
    record = ctx.track(
        Record("grpc", label, model, words(rng, label), rng.randint(5, 40), ctx.clock(), key)
    )

    async def attempt(url: str) -> None:
        client = grpcclient.InferenceServerClient(ctx.grpc[url])
        try:
            await _grpc_stream(client, record, model)
        finally:
            await client.close()

    return await send_again(ctx, rng, record, faults_of, attempt)


async def _grpc_stream(client: Any, record: Record, model: str) -> None:
    inputs = [
        _tensor("text_input", np.array([record.content.encode()], dtype=np.object_), "BYTES"),
        _tensor("max_tokens", np.array([record.max_tokens], dtype=np.int32), "INT32"),
    ]

    async def requests() -> AsyncIterator[dict[str, Any]]:
        yield {"model_name": model, "inputs": inputs, "request_id": record.label}

    metadata = {"authorization": record.key.bearer["Authorization"]}  # gRPC's: lower case
    answers = client.stream_infer(requests(), stream_timeout=GRPC_TIMEOUT_S, headers=metadata)
    try:
        async for result, error in answers:
            if _grpc_answer(record, result, error):
                return
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNAVAILABLE and not record.text:
            raise Retry(0.3) from exc  # no gateway took the call (one restarting): again
        raise
    raise InferenceServerException("the stream ended before its final response")


def _grpc_answer(record: Record, result: Any, error: Any) -> bool:
    """One response of the stream read; True when it was the request's last."""
    if error is not None:
        message = error.message() or str(error)
        if not record.text and any(words_ in message for words_ in REFUSED_WORDS):
            if "reached its" in message:
                rate_limited(record, message)
            raise Retry(1.0)  # refused before it started: its hint is in the message
        _error(record, message)
        return True
    output = result.as_numpy("text_output")
    if output is not None:
        record.text += bytes(output[0]).decode()
    if result.get_response().parameters["triton_final_response"].bool_param:
        record.final = "end"
        return True
    return False


def _tensor(name: str, value: Any, datatype: str) -> Any:
    tensor = grpcclient.InferInput(name, list(value.shape), datatype)
    tensor.set_data_from_numpy(value)
    return tensor


# --- Responses: a background stream resumed with starting_after --------------------------


async def responses_reader(
    ctx: Context, rng: random.Random, label: str, model: str, key: ApiKey, faults_of: FaultsOf
) -> Record:
    """A background response, streamed; a cut stream (or one its gateway ended
    ``shutting_down``) is resumed with ``starting_after`` on another replica. A response
    Redis lost (404 ``response_not_found``, 410 ``events_lost``) is read again from its
    start, or sent again when it is gone."""
    record = ctx.track(
        Record("responses", label, model, words(rng, label), rng.randint(5, 40), ctx.clock(), key)
    )
    body = {
        "model": model,
        "input": record.content,
        "max_output_tokens": record.max_tokens,
        "stream": True,
        "background": True,
    }
    reading = ResponseReading(ctx, rng, record, faults_of)

    async def start(url: str) -> None:
        try:
            async with ctx.http.stream(
                "POST", f"{url}/v1/responses", json=body, headers=key.bearer
            ) as response:
                await reading.read(url, response)
        except (httpx.TransportError, OSError):
            if reading.response_id is None:
                raise  # nothing of it reached this client: send it again
            record.reconnects += 1  # it runs in the background: resumed below

    while True:
        await with_retries(ctx, rng, record, start)
        if await reading.resume():
            return record
        record.resent += 1
        reading.forget()


class ResponseReading:
    """What a Responses reader knows of its response: its id, the last sequence number
    read; and the reading of its stream, first or resumed."""

    def __init__(
        self, ctx: Context, rng: random.Random, record: Record, faults_of: FaultsOf
    ) -> None:
        self.ctx, self.rng, self.record, self.faults_of = ctx, rng, record, faults_of
        self.response_id: str | None = None
        self.sequence = -1

    def forget(self) -> None:
        """The response is gone: the next one starts afresh."""
        self.response_id, self.sequence = None, -1
        self.record.start_again()

    async def read(self, url: str, response: httpx.Response) -> None:
        record = self.record
        if response.status_code != 200:
            await response.aread()
            refusal(response, record)
            record.final, record.final_data = "error", response.json()
            return
        faults_before = self.faults_of(url, self.ctx.clock() - SETTLE_S)
        async for _id, event, data in sse_events(response):
            payload = json.loads(data)
            if event == "error" and payload.get("code") in (SHUTTING_DOWN, UNAVAILABLE):
                # Its gateway was stopped, or could not read Redis: the response runs on
                # in the background; read it elsewhere (docs/api.md).
                record.step(self.ctx.clock(), f"{url} {payload['code']}")
                stopped = payload["code"] == SHUTTING_DOWN
                if stopped and self.faults_of(url, math.inf) == faults_before:
                    record.problems.append("shutting_down with no fault of its gateway")
                if self.response_id is None:
                    raise Retry(1.0)
                return
            record.events.append(("", event, payload))
            self.sequence = payload.get("sequence_number", self.sequence)
            if event == "response.created":
                self.response_id = payload["response"]["id"]
                record.generation_id = self.response_id.partition(".")[2]
            elif event == "response.output_text.delta":
                record.text += payload["delta"]
            elif event in RESPONSE_FINALS or event == "error":
                record.final, record.final_data = event, payload
                record.usage_told = usage_of((payload.get("response") or {}).get("usage"))
                return
            if self.rng.random() < 0.05:
                return  # the reader drops the stream and resumes elsewhere

    async def resume(self) -> bool:
        """Read on until the final event; False when Redis lost the response (gone, or
        ended ``events_lost``): the client sends it again."""
        record, url, since = self.record, "", self.ctx.clock()
        while record.final is None:
            url = self.ctx.other(self.rng, url)
            record.reconnects += 1
            since = self.ctx.clock()
            after = {"starting_after": str(self.sequence)} if self.sequence >= 0 else {}
            try:
                async with self.ctx.http.stream(
                    "GET",
                    f"{url}/v1/responses/{self.response_id}",
                    params={"stream": "true", **after},
                    headers=record.key.bearer,
                ) as response:
                    if response.status_code in (404, 410):
                        code = error_code(json.loads(await response.aread()))
                        if code not in LOSSES:
                            raise RuntimeError(f"resume: {response.status_code} {code}")
                        record.told_lost(self.ctx.clock(), str(code), since, url)
                        if code == "response_not_found":
                            return False
                        self.sequence = -1  # the events Redis kept, from the first
                        record.start_again()
                        continue
                    await self.read(url, response)
            except Retry as retry:
                await asyncio.sleep(retry.after_s)
            except (httpx.TransportError, OSError):
                await asyncio.sleep(self.rng.uniform(0.05, 0.3))
        lost = response_error_code(record.final_data)
        if lost in LOSSES:
            record.told_lost(self.ctx.clock(), lost, since, url)
            return False
        return True


def response_error_code(final: dict[str, Any]) -> str | None:
    """The code of a Responses stream's failure: an ``error`` event's, or a failed
    response's ``error`` (``server_error``, the engine's code before its message, as
    docs/api.md says: ``events_lost: ...``)."""
    error = (final.get("response") or {}).get("error") or final
    if not isinstance(error, dict):
        return None
    engine_code = str(error.get("message", "")).partition(":")[0]
    return (
        engine_code
        if error.get("code") == "server_error" and engine_code in LOSSES
        else error.get("code")
    )
