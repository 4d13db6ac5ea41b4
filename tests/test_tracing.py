"""One request's trace, as a collector receives it: the gateway and the workers export
their spans over OTLP to a receiver in the test (tests/support/otlp.py), which decodes
them with the protocol's own messages.

The synthetic engine here: a ``curl`` request carrying ``traceparent`` continues that
trace through Redis into the worker, and its worker is SIGKILLed mid-reply: the reaper's
takeover and the next worker's run are in the same trace, the takeover an event; a
request without one begins a trace of its own. With vLLM: tests/test_tracing_vllm.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

from stack import processes
from tests.support.otlp import OtlpReceiver, render_tree
from tests.support.stack import Stack
from tests.support.traces import API_SPAN, ENGINE, GATEWAY, WORKER_SPANS, Curl, Trace, has, until
from tests.support.triton import llm_inputs, text_of

pytestmark = pytest.mark.timeout(120)

CALLER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
"""The caller's trace and span (W3C's example), sampled."""


async def test_a_traced_request_is_one_trace_through_redis_to_the_worker_and_its_takeover(
    stack: Stack, tmp_path: Path
) -> None:
    with OtlpReceiver() as receiver:
        engine_env = receiver.env(ENGINE)
        lost = stack.synthetic(20, worker_id="lost-worker", **engine_env)
        gateway = stack.gateway(**receiver.env(GATEWAY))
        curl = Curl.chat(
            gateway.url, tmp_path, "traced", model="synthetic", max_tokens=60, traceparent=CALLER
        )
        await until(lambda: curl.chunks() >= 5, 30)
        stack.synthetic(200, worker_id="next-worker", **engine_env)
        processes.kill(lost)
        curl.finish(60)
        trace_id = curl.trace_id()
        assert trace_id == CALLER[3:35]  # the caller's trace, continued
        expected = (API_SPAN, "tokenspout.takeover", "tokenspout.generation", *WORKER_SPANS)
        trace = Trace(receiver.wait_for_trace(trace_id, has(*expected)))
        print(f"\n{render_tree(trace.spans)}")

        api = trace.one(API_SPAN, GATEWAY)
        assert api.parent_span_id == CALLER[36:52]  # under the caller's span
        assert api.attributes["http.response.status_code"] == 200
        for child in ("tokenspout.admission", "tokenspout.relay", "tokenspout.takeover"):
            assert trace.parent(trace.one(child, GATEWAY)) is api, child
        takeover = trace.one("tokenspout.takeover", GATEWAY)  # the reaper's, in the trace
        assert takeover.attributes["tokenspout.outcome"] == "taken_over"
        assert takeover.attributes["tokenspout.from_worker"] == "lost-worker"
        # The next worker's run: under the API call, across Redis, its takeover an event.
        (run,) = [s for s in trace.named("tokenspout.generation") if "takeover" in s.event_names()]
        assert run.service == ENGINE and trace.parent(run) is api
        assert run.attributes["tokenspout.worker_id"] == "next-worker"
        assert run.attributes["tokenspout.outcome"] == "done"
        event = dict(run.events)["takeover"]
        assert event["tokenspout.from_worker"] == "lost-worker"
        assert event["tokenspout.takeover"] == 1 and event["tokenspout.streamed_tokens"] >= 5
        assert set(WORKER_SPANS) <= trace.children(run)
        queues = trace.named("tokenspout.queue")  # at least the continuation's wait
        assert queues and all(trace.parent(queue) is api for queue in queues)

        # No traceparent: a trace of its own, begun at the API call.
        fresh = Curl.chat(gateway.url, tmp_path, "fresh", model="synthetic", max_tokens=4)
        fresh.finish(30)
        trace_id = fresh.trace_id()
        assert trace_id != CALLER[3:35]
        expected = (API_SPAN, "tokenspout.queue", "tokenspout.generation", *WORKER_SPANS)
        trace = Trace(receiver.wait_for_trace(trace_id, has(*expected)))
        api = trace.one(API_SPAN, GATEWAY)
        assert api.parent_span_id == ""  # the root
        run = trace.one("tokenspout.generation", ENGINE)
        assert trace.parent(run) is api and set(WORKER_SPANS) <= trace.children(run)


async def test_the_spans_a_stopped_process_holds_are_exported_before_it_ends(
    stack: Stack, tmp_path: Path
) -> None:
    """SIGTERM: what the batch exporter still holds goes out before each process exits
    (uvicorn raises the signal again once the gateway's app has shut down)."""
    with OtlpReceiver() as receiver:
        held = {"OTEL_BSP_SCHEDULE_DELAY": "600000"}  # no export but the last one
        stack.synthetic(200, **{**receiver.env(ENGINE), **held})
        gateway = stack.gateway(**{**receiver.env(GATEWAY), **held})
        curl = Curl.chat(gateway.url, tmp_path, "held", model="synthetic", max_tokens=3)
        curl.finish(30)
        await asyncio.sleep(0.5)
        assert receiver.of_trace(curl.trace_id()) == []
        stack.stop()
        expected = (API_SPAN, "tokenspout.generation")
        spans = receiver.wait_for_trace(curl.trace_id(), has(*expected), timeout_s=5)
        assert {span.service for span in spans} == {GATEWAY, ENGINE}


async def test_a_grpc_call_continues_its_traceparent_metadata_into_the_worker(
    stack: Stack,
) -> None:
    """The gRPC inference service (``ModelInfer``, tritonclient): the call's span continues
    the caller's ``traceparent`` metadata, and the generation it queued is under it."""
    caller = "00-1bf92f3577b34da6a3ce929d0e0e4736-10f067aa0ba902b7-01"
    with OtlpReceiver() as receiver:
        stack.synthetic(200, **receiver.env(ENGINE))
        gateway = stack.gateway(grpc=True, **receiver.env(GATEWAY))
        client = grpcclient.InferenceServerClient(gateway.grpc_url)
        try:
            result = await asyncio.to_thread(
                client.infer,
                "synthetic",
                llm_inputs("trace me", 4),
                headers={"traceparent": caller},
            )
        finally:
            client.close()
        assert text_of(result)
        name = "inference.GRPCInferenceService/ModelInfer"
        trace = Trace(receiver.wait_for_trace(caller[3:35], has(name, "tokenspout.generation")))
        call = trace.one(name, GATEWAY)
        assert call.parent_span_id == caller[36:52]
        assert call.attributes["rpc.system"] == "grpc"
        assert call.attributes["rpc.grpc.status_code"] == 0
        assert trace.parent(trace.one("tokenspout.admission")) is call
        assert trace.parent(trace.one("tokenspout.generation", ENGINE)) is call
