"""How many open streams one gateway process holds: memory per stream, latency while held.

Opens K idle SSE streams (sessions with no generation: the gateway holds the connection, a
feed and a pub/sub subscription for each), then runs a small probe of active streams and
measures their latency, for K in a rising list. Gateway RSS and its Redis connections are
read at each step.
"""

from __future__ import annotations

import asyncio

from bench.rig import Rig
from bench.runner import Stream, create_sessions, forget, open_reader, run_point
from stack import procfs

PROBE_STREAMS = 10


async def hold_sweep(
    rig: Rig, steps: list[int], tokens_per_s: float, probe_s: float
) -> list[dict[str, object]]:
    pid = rig.gateway.pid
    held: list[Stream] = []
    results: list[dict[str, object]] = []
    rss_empty = procfs.rss_bytes(pid)
    try:
        for target in steps:
            more = await create_sessions(rig, "gateway", target - len(held))
            await _open_all(rig, more)
            held += more
            await asyncio.sleep(1.0)
            alive = sum(1 for s in held for r in s.records if r.failure is None)
            rss = procfs.rss_bytes(pid)
            connections = procfs.tcp_connections_to(pid, rig.redis_port)
            probe = await run_point(rig, "gateway", PROBE_STREAMS, tokens_per_s, probe_s)
            results.append(
                {
                    "open_streams": target,
                    "alive": alive,
                    "rss_mib": round(rss / 2**20, 1),
                    "kib_per_stream": round((rss - rss_empty) / 1024 / target, 2)
                    if target
                    else None,
                    "gateway_redis_connections": connections,
                    "probe": probe,
                }
            )
            print(
                f"[bench] hold {target} open streams: rss {rss / 2**20:.1f} MiB, "
                f"{connections} Redis connections, probe ttft p99 "
                f"{probe['ttft_ms']['p99']} ms, itl p99 {probe['itl_ms']['p99']} ms",  # type: ignore[index]
                flush=True,
            )
    finally:
        for stream in held:
            stream.close()
        await forget(rig, held)
    return results


async def _open_all(rig: Rig, streams: list[Stream], concurrency: int = 64) -> None:
    gate = asyncio.Semaphore(concurrency)

    async def one(stream: Stream) -> None:
        async with gate:
            await open_reader(rig, "gateway", stream, None)

    await asyncio.gather(*(one(s) for s in streams))
