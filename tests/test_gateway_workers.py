"""``python -m gateway --workers N``: N gateway processes on one port
(gateway/server/supervisor.py), ``/metrics`` answering for all of them
(gateway/server/federation.py); real processes and Redis."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.supervisor import POLL_S, auto_workers
from stack import processes
from stack.processes import ROOT
from stack.redis_server import free_port
from tests.support.http import TERMINAL, create_session, read_events, send
from tests.support.oracle import synthetic_text
from tests.support.sse import Event
from tests.support.stack import Stack
from wire import entry_id_key

pytestmark = pytest.mark.timeout(120)

CHAT = "/v1/chat/completions"


def start_gateways(
    stack: Stack, n: int, grpc_port: int = 0, port: int | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    port = port or free_port()
    args = ["-m", "gateway", "--port", str(port), "--grpc-port", str(grpc_port)]
    parent = stack.spawn(f"gateways-{port}", [*args, "--workers", str(n)])
    url = f"http://127.0.0.1:{port}"
    processes.wait_http(f"{url}/health", parent, 60)
    wait_serving(url, n)
    return parent, url


def wait_serving(url: str, n: int) -> None:
    """Until a scrape has every process's metrics: each has finished its start-up."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        families = text_string_to_metric_families(text)
        streams = next(f for f in families if f.name == "tokenspout_gateway_active_streams")
        if len({sample.labels["process"] for sample in streams.samples}) == n:
            return
        time.sleep(0.05)
    pytest.fail(f"{n} gateway processes never all served")


def alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if Path(f"/proc/{pid}").exists()}


def children(parent: subprocess.Popen[bytes]) -> set[int]:
    path = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    return {int(pid) for pid in path.read_text().split()}


def wait_children(
    parent: subprocess.Popen[bytes], n: int, other_than: frozenset[int] = frozenset()
) -> set[int]:
    """Until ``n`` children of ``parent`` serve, none of them in ``other_than``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = children(parent)
        if len(now) == n and not now & other_than:
            return now
        time.sleep(0.05)
    pytest.fail(f"the gateway parent has children {children(parent)}, wanted {n}")


async def chat(url: str, content: str) -> str:
    """One whole chat completion on a new connection (so the kernel places each anew)."""
    body = {"model": "synthetic", "messages": [{"role": "user", "content": content}]}
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(f"{url}{CHAT}", json=body | {"max_tokens": 5})
    assert response.status_code == 200, response.text
    text: str = response.json()["choices"][0]["message"]["content"]
    assert text == synthetic_text(content, 5)
    return text


def requests_by_process(exposition: str) -> dict[str, float]:
    """Chat completions answered 200, per ``process`` label."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "tokenspout_gateway_requests_total" and labels["route"] == CHAT:
                counts[labels["process"]] = counts.get(labels["process"], 0) + sample.value
    return counts


async def test_two_processes_share_the_ports_and_metrics_answer_for_both(stack: Stack) -> None:
    stack.synthetic(200)
    grpc_port = free_port()
    parent, url = start_gateways(stack, 2, grpc_port)
    await asyncio.gather(*(chat(url, f"hello {n}") for n in range(40)))

    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(6):  # each scrape lands on either process
            scraped = await client.get(f"{url}/metrics")
            assert scraped.status_code == 200
            counts = requests_by_process(scraped.text)
            assert set(counts) == {"0", "1"} and sum(counts.values()) == 40, counts
            assert scraped.text.count("# TYPE tokenspout_gateway_generations_queued ") == 1
            assert 'tokenspout_gateway_generations_queued{process="' not in scraped.text
    for _ in range(4):  # gRPC: the same port shared, any process answers
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        try:
            assert client.is_server_live() and client.is_model_ready("synthetic")
        finally:
            client.close()
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 0


async def test_a_process_that_dies_is_replaced_and_sigterm_stops_every_one(stack: Stack) -> None:
    stack.synthetic(200)
    parent, url = start_gateways(stack, 2)
    first = children(parent)
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    now = wait_children(parent, 2, other_than=frozenset({victim}))
    wait_serving(url, 2)
    assert len(now & first) == 1  # the other one served on
    await asyncio.gather(*(chat(url, f"after {n}") for n in range(20)))
    parent.send_signal(signal.SIGTERM)
    assert parent.wait(timeout=20) == 0
    assert not alive(now)
    with socket.create_server(("127.0.0.1", int(url.rsplit(":", 1)[1]))):
        pass  # the port is free again


async def test_a_stream_resumes_on_either_process_with_last_event_id(stack: Stack) -> None:
    stack.synthetic(50)
    _, url = start_gateways(stack, 2)
    async with httpx.AsyncClient(timeout=30) as client:
        session = await create_session(client, url)
        gid = await send(client, session, "resume me", max_tokens=60)
    events: list[Event] = []
    while not any(e.event in TERMINAL for e in events):
        async with httpx.AsyncClient(timeout=30) as client:  # a new connection: any process
            last = events[-1].id if events else None
            reading = await read_events(client, session, gid, last_event_id=last, limit=5)
        events += reading.events
    ids = [e.id for e in events]
    assert len(set(ids)) == len(ids) and ids == sorted(ids, key=entry_id_key)
    text = "".join(e.json()["text"] for e in events if e.event == "token")
    assert text == synthetic_text("resume me", 60) and events[-1].event == "done"  # no gap


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_on_sigterm_new_connections_are_refused_while_a_running_stream_ends_whole(
    stack: Stack,
) -> None:
    stack.synthetic(20)  # 100 tokens: 5 s, the drain outlasts the checks below
    parent, url = start_gateways(stack, 2)
    port = int(url.rsplit(":", 1)[1])
    body = {"model": "synthetic", "messages": [{"role": "user", "content": "long"}]}
    body |= {"max_tokens": 100, "stream": True}
    chunks, ended = 0, False
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream("POST", f"{url}{CHAT}", json=body) as response,
    ):
        async for line in response.aiter_lines():
            ended = ended or line == "data: [DONE]"
            if not line.startswith("data: {"):
                continue
            chunks += 1
            if chunks == 5:
                parent.send_signal(signal.SIGTERM)
                async with asyncio.timeout(3):  # not queued on a socket nobody accepts from
                    while not await refused(port):
                        await asyncio.sleep(0.05)
                assert parent.poll() is None  # the stream's process still drains
    assert chunks >= 100 and ended
    assert await asyncio.to_thread(parent.wait, 20) == 0


async def test_processes_whose_parent_is_killed_drain_and_exit(stack: Stack) -> None:
    stack.synthetic(200)
    parent, _ = start_gateways(stack, 2)
    orphans = children(parent)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 15
    while alive(orphans):
        assert time.monotonic() < deadline, f"gateway processes {orphans} outlived their parent"
        await asyncio.sleep(0.1)


async def test_killed_with_connections_open_it_starts_again_on_its_port_at_once(
    stack: Stack,
) -> None:
    """Killed whole (a crash, a container's kill) while clients hold connections, a gateway
    of several processes is started again on its port at once: the closing connections
    left on the port (FIN_WAIT, TIME_WAIT, for a minute) do not hold it."""
    stack.synthetic(200)
    parent, url = start_gateways(stack, 2)
    async with httpx.AsyncClient(timeout=30) as client:
        for n in range(4):  # kept-alive connections, open when the gateway dies
            body = {"model": "synthetic", "messages": [{"role": "user", "content": f"{n}"}]}
            assert (await client.post(f"{url}{CHAT}", json=body)).status_code == 200
        for pid in children(parent):
            os.kill(pid, signal.SIGKILL)
        processes.kill(parent)
    again, _ = start_gateways(stack, 2, port=int(url.rsplit(":", 1)[1]))
    await chat(url, "served again")
    again.send_signal(signal.SIGTERM)
    assert again.wait(30) == 0


def gateway_exit(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_port_in_use_or_a_bad_count_is_one_clear_line(stack: Stack) -> None:
    env = stack.base_env()
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        held = gateway_exit("--port", port, "--grpc-port", "0", "--workers", "2", env=env)
    assert held.returncode != 0
    assert f"cannot start: cannot listen on 127.0.0.1:{port}" in held.stderr
    bad = gateway_exit("--workers", "none", env=env)
    assert bad.returncode != 0 and "--workers takes a number from 1 or 'auto'" in bad.stderr


def test_auto_is_one_process_below_8_cores_then_one_per_4_cores_at_most_8() -> None:
    cores = (1, 2, 4, 7, 8, 16, 31, 32, 64)
    assert [auto_workers(n) for n in cores] == [1, 1, 1, 1, 2, 4, 7, 8, 8]


def test_a_process_killed_while_it_waits_for_redis_is_started_again(stack: Stack) -> None:
    """SIGKILL (the OOM killer, an operator) of a process still starting, waiting for a
    Redis Cluster that does not answer yet (its start learns the slot map), is no failure
    to start: the process is started again and the gateway stays up (the chaos run's
    gateway_process_kill during a cluster failover stopped the whole gateway: cluster,
    seed 3)."""
    port = free_port()
    args = ["-m", "gateway", "--port", str(port), "--grpc-port", "0", "--workers", "2"]
    nobody = f"redis+cluster://127.0.0.1:{free_port()}"
    parent = stack.spawn(f"gateways-{port}", args, REDIS_URL=nobody)
    log = stack.logs / f"gateways-{port}.log"
    deadline = time.monotonic() + 30
    while log.read_text().count("gateway start: Redis does not answer") < 2:  # both wait
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    first = children(parent)
    victim = min(first)
    os.kill(victim, signal.SIGKILL)
    again = wait_children(parent, 2, other_than=frozenset({victim}))
    assert len(again & first) == 1
    time.sleep(2 * POLL_S)  # the parent's next looks at its children
    assert parent.poll() is None, log.read_text()
    # A process still waiting for Redis at start does not act on SIGTERM until it has
    # started (uvicorn holds the signal until its start-up ends): killed here.
    left = children(parent)
    parent.kill()
    parent.wait(timeout=20)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
