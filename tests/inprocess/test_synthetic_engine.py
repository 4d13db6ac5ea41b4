"""The synthetic engine steps like a real one: requests that run share its steps, and an
idle engine takes a new request at once instead of at its next step."""

from __future__ import annotations

import asyncio
import time

from engine.backends.synthetic import SyntheticBackend
from wire import ChatMessage, GenerationRequest, SamplingParams

PERIOD_S = 2.0
"""One step every two seconds: a request that waited for a step would show it."""


async def first_token_after_s(backend: SyntheticBackend, gid: str, max_tokens: int) -> float:
    """Seconds from the request to its first token; the request is then read to its end."""
    request = GenerationRequest(
        gid, "s", SamplingParams(max_tokens=max_tokens), [ChatMessage("user", "step")]
    )
    began = time.monotonic()
    deltas = backend.generate(await backend.prepare(request))
    await anext(deltas)
    waited = time.monotonic() - began
    async for _ in deltas:
        pass
    return waited


async def test_an_idle_engine_takes_a_request_at_once_and_a_busy_one_at_its_next_step() -> None:
    backend = SyntheticBackend(tokens_per_s=1 / PERIOD_S)
    assert await first_token_after_s(backend, "g1", 1) < PERIOD_S / 4  # nothing ran yet
    # g1 ended with that step: the engine is idle again, and g2 must not wait a period.
    assert await first_token_after_s(backend, "g2", 1) < PERIOD_S / 4
    assert backend.running() == 0
    # While a request runs, one that arrives joins its next step, as in vLLM's batch.
    first_of_g3 = asyncio.create_task(first_token_after_s(backend, "g3", 2))
    while backend.running() == 0:  # g3 has made its first token, at once
        await asyncio.sleep(0.01)
    assert PERIOD_S / 2 < await first_token_after_s(backend, "g4", 1) < PERIOD_S * 1.5
    assert await first_of_g3 < PERIOD_S / 4


async def test_stop_ends_the_stepping_loop_an_aborted_run_left_asleep() -> None:
    backend = SyntheticBackend(tokens_per_s=1 / PERIOD_S)
    request = GenerationRequest(
        "g1", "s", SamplingParams(max_tokens=5), [ChatMessage("user", "step")]
    )
    deltas = backend.generate(await backend.prepare(request))
    await anext(deltas)
    await backend.abort("g1")
    await deltas.aclose()
    assert backend.running() == 0

    def stepping() -> list[asyncio.Task[object]]:
        tasks = asyncio.all_tasks()
        return [t for t in tasks if t.get_name() == "synthetic-steps" and not t.done()]

    assert stepping()  # asleep until its next step, two seconds on
    began = time.monotonic()
    await backend.stop()
    assert not stepping() and time.monotonic() - began < PERIOD_S / 4


async def test_a_prepare_spends_its_cpu_on_the_event_loop() -> None:
    """``prepare_cpu_s``: each prepare holds the caller's thread for that much CPU, so a
    burst is admitted one request after another, as vLLM's chat template and tokenizer do."""
    backend = SyntheticBackend(1000, prepare_cpu_s=0.005)
    request = GenerationRequest("g", "s", SamplingParams(max_tokens=1), [ChatMessage("user", "x")])
    began = time.thread_time()
    await asyncio.gather(*(backend.prepare(request) for _ in range(20)))
    assert time.thread_time() - began >= 20 * 0.005
