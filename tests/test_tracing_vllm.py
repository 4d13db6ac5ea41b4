"""One request's trace with the real engine: vLLM on the CPU, its own tracing on.

The worker starts vLLM with the same OTLP endpoint and hands it the generation span's
``traceparent`` (``trace_headers``), so vLLM's ``llm_request`` span joins the trace the
caller's ``curl`` began, under the worker's generation span. A second ``curl``, with no
``traceparent``, begins a trace at the gateway; its reply is handed over at SIGTERM to
another worker of the model, and both runs are in that trace: the first ends with a
``handed_over`` event, the second begins with a ``takeover`` one.
"""

from __future__ import annotations

import asyncio
import fcntl
from pathlib import Path

import pytest

from engine.model import MODEL_NAME
from stack import processes
from tests.support.otlp import OtlpReceiver, render_tree
from tests.support.stack import VLLM_LOCK, Stack
from tests.support.traces import API_SPAN, ENGINE, GATEWAY, WORKER_SPANS, Curl, Trace, has, until

pytestmark = [pytest.mark.vllm, pytest.mark.own_vllm, pytest.mark.timeout(600)]

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_vllm_spans_join_the_callers_trace_and_a_hand_over_is_one_trace(
    stack: Stack, tmp_path: Path
) -> None:
    with VLLM_LOCK.open("w") as lock, OtlpReceiver() as receiver:
        fcntl.flock(lock, fcntl.LOCK_EX)
        engine_env = receiver.env(ENGINE)
        vllm = await asyncio.to_thread(
            stack.engine,
            *("--backend", "vllm", "--model", "default", "--capacity", "4"),
            worker_id="vllm-worker",
            **engine_env,
        )
        gateway = stack.gateway(**receiver.env(GATEWAY))

        traced = Curl.chat(
            gateway.url, tmp_path, "traced", model=MODEL_NAME, max_tokens=12, traceparent=CALLER
        )
        traced.finish(120)
        expected = (API_SPAN, "tokenspout.generation", *WORKER_SPANS, "llm_request")
        trace = Trace(receiver.wait_for_trace(CALLER[3:35], has(*expected)))
        print(f"\n{render_tree(trace.spans)}")
        api = trace.one(API_SPAN, GATEWAY)
        assert api.parent_span_id == CALLER[36:52]
        run = trace.one("tokenspout.generation", ENGINE)
        assert trace.parent(run) is api and trace.parent(trace.one("tokenspout.queue")) is api
        assert set(WORKER_SPANS) <= trace.children(run)
        engine = trace.one("llm_request")  # vLLM's own, from its output processor
        assert trace.parent(engine) is run and engine.service == ENGINE
        assert engine.attributes["gen_ai.usage.completion_tokens"] == 12
        assert engine.attributes["gen_ai.request.id"] == run.attributes["tokenspout.generation_id"]
        # vLLM's request runs within the worker's generation
        assert run.start_ns <= engine.start_ns and engine.end_ns <= run.end_ns

        fresh = Curl.chat(gateway.url, tmp_path, "fresh", model=MODEL_NAME, max_tokens=200)
        await until(lambda: fresh.chunks() >= 5, 120)
        stack.synthetic(200, "--served-model-name", MODEL_NAME, worker_id="next", **engine_env)
        processes.stop(vllm, timeout_s=60)  # SIGTERM: it hands its reply over at once
        fresh.finish(60)
        trace_id = fresh.trace_id()
        runs = ("tokenspout.generation", "tokenspout.generation")
        trace = Trace(receiver.wait_for_trace(trace_id, has(API_SPAN, *runs)))
        print(render_tree(trace.spans))
        api = trace.one(API_SPAN, GATEWAY)
        assert api.parent_span_id == ""
        first, second = trace.named("tokenspout.generation")
        assert first.attributes["tokenspout.worker_id"] == "vllm-worker"
        assert "handed_over" in first.event_names()
        assert first.attributes["tokenspout.run"] == "handed over"
        assert second.attributes["tokenspout.worker_id"] == "next"
        assert dict(second.events)["takeover"]["tokenspout.from_worker"] == "vllm-worker"
        assert trace.parent(first) is api and trace.parent(second) is api
