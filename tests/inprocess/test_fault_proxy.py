"""The chaos run's network (bench/chaos/proxy.py), each fault on its own, in front of a real
Redis: what passes, when, and whose links a fault strikes. A failed soak then names the
fault, not the proxy."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from bench.chaos.proxy import FaultProxy, ProxyControl, Scope
from stack.processes import ROOT
from stack.redis_server import EmbeddedRedis

HELD_S = 0.6
MINE = Scope(pids=(os.getpid(),))


@pytest.fixture
async def proxy(redis_server: EmbeddedRedis) -> AsyncIterator[FaultProxy]:
    async with FaultProxy({0: redis_server.port}) as running:
        yield running


def through(proxy: FaultProxy) -> aioredis.Redis:
    return aioredis.Redis(port=next(iter(proxy.routes)), single_connection_client=True)


async def timed(
    command: asyncio.Future[object] | object, began: float | None = None
) -> tuple[object, float]:
    """The command's answer and the seconds it took, counted from ``began`` when given (a
    fault's strike: the hold runs from there, however late the command starts)."""
    began = time.monotonic() if began is None else began
    answer = await command  # type: ignore[misc]
    return answer, time.monotonic() - began


async def test_a_blackhole_holds_both_ways_then_delivers_everything_in_order(
    proxy: FaultProxy, redis_server: EmbeddedRedis
) -> None:
    client, direct = through(proxy), aioredis.Redis(port=redis_server.port)
    try:
        await client.delete("proxy:list")
        began = time.monotonic()
        assert proxy.strike("blackhole", MINE, held_s=HELD_S) == 1
        pushes = [client.rpush("proxy:list", n) for n in range(5)]
        answers, took = await timed(asyncio.gather(*pushes), began)
        assert answers == [1, 2, 3, 4, 5] and took >= HELD_S * 0.9, took
        assert await direct.lrange("proxy:list", 0, -1) == [b"0", b"1", b"2", b"3", b"4"]
        # A connection opened while a blackhole lasts is held as well.
        began = time.monotonic()
        proxy.strike("blackhole", MINE, held_s=HELD_S)
        late = through(proxy)
        try:
            _, took = await timed(late.ping(), began)
            assert took >= HELD_S * 0.9, took
        finally:
            await late.aclose()
    finally:
        await client.aclose()
        await direct.aclose()


@pytest.mark.parametrize(("direction", "seen_meanwhile"), [("down", b"after"), ("up", b"before")])
async def test_one_way_holds_one_direction_only(
    proxy: FaultProxy, redis_server: EmbeddedRedis, direction: str, seen_meanwhile: bytes
) -> None:
    """Down: the command runs, its answer waits. Up: the command itself waits."""
    client, direct = through(proxy), aioredis.Redis(port=redis_server.port)
    key = f"proxy:{direction}"
    try:
        await client.set(key, "before")
        proxy.strike("oneway", MINE, held_s=HELD_S, direction=direction)
        write = asyncio.create_task(client.set(key, "after"))
        await asyncio.sleep(HELD_S / 3)
        assert await direct.get(key) == seen_meanwhile
        assert not write.done()
        assert await write is True
        assert await direct.get(key) == b"after"
    finally:
        await client.aclose()
        await direct.aclose()


async def test_latency_delays_each_round_trip_for_its_time_then_stops(proxy: FaultProxy) -> None:
    client = through(proxy)
    try:
        await client.ping()
        proxy.strike("latency", MINE, held_s=0.5, delay_s=0.1)
        _, took = await timed(client.ping())
        assert took >= 0.19, took  # late both ways
        await asyncio.sleep(0.5)
        _, took = await timed(client.ping())
        assert took < 0.1, took
    finally:
        await client.aclose()


async def test_a_reset_closes_the_link_at_both_ends(
    proxy: FaultProxy, redis_server: EmbeddedRedis
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", next(iter(proxy.routes)))
    direct = aioredis.Redis(port=redis_server.port)
    try:
        writer.write(b"CLIENT SETNAME proxy-reset\r\n")
        assert await reader.readline() == b"+OK\r\n"
        assert proxy.strike("reset", MINE) == 1
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        async with asyncio.timeout(5):
            while any(c["name"] == "proxy-reset" for c in await direct.client_list()):
                await asyncio.sleep(0.02)
    finally:
        writer.close()
        await direct.aclose()


async def test_a_fault_on_a_process_strikes_its_links_only(proxy: FaultProxy) -> None:
    """Scoped by process: another process's link through the same listener passes; by
    listener, a share of the links."""
    port = next(iter(proxy.routes))
    other = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import socket, sys, time\n"
        f"s = socket.create_connection(('127.0.0.1', {port}))\n"
        "print('connected', flush=True); time.sleep(30)",
        stdout=subprocess.PIPE,
    )
    client = through(proxy)
    try:
        await client.ping()
        assert other.stdout is not None
        assert await other.stdout.readline() == b"connected\n"
        async with asyncio.timeout(5):
            while len(proxy.links) < 2:
                await asyncio.sleep(0.01)
        assert proxy.strike("blackhole", Scope(pids=(other.pid,)), held_s=5) == 1
        _, took = await timed(client.ping())  # the test's own link was not struck
        assert took < 0.5, took
        assert proxy.strike("latency", Scope(listeners=(port,)), held_s=0.1, delay_s=0.01) == 2
    finally:
        other.kill()
        await other.wait()
        await client.aclose()


async def test_the_proxy_process_takes_faults_on_its_control_port(
    redis_server: EmbeddedRedis,
) -> None:
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "bench.chaos.proxy", "--route", f"0:{redis_server.port}"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
    )
    try:
        assert process.stdout is not None
        started = json.loads(await process.stdout.readline())
        [(listen, upstream)] = started["routes"].items()
        assert int(upstream) == redis_server.port
        control = ProxyControl(started["control"])
        client = aioredis.Redis(port=int(listen), single_connection_client=True)
        try:
            await client.ping()
            began = time.monotonic()
            assert await control.strike("blackhole", pids=[os.getpid()], held_s=HELD_S) == 1
            _, took = await timed(client.ping(), began)
            assert took >= HELD_S * 0.9, took
            for wrong in ({"how": "flood"}, {"how": "oneway", "direction": "sideways"}):
                with pytest.raises(ValueError, match="no fault"):
                    await control.strike(**wrong)
        finally:
            await client.aclose()
            await control.close()
    finally:
        process.terminate()
        await process.wait()
