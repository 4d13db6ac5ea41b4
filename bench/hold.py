"""How many open streams one gateway process holds: memory per stream, latency while held.

Opens K idle SSE streams (sessions with no generation: the gateway holds the connection, a
feed and a pub/sub subscription for each), then runs a small probe of active streams and
measures their latency, for K in a rising list. Gateway RSS and its Redis connections are
read at each step.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

from bench.loadgen import StreamRecord
from bench.rig import Rig
from bench.runner import create_session, open_events, run_once
from bench.stats import summarise
from stack import procfs

PROBE_STREAMS, PROBE_SPREAD_S = 10, 0.1
OPENING = 64
"""Streams opened at a time."""


async def hold_sweep(
    rig: Rig, steps: list[int], tokens_per_s: float, probe_s: float
) -> list[dict[str, Any]]:
    pid, redis_port = rig.gateway.pid, rig.servers["redis"].port
    held: list[tuple[StreamRecord, Any]] = []
    results: list[dict[str, Any]] = []
    gate = asyncio.Semaphore(OPENING)
    probe_tokens = round(tokens_per_s * probe_s)

    async def hold_one() -> None:
        async with gate:
            record = StreamRecord()
            held.append((record, await open_events(rig, await create_session(rig), record)))

    rss_empty = procfs.rss_bytes(pid)
    try:
        for target in steps:
            await asyncio.gather(*(hold_one() for _ in range(target - len(held))))
            await asyncio.sleep(1.0)
            alive = sum(1 for record, _ in held if record.failure is None)
            rss = procfs.rss_bytes(pid)
            connections = procfs.tcp_connections_to(pid, redis_port)
            run = await run_once(
                rig, "session", PROBE_STREAMS, probe_tokens, PROBE_SPREAD_S, probe_s + 20
            )
            probe = summarise("session", [run], probe_tokens)
            results.append(
                {
                    "open_streams": target,
                    "alive": alive,
                    "rss_mib": round(rss / 2**20, 1),
                    "kib_per_stream": round((rss - rss_empty) / 1024 / target, 2),
                    "gateway_redis_connections": connections,
                    "probe": probe,
                }
            )
            print(
                f"[bench] hold {target} open streams: rss {rss / 2**20:.1f} MiB, "
                f"{connections} Redis connections, probe ttft p99 "
                f"{probe['ttft_ms']['p99']} ms, itl p99 {probe['itl_ms']['p99']} ms",
                file=sys.stderr,
                flush=True,
            )
    finally:
        for _, reader in held:
            reader.close()
    return results
