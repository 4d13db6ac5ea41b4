"""vLLM on the CPU, alone and behind tokenspout: time to first token and tokens/s.

``python -m bench.engine_vs_gateway`` runs the same prompts (greedy, 64 tokens) twice:

1. **engine alone**: vLLM's AsyncLLM in this process, through ``engine.backends.vllm_backend``
   (the worker's own backend; no Redis, no HTTP);
2. **through the gateway**: embedded Redis, one engine worker process, one gateway process;
   the client POSTs the message and reads the session's SSE stream.

TTFT is measured from the request (``generate`` call / the POST) to the first token's
arrival; tokens/s over the tokens after the first. Results: docs/bench/engine_vs_gateway.*.
Only one vLLM runs at a time (the same lock the tests take).
"""

from __future__ import annotations

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

from engine.backends.vllm_backend import VllmBackend
from engine.model import MODEL_NAME, prepare_default_model
from stack import processes
from stack.redis_server import EmbeddedRedis, free_port
from wire import ChatMessage, GenerationRequest, SamplingParams

PROMPTS = [
    "What is the capital of France?",
    "Name three colours of the rainbow.",
    "Write one sentence about the sea.",
    "What is two plus two?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
]
MAX_TOKENS = 64
OUT = Path(__file__).resolve().parent.parent / "docs" / "bench"
LOCK = Path("/tmp/tokenspout-vllm.lock")


def say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def summary(samples: list[dict[str, float]]) -> dict[str, float]:
    ttft = [s["ttft_s"] for s in samples]
    rate = [s["tokens_per_s"] for s in samples]
    return {
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


async def engine_alone(model: str) -> tuple[float, list[dict[str, float]]]:
    backend = VllmBackend(
        model, served_name=MODEL_NAME, capacity=8, dtype="float32", enforce_eager=True
    )
    began = time.monotonic()
    await backend.start()
    startup = time.monotonic() - began
    samples = []
    try:
        for prompt in PROMPTS:
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
            samples.append(sample(started, arrivals, tokens))
    finally:
        await backend.stop()
    return startup, samples


async def through_gateway(logs: Path) -> tuple[float, list[dict[str, float]]]:
    with EmbeddedRedis() as redis:
        env = {"REDIS_URL": redis.url, "TOKENSPOUT_KEY_PREFIX": "bench"}
        began = time.monotonic()
        engine = processes.engine(
            ["--backend", "vllm", "--model", "default", "--capacity", "8"],
            env,
            logs / "engine.log",
        )
        port = free_port()
        gateway = processes.gateway(port, env, logs / "gateway.log")
        base = f"http://127.0.0.1:{port}"
        try:
            processes.wait_http(f"{base}/ready", engine, 600)
            startup = time.monotonic() - began
            async with httpx.AsyncClient(base_url=base, timeout=300) as client:
                return startup, [await _one(client, prompt) for prompt in PROMPTS]
        finally:
            processes.stop(gateway)
            processes.stop(engine)


async def _one(client: httpx.AsyncClient, prompt: str) -> dict[str, float]:
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


async def main() -> None:
    # As engine/__main__.py does on a CPU: a fixed KV cache, so vLLM does not insist on
    # reserving 92% of the machine's memory (it refuses to start when others use more).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    OUT.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    say(f"process logs in {logs}")
    model = str(prepare_default_model())
    with LOCK.open("w") as lock:  # noqa: ASYNC230 - once, before any work
        say("waiting for the vLLM lock")
        fcntl.flock(lock, fcntl.LOCK_EX)
        say(f"engine alone: {len(PROMPTS)} prompts, {MAX_TOKENS} tokens each")
        alone_startup, alone = await engine_alone(model)
        say(f"through the gateway: {len(PROMPTS)} prompts")
        gateway_startup, via = await through_gateway(logs)
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "engine_alone": {"startup_s": alone_startup, **summary(alone), "samples": alone},
        "through_gateway": {"startup_s": gateway_startup, **summary(via), "samples": via},
    }
    a, g = result["engine_alone"], result["through_gateway"]
    result["added_ttft_p50_ms"] = g["ttft_p50_ms"] - a["ttft_p50_ms"]
    result["tokens_per_s_ratio"] = g["tokens_per_s_p50"] / a["tokens_per_s_p50"]
    (OUT / "engine_vs_gateway.json").write_text(json.dumps(result, indent=2) + "\n")
    (OUT / "engine_vs_gateway.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r: dict[str, Any]) -> str:
    a, g = r["engine_alone"], r["through_gateway"]
    return (
        "# vLLM on the CPU: alone and behind tokenspout\n\n"
        f"`python -m bench.engine_vs_gateway`: SmolLM2-135M-Instruct (float32, eager), "
        f"{len(r['prompts'])} prompts one after another, greedy, {r['max_tokens']} tokens.\n"
        "TTFT from the request to the first token; tokens/s after the first token.\n\n"
        "| | start-up s | TTFT p50 ms | TTFT max ms | tokens/s p50 |\n"
        "| --- | --- | --- | --- | --- |\n"
        f"| engine alone (AsyncLLM in-process) | {a['startup_s']:.1f} | {a['ttft_p50_ms']:.0f}"
        f" | {a['ttft_max_ms']:.0f} | {a['tokens_per_s_p50']:.1f} |\n"
        f"| through the gateway (Redis + SSE) | {g['startup_s']:.1f} | {g['ttft_p50_ms']:.0f}"
        f" | {g['ttft_max_ms']:.0f} | {g['tokens_per_s_p50']:.1f} |\n\n"
        f"Added TTFT p50: {r['added_ttft_p50_ms']:.0f} ms; tokens/s through the gateway / "
        f"alone: {r['tokens_per_s_ratio']:.2f}. Start-up through the gateway counts the "
        "worker process (importing vLLM, loading the model) until `/ready`.\n"
        "The machine has 2 cores shared with whatever else runs; absolute numbers vary.\n"
    )


if __name__ == "__main__":  # vLLM starts its engine process with spawn: keep this guard
    asyncio.run(main())
