"""``python -m bench.takeover``: how long a reader waits when its reply changes workers.

Starts its own Redis, one gateway and two synthetic workers (50 tokens/s). Then, ``--runs``
times for each way a worker goes:

- ``sigkill``: a reply streams over SSE; after 20 tokens the worker running it is
  SIGKILLed. Measured: from the kill to the first token the new worker wrote (the first
  token after the ``resumed`` event) reaching the reader. The gateways' reaper notices
  the lease connection close, hands the reply on, the other worker continues it.
- ``sigterm``: the same with SIGTERM: the worker hands the reply over itself.

After each run the stopped worker is replaced, so two always serve. The synthetic
engine's next token is due at once, so the figure is the takeover's own cost; with vLLM
add the prefill of prompt plus streamed tokens (docs/reliability.md). Writes
docs/bench/takeover.json.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import platform
import secrets
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench import stuck
from bench.loadgen import sse_events
from gateway.recovery.takeover import LEASE_GRACE_S
from stack import processes
from stack.rig import Rig as ProcessRig
from stack.rig import on_embedded_redis
from wire import Keys

OUT = Path(__file__).resolve().parent.parent / "docs" / "bench" / "takeover.json"
TOKENS_PER_S = 50
TOKENS_BEFORE = 20


SYNTHETIC = ["--backend", "synthetic", "--tokens-per-s", str(TOKENS_PER_S), "--drain-s", "30"]


class Rig:
    """stack/rig.py's processes, the workers by id, and a client of their Redis; a new
    worker runs ``python -m engine WORKER_ARGS`` (by default the synthetic engine)."""

    def __init__(self, procs: ProcessRig, worker_args: list[str] | None = None) -> None:
        self.procs = procs
        self.keys = Keys(procs.prefix)
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.redis = aioredis.Redis.from_url(procs.redis_url)
        self.worker_args = worker_args or SYNTHETIC

    async def start_worker(self) -> None:
        worker_id = f"w-{secrets.token_hex(4)}"
        start = functools.partial(self.procs.engine, *self.worker_args, worker_id=worker_id)
        self.workers[worker_id] = await asyncio.to_thread(start)


async def one_run(
    rig: Rig,
    client: httpx.AsyncClient,
    base: str,
    how: str,
    asked: dict[str, Any] | None = None,
    tokens_before: int = TOKENS_BEFORE,
) -> float:
    """Seconds from stopping the worker to the first token of its successor, as read: the
    worker running a reply is stopped (``how``) after ``tokens_before`` tokens of it; the
    message asks for 2,000 tokens and what ``asked`` adds (vLLM: ``ignore_eos``). The
    stopped worker is not replaced (``replaced_run`` does)."""
    created = (await client.post(f"{base}/v1/sessions")).json()
    sid, token = created["session_id"], created["token"]
    headers = {"Authorization": f"Bearer {token}"}
    sent = await client.post(
        f"{base}/v1/sessions/{sid}/messages",
        json={"content": f"bench {how}", "max_tokens": 2000, **(asked or {})},
        headers=headers,
    )
    gid = sent.json()["generation_id"]
    stopped_at = 0.0
    resumed = False
    async with client.stream(
        "GET", f"{base}/v1/sessions/{sid}/events", headers=headers
    ) as response:
        tokens = 0
        async for _id, kind, data in sse_events(response):
            if kind == "token":
                tokens += 1
                if resumed:
                    gap = time.monotonic() - stopped_at
                    break
                if tokens == tokens_before:
                    owner = await rig.redis.hget(rig.keys.generation(sid, gid), "worker")
                    worker_id = (owner or b"").decode()
                    process = rig.workers.pop(worker_id)
                    stopped_at = time.monotonic()
                    if how == "sigkill":
                        processes.kill(process)
                    else:
                        process.send_signal(signal.SIGTERM)
            elif kind == "resumed":
                resumed = True
            elif kind in ("done", "cancelled", "error"):
                raise RuntimeError(f"the reply ended with {kind}: {data}")
    await client.post(f"{base}/v1/sessions/{sid}/generations/{gid}/cancel", headers=headers)
    if how == "sigterm":
        await asyncio.to_thread(process.wait, 30)
    return gap


async def replaced_run(rig: Rig, client: httpx.AsyncClient, base: str, how: str) -> float:
    """``one_run``, then a new worker in the stopped one's place."""
    gap = await one_run(rig, client, base, how)
    await rig.start_worker()
    return gap


async def redis_uptime(redis: aioredis.Redis) -> int:
    return int((await redis.info("server"))["uptime_in_seconds"])


def summary(values: list[float]) -> dict[str, Any]:
    ms = sorted(round(v * 1000, 1) for v in values)
    return {
        "runs": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "max_ms": max(ms),
        "min_ms": min(ms),
        "all_ms": ms,
    }


async def _measure(rig: Rig, runs: int) -> dict[str, Any]:
    try:
        base = rig.procs.gateway().url
        await rig.start_worker()
        await rig.start_worker()
        results: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=60) as client:
            # For LEASE_GRACE_S after Redis starts, a lost lease proves nothing (the
            # heartbeat timeout decides): a steady state is what is measured here.
            while await redis_uptime(rig.redis) < LEASE_GRACE_S:
                await asyncio.sleep(0.1)
            for how in ("sigkill", "sigterm"):
                await replaced_run(rig, client, base, how)  # warm-up, not counted
                gaps = [await replaced_run(rig, client, base, how) for _ in range(runs)]
                results[how] = summary(gaps)
                print(how, results[how])
    finally:
        await rig.redis.aclose()
    return results


async def main(runs: int, keep_logs: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as temporary:
        logs = keep_logs or Path(temporary)
        logs.mkdir(parents=True, exist_ok=True)
        with on_embedded_redis(logs, f"bench-{secrets.token_hex(4)}") as (procs, _redis):
            results = await _measure(Rig(procs), runs)
    return {
        "backend": "synthetic",
        "tokens_per_s": TOKENS_PER_S,
        "tokens_before_stop": TOKENS_BEFORE,
        "measured": "stop (SIGKILL or SIGTERM) -> first token of the next worker at the reader",
        "targets_ms": {"sigkill_p50": 250, "sigkill_max": 1000, "sigterm_max": 100},
        "warm_up": "one run per mode not counted; started 3 s after Redis (LEASE_GRACE_S)",
        "machine": f"{platform.machine()}, {platform.python_version()}, shared 2-core box",
        **results,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.takeover", description=__doc__)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--logs", type=Path, default=None, help="keep the processes' logs here")
    args = parser.parse_args()
    report = stuck.run(main(args.runs, args.logs))
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
