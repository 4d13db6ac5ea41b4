"""vLLM on the CPU, alone and behind tokenspout: time to first token and tokens/s.

``python -m bench.engine_vs_gateway`` runs the same prompts (greedy, 64 tokens, one at a
time; each side first answers one warm-up prompt that is not counted):

1. **engine alone**: vLLM's AsyncLLM in this process, through ``engine.backends.vllm_backend``
   (the worker's own backend, chat template and tokenisation included; no Redis, no HTTP);
2. **through the gateway**: embedded Redis, one engine worker process, one gateway process;
   each prompt twice, alternating: streamed from ``POST /v1/chat/completions`` (one
   request), and POSTed to a session whose SSE stream is already open (the session API).

vLLM on a CPU binds its engine core's threads to all CPUs but the last, which it keeps for
everything else (its log: ``reserved_cpus``). On both sides everything but the engine core
is pinned there once the engine has started: vLLM's front end (this process in the first
part, the engine worker in the second), the client, the gateway and Redis (``--no-pin``:
wherever the kernel puts them).

TTFT is measured from the request (``prepare`` call / the POST) to the first token's
arrival; tokens/s over the tokens after the first. Results: docs/bench/engine_vs_gateway.*.
Only one vLLM runs at a time (the same lock the tests take).
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import report
from engine.backends.vllm_backend import VllmBackend
from engine.model import MODEL_NAME, prepare_default_model
from stack import processes
from stack.procfs import pin
from stack.redis_server import free_port
from stack.rig import VLLM_LOCK, on_embedded_redis
from wire import ChatMessage, GenerationRequest, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Suggest a name for a small cat.",
    "What does a bee make?",
    "Say hello in French.",
    "How many legs does a spider have?",
    "Describe a sunset in five words.",
    "What is the opposite of cold?",
]
WARM_UP = "Hello!"
MAX_TOKENS = 64
OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    ttft = [s["ttft_s"] for s in samples]
    rate = [s["tokens_per_s"] for s in samples]
    # Through the gateway: each reply's TTFT less the engine's own part of it (the worker's
    # ``tokenspout_engine_own_time_to_first_token_seconds``), i.e. what the path added.
    # Split: the worker's part (enqueued -> emitted, less the engine's own) and the rest
    # (the gateway's intake before the enqueue, the write, relay and SSE after the emit).
    parts = {}
    if samples and "engine_own_s" in samples[0]:
        parts = {
            "path_ttft_p50_ms": [s["ttft_s"] - s["engine_own_s"] for s in samples],
            "worker_part_p50_ms": [s["worker_s"] - s["engine_own_s"] for s in samples],
            "gateway_part_p50_ms": [s["ttft_s"] - s["worker_s"] for s in samples],
        }
    return {
        **{name: 1000 * statistics.median(values) for name, values in parts.items()},
        "ttft_p50_ms": 1000 * statistics.median(ttft),
        "ttft_max_ms": 1000 * max(ttft),
        "tokens_per_s_p50": statistics.median(rate),
        "tokens": sum(s["tokens"] for s in samples),
    }


def sample(started: float, arrivals: list[float], tokens: int) -> dict[str, float]:
    span = arrivals[-1] - arrivals[0]
    return {
        "ttft_s": arrivals[0] - started,
        "tokens": tokens,
        "tokens_per_s": (tokens - 1) / span if span > 0 else 0.0,
    }


def reserved_cpu() -> int:
    """The CPU vLLM leaves to everything but its engine core (the last)."""
    return (os.cpu_count() or 1) - 1


def unpin_this_process() -> None:
    """Every CPU again for all of this process's threads, before an engine starts (a child
    keeps the CPUs of its parent, and vLLM binds its engine core among those)."""
    if hasattr(os, "sched_setaffinity"):
        every = set(range(os.cpu_count() or 1))
        for thread in Path("/proc/self/task").iterdir():
            os.sched_setaffinity(int(thread.name), every)


async def engine_alone(model: str, pinned: bool) -> tuple[float, list[dict[str, float]]]:
    backend = VllmBackend(
        model, served_name=MODEL_NAME, capacity=8, dtype="float32", enforce_eager=True
    )
    unpin_this_process()
    began = time.monotonic()
    await backend.start()
    startup = time.monotonic() - began
    if pinned:
        pin(os.getpid(), reserved_cpu(), children=False)
    samples = []
    try:
        for index, prompt in enumerate([WARM_UP, *PROMPTS]):
            request = GenerationRequest(
                generation_id=f"g_{secrets.token_hex(6)}",
                session_id="bench",
                params=SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                messages=[ChatMessage("user", prompt)],
            )
            started = time.monotonic()
            prepared = await backend.prepare(request)
            arrivals, tokens = [], 0
            async for delta in backend.generate(prepared):
                if delta.token_ids:
                    arrivals.append(time.monotonic())
                    tokens += len(delta.token_ids)
            if index:
                samples.append(sample(started, arrivals, tokens))
    finally:
        await backend.stop()
    return startup, samples


Paths = dict[str, list[dict[str, float]]]


async def through_gateway(logs: Path, pinned: bool) -> tuple[float, Paths]:
    with on_embedded_redis(logs, "bench") as (procs, redis):
        unpin_this_process()
        began = time.monotonic()
        metrics_port = free_port()
        worker_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        flags = ["--backend", "vllm", "--model", "default", "--capacity", "8"]
        engine = procs.engine(*flags, "--metrics-port", str(metrics_port), wait=False)
        gateway = procs.gateway()
        base = gateway.url
        processes.wait_http(f"{base}/ready", engine, 600)
        startup = time.monotonic() - began
        if pinned:  # the worker once its engine core runs: that keeps its own CPUs
            assert redis.process is not None
            for pid in (redis.process.pid, gateway.process.pid, engine.pid, os.getpid()):
                procs.pin(pid, reserved_cpu(), children=False)
        asks = {"openai": _by_openai, "session": _by_session}
        paths: Paths = {path: [] for path in asks}
        async with httpx.AsyncClient(base_url=base, timeout=300) as client:
            for ask in asks.values():
                await ask(client, WARM_UP)
            sums = await _worker_sums(client, worker_metrics)
            for prompt in PROMPTS:
                for path, ask in asks.items():
                    paths[path].append(await ask(client, prompt))
                    sums, before = await _worker_sums(client, worker_metrics), sums
                    for name, total in sums.items():
                        paths[path][-1][name] = total - before[name]
        return startup, paths


WORKER_SUMS = {
    "engine_own_s": "tokenspout_engine_own_time_to_first_token_seconds_sum",
    "worker_s": "tokenspout_engine_time_to_first_token_seconds_sum",
}
"""The worker's running totals over first tokens: the engine's own part (preparing the
request, the first step), and all of it from the gateway's enqueue to the token's emit."""


async def _worker_sums(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """``WORKER_SUMS`` now: read after each reply, their growth is that reply's."""
    values = dict(
        line.split()[:2]
        for line in (await client.get(url)).text.splitlines()
        if line and line[0] != "#"
    )
    return {name: float(values[metric]) for name, metric in WORKER_SUMS.items()}


async def _by_openai(client: httpx.AsyncClient, prompt: str) -> dict[str, float]:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    arrivals: list[float] = []
    tokens = 0
    started = time.monotonic()
    async with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        assert stream.status_code == 200, await stream.aread()
        async for line in stream.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.monotonic())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return sample(started, arrivals, tokens)


async def _by_session(client: httpx.AsyncClient, prompt: str) -> dict[str, float]:
    session = (await client.post("/v1/sessions")).json()
    headers = {"X-Session-Token": session["token"]}
    sid = session["session_id"]
    arrivals: list[float] = []
    tokens = 0
    async with client.stream(
        "GET", f"/v1/sessions/{sid}/events", headers=headers, params={"last_event_id": "$"}
    ) as stream:
        lines = stream.aiter_lines()
        await anext(lines)  # retry: the stream is open before the message goes
        started = time.monotonic()
        body = {"content": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        posted = await client.post(f"/v1/sessions/{sid}/messages", json=body, headers=headers)
        assert posted.status_code == 202, posted.text
        event = ""
        async for line in lines:
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "token":
                arrivals.append(time.monotonic())
                tokens += len(json.loads(line[6:])["token_ids"])
            elif line.startswith("data: ") and event in ("done", "cancelled", "error"):
                break
    return sample(started, arrivals, tokens)


async def main(pinned: bool, rounds: int) -> None:
    # As engine/__main__.py does on a CPU: a fixed KV cache, so vLLM does not insist on
    # reserving 92% of the machine's memory (it refuses to start when others use more).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    say(f"process logs in {logs}")
    model = str(prepare_default_model())
    with VLLM_LOCK.open("w") as lock:
        say("waiting for the vLLM lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        alone: list[dict[str, float]] = []
        via: Paths = {path: [] for path in PATH_NAMES}
        by_round: list[dict[str, float]] = []
        for round_ in range(1, rounds + 1):
            say(f"round {round_}/{rounds}, engine alone: {len(PROMPTS)} prompts")
            alone_startup, alone_now = await engine_alone(model, pinned)
            say(f"round {round_}/{rounds}, through the gateway: {len(PROMPTS)} prompts per path")
            gateway_startup, via_now = await through_gateway(logs, pinned)
            alone += alone_now
            base = summary(alone_now)["ttft_p50_ms"]
            by_round.append({"alone_ttft_p50_ms": base})
            for path, samples in via_now.items():
                via[path] += samples
                by_round[-1][f"{path}_added_ttft_p50_ms"] = summary(samples)["ttft_p50_ms"] - base
            say(f"round {round_}: {by_round[-1]}")
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "pinned": pinned,
        "rounds": by_round,
        "engine_alone": {"startup_s": alone_startup, **summary(alone), "samples": alone},
        "through_gateway": {"startup_s": gateway_startup},
    }
    a = result["engine_alone"]
    for path, samples in via.items():
        g = result["through_gateway"][path] = {**summary(samples), "samples": samples}
        g["added_ttft_p50_ms"] = g["ttft_p50_ms"] - a["ttft_p50_ms"]
        g["tokens_per_s_ratio"] = g["tokens_per_s_p50"] / a["tokens_per_s_p50"]
    report.write(OUT, "engine_vs_gateway", result, markdown(result))
    print(markdown(result))


PATH_NAMES = {
    "openai": "through the gateway: `POST /v1/chat/completions`, streamed",
    "session": "through the gateway: session API (message POSTed, SSE open)",
}


def markdown(r: dict[str, Any]) -> str:
    a, g = r["engine_alone"], r["through_gateway"]
    rows = [
        f"| engine alone (AsyncLLM in-process) | {a['startup_s']:.1f} | {a['ttft_p50_ms']:.1f}"
        f" | {a['ttft_max_ms']:.1f} | {a['tokens_per_s_p50']:.2f} | | | |"
    ]
    for path, name in PATH_NAMES.items():
        p = g[path]
        rows.append(
            f"| {name} | {g['startup_s']:.1f} | {p['ttft_p50_ms']:.1f} | {p['ttft_max_ms']:.1f}"
            f" | {p['tokens_per_s_p50']:.2f} | {p['added_ttft_p50_ms']:+.1f}"
            f" | {p['path_ttft_p50_ms']:.1f} ({p['worker_part_p50_ms']:.1f} +"
            f" {p['gateway_part_p50_ms']:.1f}) | {p['tokens_per_s_ratio']:.3f} |"
        )
    return (
        "# vLLM on the CPU: alone and behind tokenspout\n\n"
        f"`python -m bench.engine_vs_gateway`: SmolLM2-135M-Instruct (float32, eager), "
        f"{len(r['prompts'])} prompts one after another (each side answers one warm-up "
        f"prompt first, not counted), greedy, {r['max_tokens']} tokens; the two sides take "
        f"turns, {len(r['rounds'])} rounds each, and the table pools the rounds.\n"
        "TTFT from the request to the first token; tokens/s after the first token. The "
        "path's own TTFT: each reply's TTFT less the engine's own part of it, which the "
        "worker measures (preparing the request, the engine's first step: "
        "`tokenspout_engine_own_time_to_first_token_seconds`), so the engine's run-to-run "
        "drift, which the added TTFT carries, is not in it. Its worker part: from the "
        "gateway's enqueue to the first token's emit, less the engine's own part (taking the "
        "request, the claim's round trip); its gateway part: the rest (the request to its "
        "enqueue, then the token's write, relay and SSE to the client). Each part's p50 is "
        "its own, so they need not add up exactly.\n\n"
        "| | start-up s | TTFT p50 ms | TTFT max ms | tokens/s p50 | added TTFT p50 ms"
        " | the path's own TTFT p50 ms (worker + gateway) | tokens/s vs alone |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + "\n\n"
        + (
            "Pinned: everything but vLLM's engine core (the front end, the client, the gateway, "
            "Redis) on the CPU vLLM reserves for the rest (the last).\n"
            if r.get("pinned")
            else ""
        )
        + "Added TTFT p50 by round (OpenAI / session API): "
        + ", ".join(
            f"{x['openai_added_ttft_p50_ms']:+.1f} / {x['session_added_ttft_p50_ms']:+.1f} ms"
            f" (alone {x['alone_ttft_p50_ms']:.1f} ms)"
            for x in r["rounds"]
        )
        + ".\n"
        + "Start-up through the gateway counts the worker process (importing vLLM, loading the "
        "model) until `/ready`.\n"
        "The machine has 2 cores shared with whatever else runs; absolute numbers vary.\n"
    )


if __name__ == "__main__":  # vLLM starts its engine process with spawn: keep this guard
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-pin", action="store_true", help="pin nothing (see the module's doc)")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each side")
    options = parser.parse_args()
    asyncio.run(main(pinned=not options.no_pin, rounds=options.rounds))
