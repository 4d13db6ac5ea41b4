"""vLLM's engine process dies under a running reply while its worker lives: the worker
hands the reply to another worker of the model and exits (status 1, for its supervisor to
start it anew), so the client's stream goes on whole rather than ending in an error.

It is what a signal to the whole process group does (Ctrl-C in a terminal, systemd's stop)
when vLLM's engine process ends before the worker has handed its replies over, and what a
crash of that process does. The engine process of the session's vLLM worker is SIGKILLed,
so this test runs last (``ends_vllm``); the other worker is a synthetic one serving the
same model name, so only one vLLM runs.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import psutil
import pytest

from engine.model import MODEL_NAME
from tests.support.engines import engine_arg
from tests.support.stack import VllmStack

pytestmark = [pytest.mark.vllm, pytest.mark.ends_vllm, pytest.mark.timeout(600)]

MAX_TOKENS = 120


def engine_process(worker_pid: int) -> psutil.Process:
    """vLLM's engine core: the worker's child that runs it (``VLLM::EngineCore``)."""
    children = psutil.Process(worker_pid).children(recursive=True)
    found = [child for child in children if "EngineCore" in " ".join(child.cmdline())]
    found += [child for child in children if "EngineCore" in child.name()]
    assert found, [(child.name(), child.cmdline()) for child in children]
    return found[0]


async def test_an_engine_process_killed_mid_reply_has_the_reply_go_on_at_another_worker(
    vllm_stack: VllmStack,
) -> None:
    stack, vllm = vllm_stack.stack, vllm_stack.engine
    worker_id = engine_arg(vllm, "--worker-id")
    stack.synthetic(200, "--served-model-name", MODEL_NAME, worker_id="next")
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me about lighthouses."}],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, object]] = []
    killed_at = 0.0
    url = f"{vllm_stack.gateway.url}/v1/chat/completions"
    async with (
        httpx.AsyncClient(timeout=120) as client,
        client.stream("POST", url, json=body) as response,
    ):
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks.append(json.loads(line[6:]))
            if len(chunks) == 5:
                engine_process(vllm.pid).kill()
                killed_at = time.monotonic()
    assert killed_at, "the reply ended before the engine was killed"
    assert not [chunk for chunk in chunks if "error" in chunk], chunks[-3:]
    usage = next(chunk["usage"] for chunk in chunks if chunk.get("usage"))
    assert usage["completion_tokens"] == MAX_TOKENS, usage  # type: ignore[index]
    reasons = [
        choice["finish_reason"]
        for chunk in chunks
        for choice in chunk.get("choices", [])  # type: ignore[attr-defined]
        if choice["finish_reason"]
    ]
    assert reasons == ["length"], reasons
    returncode = await asyncio.to_thread(vllm.wait, 60)
    assert returncode == 1, f"the worker exited {returncode}"
    log = (stack.logs / f"engine-{worker_id}.log").read_text()
    assert "handed it to another worker" in log, log[-3000:]
    assert "the engine failed" in log
