"""The gRPC inference service with the real engine: vLLM on the CPU serving the bundled
SmolLM2, through ``tritonclient.grpc``; greedy, so its stream equals the REST one's."""

from __future__ import annotations

import json

import httpx
import pytest
import tritonclient.grpc as grpcclient

from engine.model import MODEL_NAME
from tests.support.stack import VllmStack
from tests.support.triton import Responses, llm_inputs

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def test_vllm_streams_over_grpc_the_same_tokens_as_over_sse(vllm_stack: VllmStack) -> None:
    # The session's vLLM stack has one gateway; this one, on the same Redis and key prefix,
    # also serves gRPC.
    gateway = vllm_stack.stack.gateway(grpc=True)
    prompt, n = "The capital of France is", 16
    responses = Responses()
    client = grpcclient.InferenceServerClient(gateway.grpc_url)
    try:
        client.start_stream(callback=responses)
        inputs = llm_inputs(prompt, n, temperature=(0.0, "FP32"))
        client.async_stream_infer(MODEL_NAME, inputs, request_id="paris")
        answer = responses.answers(1)["paris"]
    finally:
        client.stop_stream()
        client.close()
    assert "Paris" in answer.text
    assert answer.final["completion_tokens"] == n or answer.final["finish_reason"] == "stop"

    body = {"text_input": prompt, "parameters": {"max_tokens": n, "temperature": 0}}
    url = f"{gateway.url}/v2/models/{MODEL_NAME}/generate_stream"
    with httpx.Client(timeout=300) as http, http.stream("POST", url, json=body) as sse:
        events = [json.loads(line[5:]) for line in sse.iter_lines() if line.startswith("data:")]
    assert answer.text == "".join(e["text_output"] for e in events)
