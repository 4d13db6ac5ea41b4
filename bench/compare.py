"""``python -m bench.compare OTHER_ROOT``: this checkout's gateway against another's, A/B.

Both gateways run on one Redis and one engine, pinned to the same CPU, and take turns on the
same points (interleaved, so a busy moment on a shared machine hits both alike). Used to
keep only the gateway changes that measure better; prints one line per point and turn.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import measure
from bench.rig import GATEWAY_CPU, HOST, Rig, rig
from bench.runner import run_point
from stack import processes
from stack.redis_server import free_port


def spawn_gateway(root: Path, the_rig: Rig, logs: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "REDIS_URL": f"redis://{HOST}:{the_rig.redis_port}/0",
        "TOKENSPOUT_KEY_PREFIX": the_rig.prefix,
        "TOKENSPOUT_GRPC_PORT": "0",  # the gateway's gRPC server: not measured here
        "TOKENSPOUT_LOG_LEVEL": "WARNING",
        "TOKENSPOUT_MAX_INFLIGHT": "24000",
        "TOKENSPOUT_SESSION_TTL_S": "600",
    }
    log = (logs / "gateway-other.log").open("ab")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway", "--host", HOST, "--port", str(port)],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    log.close()
    processes.wait_http(f"http://{HOST}:{port}/health", process, 60)
    measure.pin(process.pid, GATEWAY_CPU)
    return process, port


async def compare(
    other: Path, rounds: int, points: list[tuple[int, int, float]], server: str
) -> None:
    logs = Path(tempfile.mkdtemp(prefix="tokenspout-bench-"))
    async with rig(100.0, logs, server) as the_rig:
        process, port = spawn_gateway(other, the_rig, logs)
        try:
            contenders = {
                "this": the_rig,
                "other": dataclasses.replace(the_rig, gateway=process, gateway_port=port),
            }
            for sessions, readers, seconds in points:
                cpu: dict[str, list[float]] = {name: [] for name in contenders}
                rate: dict[str, list[float]] = {name: [] for name in contenders}
                for turn in range(rounds):
                    for name, contender in contenders.items():
                        point = await run_point(
                            contender, "gateway", sessions, 100.0, seconds, readers
                        )
                        cpu[name].append(float(point["relay_cpu_us_per_token"] or 0))  # type: ignore[arg-type]
                        rate[name].append(float(point["tokens_per_s"] or 0))  # type: ignore[arg-type]
                        print(
                            f"{sessions}x{readers} turn {turn} {name:5}: "
                            f"{point['tokens']}/{point['tokens_expected']} tokens, "
                            f"{point['tokens_per_s']} tok/s, {point['relay_cpu_us_per_token']} "
                            f"us/token, ttft p99 {point['ttft_ms']['p99']} ms, "  # type: ignore[index]
                            f"itl p99 {point['itl_ms']['p99']} ms",  # type: ignore[index]
                            flush=True,
                        )
                for name in contenders:
                    print(
                        f"== {sessions}x{readers} {name}: median "
                        f"{statistics.median(cpu[name]):.1f} us/token, "
                        f"{statistics.median(rate[name]):.0f} tok/s",
                        flush=True,
                    )
        finally:
            processes.stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__)
    parser.add_argument("other", type=Path, help="another checkout's root (e.g. /work/main)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--server", default="uvicorn", help="this checkout's server")
    args = parser.parse_args()
    points = [(20, 25, 3.0), (200, 1, 4.0)]
    asyncio.run(compare(args.other.resolve(), args.rounds, points, args.server))


if __name__ == "__main__":
    main()
