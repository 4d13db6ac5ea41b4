"""The KServe v2 / Triton gRPC inference service (gateway/grpc/) with the official client,
``tritonclient.grpc``, against a real gateway, real Redis and the synthetic engine."""

from __future__ import annotations

import asyncio
import collections
import json
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2 as pb
from tritonclient.utils import InferenceServerException

from gateway.transport.http2 import REFUSAL_HOLD_S
from stack import processes
from tests.support.engines import STOP_WITHIN_S
from tests.support.oracle import synthetic_text, synthetic_tokens
from tests.support.redis_probes import lease_trusted, only_generation, wait_final, wait_running
from tests.support.stack import Stack
from tests.support.triton import (
    FINAL,
    Responses,
    llm_inputs,
    parameters,
    scalar,
    sent,
    text_input,
    text_of,
)

pytestmark = pytest.mark.timeout(120)


def test_two_models_stream_token_by_token_on_one_stream_and_end_with_a_final_response(
    stack: Stack,
) -> None:
    stack.synthetic(200, "--served-model-name", "alpha")
    stack.synthetic(200, "--served-model-name", "beta")
    gateway = stack.gateway(grpc=True)
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        for model, prompt, n in (("alpha", "first prompt", 6), ("beta", "second one", 4)):
            client.async_stream_infer(model, llm_inputs(prompt, n), request_id=f"{model}-1")
        # The client closes its side of the stream at once: both answers still come whole.
        client.stop_stream()
        answers = responses.answers(2)
    finally:
        client.close()
    for model, prompt, n in (("alpha", "first prompt", 6), ("beta", "second one", 4)):
        answer = answers[f"{model}-1"]
        answer.assert_whole_tokens([token.text for token in synthetic_tokens(prompt, n)])
        assert {r.get_response().model_name for r in answer.responses} == {model}
        # Paced at 200 tokens/s, tokens come one per response but when they reach the
        # gateway together; no empty-final-response asked: the last token is in the final.
        flags = [parameters(r)[FINAL] for r in answer.responses]
        assert flags == [False] * (len(flags) - 1) + [True] and len(flags) <= n
        assert text_of(answer.responses[-1])
        assert answer.final == {
            FINAL: True,
            "finish_reason": "length",
            "prompt_tokens": answer.final["prompt_tokens"],
            "completion_tokens": n,
        }
        assert answer.final["prompt_tokens"] > 0


def test_grpc_tokens_equal_the_sse_streams_and_infer_returns_the_whole_text(
    stack: Stack,
) -> None:
    stack.synthetic(200)
    gateway = stack.gateway(grpc=True)
    prompt, n = "the same request", 7
    body = {"text_input": prompt, "parameters": {"max_tokens": n, "temperature": 0}}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{gateway.url}/v2/models/synthetic/generate_stream", json=body) as sse,
    ):
        events = [json.loads(line[5:]) for line in sse.iter_lines() if line.startswith("data:")]
    sse_tokens = [event.get("text_output", "") for event in events]
    assert "".join(sse_tokens) == synthetic_text(prompt, n)

    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        inputs = llm_inputs(prompt, n, temperature=(0.0, "FP32"))
        client.async_stream_infer(
            "synthetic", inputs, request_id="s", enable_empty_final_response=True
        )
        streamed = responses.answers(1)["s"]
        # ``stream`` false on the stream: one response with the whole text.
        whole_inputs = llm_inputs(prompt, n, stream=(False, "BOOL"))
        client.async_stream_infer("synthetic", whole_inputs, request_id="w")
        whole = responses.answers(1)["w"]
        # Parameters instead of inputs (tritonclient sends no floats: text); unary infer.
        result = client.infer(
            "synthetic",
            [text_input(prompt)],
            request_id="u",
            parameters={"max_tokens": n, "temperature": "0.5", "stop": "never"},
        )
    finally:
        client.close()
    streamed.assert_whole_tokens(sse_tokens)
    assert text_of(streamed.responses[-1]) is None  # the empty final response asked for
    assert streamed.final["completion_tokens"] == n

    assert len(whole.responses) == 1
    assert text_of(whole.responses[0]) == synthetic_text(prompt, n)
    assert whole.final[FINAL] is True and whole.final["finish_reason"] == "length"

    assert result.get_response().id == "u"
    assert text_of(result) == synthetic_text(prompt, n)
    assert parameters(result)["finish_reason"] == "length"
    assert parameters(result)["completion_tokens"] == n


def test_cancelling_the_stream_stops_the_generation_in_the_engine(stack: Stack) -> None:
    # A long abandon grace: only the cancelled RPC can have stopped the generation.
    env = {"TOKENSPOUT_ABANDON_GRACE_S": "600"}
    stack.synthetic(50, **env)
    gateway = stack.gateway(grpc=True, **env)
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        client.async_stream_infer("synthetic", llm_inputs("keep going [[stall:3]]", 500))
        for _ in range(3):
            result, error = responses.next()
            assert error is None and result is not None and not parameters(result)[FINAL]
        only_generation(stack.redis_url, stack.prefix)
        wait_running(stack.redis_url, stack.prefix, 1, STOP_WITHIN_S)
        cancelled_at = time.monotonic()
        client.stop_stream(cancel_requests=True)
    finally:
        client.close()
    final = wait_final(stack.redis_url, stack.prefix)
    assert final["type"] == "cancelled" and final["reason"] == "disconnected", final
    assert final["usage"]["completion_tokens"] == 3
    wait_running(
        stack.redis_url, stack.prefix, 0, STOP_WITHIN_S - (time.monotonic() - cancelled_at)
    )


def test_an_infer_whose_deadline_passes_stops_its_generation(stack: Stack) -> None:
    env = {"TOKENSPOUT_ABANDON_GRACE_S": "600"}
    stack.synthetic(50, **env)
    gateway = stack.gateway(grpc=True, **env)
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as timed_out:
            client.infer("synthetic", llm_inputs("wait for me [[stall:2]]", 500), client_timeout=2)
    finally:
        client.close()
    assert "DEADLINE_EXCEEDED" in str(timed_out.value.status())
    final = wait_final(stack.redis_url, stack.prefix)
    assert final["type"] == "cancelled" and final["reason"] == "disconnected", final
    wait_running(stack.redis_url, stack.prefix, 0, STOP_WITHIN_S)


def test_bad_requests_get_clear_errors_and_the_stream_goes_on(stack: Stack) -> None:
    stack.synthetic(200)
    gateway = stack.gateway(grpc=True)
    bad = [
        ("synthetic", [scalar("max_tokens", 5, "INT32")], "`text_input` (BYTES) is required"),
        ("synthetic", [scalar("text_input", 7, "INT32")], "`text_input` must be BYTES, not INT32"),
        ("llama", llm_inputs("hi", 2), "the model 'llama' does not exist (served now: synthetic)"),
        ("synthetic", llm_inputs("hi", 2, temperature=(-1.0, "FP32")), "temperature"),
        ("synthetic", llm_inputs("hi", 2, beam_width=(4, "INT32")), "unknown input"),
    ]
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        for model, inputs, message in bad:
            client.async_stream_infer(model, inputs, request_id="bad")
            result, error = responses.next()
            assert result is None and message in str(error), (message, error)
        client.async_stream_infer("synthetic", llm_inputs("still here", 3), request_id="ok")
        answer = responses.answers(1)["ok"]
        assert answer.text == synthetic_text("still here", 3)

        statuses = {}
        for model, inputs, message in bad:
            with pytest.raises(InferenceServerException) as refused:
                client.infer(model, inputs)
            assert message in refused.value.message(), (message, refused.value)
            statuses[message[:20]] = refused.value.status()
        assert set(statuses.values()) == {"StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND"}
    finally:
        client.stop_stream()
        client.close()


async def test_bytes_that_are_no_request_message_get_an_error_and_the_stream_goes_on(
    stack: Stack,
) -> None:
    """What a client of another protocol might send: not a ``ModelInferRequest``."""
    stack.synthetic(200)
    gateway = stack.gateway(grpc=True)
    identity = lambda message: message  # noqa: E731
    garbage = b"\xff\xff\xff"
    async with grpc.aio.insecure_channel(gateway.grpc_url) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=identity,
            response_deserializer=identity,
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await infer(garbage)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a ModelInferRequest message" in str(refused.value.details())

        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=identity,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        request = sent(llm_inputs("after the garbage", 3), model="synthetic", request_id="ok")
        call = stream(iter([garbage, request.SerializeToString()]))
        answers = [response async for response in call]
    assert "not a ModelInferRequest message" in answers[0].error_message
    text = "".join(text_of(grpcclient.InferResult(a.infer_response)) or "" for a in answers[1:])
    assert text == synthetic_text("after the garbage", 3)
    assert parameters(grpcclient.InferResult(answers[-1].infer_response))[FINAL] is True


def test_health_and_model_metadata_come_from_the_gateway_and_the_workers_registry(
    stack: Stack,
) -> None:
    gateway = stack.gateway(grpc=True)
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        assert client.is_server_live() is True
        assert client.is_server_ready() is False  # no engine worker yet
        stack.synthetic(200, "--served-model-name", "alpha")
        assert client.is_server_ready() is True
        assert client.is_model_ready("alpha") is True
        with pytest.raises(InferenceServerException) as unknown:
            client.is_model_ready("llama")
        assert unknown.value.status() == "StatusCode.NOT_FOUND"
        assert "alpha" in unknown.value.message()

        metadata = client.get_model_metadata("alpha", as_json=True)
        assert metadata["name"] == "alpha" and metadata["platform"] == "tokenspout/synthetic"
        inputs = {tensor["name"]: tensor["datatype"] for tensor in metadata["inputs"]}
        assert inputs["text_input"] == "BYTES" and inputs["max_tokens"] == "INT32"
        assert [(t["name"], t["datatype"]) for t in metadata["outputs"]] == [
            ("text_output", "BYTES")
        ]
        server = client.get_server_metadata(as_json=True)
        assert server["name"] == "tokenspout" and server["version"]
        with pytest.raises(InferenceServerException) as unsupported:
            client.get_model_config("alpha")
        assert unsupported.value.status() == "StatusCode.UNIMPLEMENTED"
    finally:
        client.close()


def test_with_api_keys_rpcs_without_the_key_are_unauthenticated(stack: Stack) -> None:
    stack.synthetic(200)
    gateway = stack.gateway(grpc=True, TOKENSPOUT_API_KEYS="grpc-key")
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        assert client.is_server_live() is True  # like /health: open
        for headers in (None, {"authorization": "Bearer wrong"}):
            with pytest.raises(InferenceServerException) as refused:
                client.infer("synthetic", llm_inputs("hi", 2), headers=headers)
            assert refused.value.status() == "StatusCode.UNAUTHENTICATED"
            assert "API key" in refused.value.message()
            responses = Responses()
            # Refused as it opens, before any request on it.
            client.start_stream(callback=responses, headers=headers)
            result, error = responses.next()
            assert result is None and error.status() == "StatusCode.UNAUTHENTICATED", error
            client.stop_stream()
        keyed = {"authorization": "Bearer grpc-key"}
        result = client.infer("synthetic", llm_inputs("hi", 2), headers=keyed)
        assert text_of(result) == synthetic_text("hi", 2)
        assert client.is_model_ready("synthetic", headers=keyed) is True
    finally:
        client.close()


async def test_a_refused_streams_status_reaches_the_client_that_is_still_sending(
    stack: Stack,
) -> None:
    """grpcio's asyncio client sends a stream's requests in operations of their own; one
    under way when the status came failed, and the call ended INTERNAL "Internal error from
    Core" (3 to 19 of 200 here, before the gateway held its refusals until the client had
    sent).
    A client that keeps its side open gets the status ``REFUSAL_HOLD_S`` on."""
    stack.synthetic(200)
    gateway = stack.gateway(grpc=True, TOKENSPOUT_API_KEYS="grpc-key")
    identity = lambda message: message  # noqa: E731
    request = sent(llm_inputs("hi", 3), model="synthetic").SerializeToString()
    wrong = (("authorization", "Bearer wrong"),)
    open_for_s = REFUSAL_HOLD_S + 5

    async def one_request() -> AsyncIterator[bytes]:
        yield request

    answered, closed = asyncio.Event(), asyncio.Event()

    async def one_then_open() -> AsyncIterator[bytes]:
        try:
            yield request
            async with asyncio.timeout(open_for_s):  # open until the status came
                await answered.wait()
        finally:
            closed.set()  # grpc's task that sends these ends in the same step

    async def status_of(call: Any) -> grpc.StatusCode:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in call:
                pass
        return refused.value.code()

    async with grpc.aio.insecure_channel(gateway.grpc_url) as channel:
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer",
            request_serializer=identity,
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        codes = collections.Counter(
            [await status_of(stream(one_request(), metadata=wrong)) for _ in range(200)]
        )
        assert codes == {grpc.StatusCode.UNAUTHENTICATED: 200}, codes

        began = time.monotonic()
        held = stream(one_then_open(), metadata=wrong)
        assert await status_of(held) == grpc.StatusCode.UNAUTHENTICATED
        assert REFUSAL_HOLD_S <= time.monotonic() - began < open_for_s
        answered.set()
        await closed.wait()


def test_a_stream_that_outlasts_the_gateways_shutdown_grace_ends_shutting_down(
    stack: Stack,
) -> None:
    """SIGTERM: the gRPC server takes no new RPC; a request still running near the grace's
    end gets its error (send it again, elsewhere) and its generation is stopped; the
    gateway exits cleanly."""
    stack.synthetic(20)
    gateway = stack.gateway(grpc=True, TOKENSPOUT_SHUTDOWN_GRACE_S="2")
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        client.async_stream_infer("synthetic", llm_inputs("outlast the grace", 400))
        result, error = responses.next()
        assert error is None and result is not None and not parameters(result)[FINAL]
        gateway.process.send_signal(signal.SIGTERM)
        while error is None:  # tokens until the cut
            result, error = responses.next()
            assert error is not None or not parameters(result)[FINAL]
        assert "shutting down" in str(error)
        gateway.process.wait(timeout=2 + 10)
    finally:
        client.close()
    wait_running(stack.redis_url, stack.prefix, 0, STOP_WITHIN_S)
    log = (stack.logs / f"gateway-{gateway.port}.log").read_text()
    assert "msg='Application shutdown complete.'" in log
    assert "Exception in ASGI application" not in log and "Traceback" not in log


async def test_a_worker_killed_mid_reply_is_continued_on_the_grpc_stream(stack: Stack) -> None:
    """Takeover under gRPC: the stream reads on through the kill and ends with exactly the
    uninterrupted text."""
    doomed = stack.synthetic(20)
    gateway = stack.gateway(grpc=True)
    content, max_tokens = "carry on over grpc", 60
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    got = []
    try:
        client.start_stream(callback=responses)
        client.async_stream_infer("synthetic", llm_inputs(content, max_tokens), request_id="t")
        while len(got) < 5:
            result, error = await asyncio.to_thread(responses.next)
            assert error is None, error
            got.append(result)
        stack.synthetic(20)
        await lease_trusted(stack.redis_url)
        processes.kill(doomed)
        while not parameters(got[-1])[FINAL]:
            result, error = await asyncio.to_thread(responses.next)
            assert error is None, error
            got.append(result)
        client.stop_stream()
    finally:
        client.close()
    assert "".join(text_of(r) or "" for r in got) == synthetic_text(content, max_tokens)
    assert parameters(got[-1])["completion_tokens"] == max_tokens
