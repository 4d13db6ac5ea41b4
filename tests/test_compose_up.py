"""compose.yaml run for real: the images built from docker/ on local stand-ins of the
official base images, the CPU stack up with podman-compose, checked through the proxy.

tests/support/standins.py builds the stand-in base images and the project's images (compose
build), then compose.yaml runs unchanged on podman with podman-compose; the one override,
docker/standins/compose.podman.yaml, gives the proxy the network's name server alone, as
Docker does. docs/containers.md says what this proves and what it cannot.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from stack.redis_server import free_port
from tests.support import standins
from tests.support.compose import (
    MODEL,
    ComposeRun,
    active_streams,
    assert_gap_free,
    free_subnet,
    open_connections,
    process_state,
    ready_workers,
    until_events,
    wait_until,
)
from tests.support.http import (
    TERMINAL,
    Reading,
    cancel_mid_reply,
    create_session,
    read_events,
    resume_until_final,
    send,
)
from tests.support.stack import VLLM_LOCK
from tests.support.triton import triton_reply
from tests.support.ws import open_ws


@pytest.fixture
def compose_run(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ComposeRun]:
    """Images built (cached after the first time), the CPU stack up with two gateways."""
    began = time.monotonic()
    built = standins.prepare()  # first: on a fresh machine it installs podman itself
    prepare_s = time.monotonic() - began
    project = f"ts{secrets.token_hex(3)}"
    port, grpc_port = free_port(), free_port()
    env = {
        **standins.podman_env(),
        "TOKENSPOUT_PORT": f"127.0.0.1:{port}",
        "TOKENSPOUT_GRPC_PROXY_PORT": f"127.0.0.1:{grpc_port}",
        "TOKENSPOUT_STANDIN_SUBNET": free_subnet(),
        "TOKENSPOUT_CPU_CAPACITY": "4",
        "TOKENSPOUT_DRAIN_S": "5",
        # A stopped replica cuts its streams at once. With the default grace (30 s) a stream
        # runs on to its generation's end on the draining replica (tests/test_shutdown.py):
        # on CI a story ended `done` there while `podman stop` was still on its way.
        "TOKENSPOUT_SHUTDOWN_GRACE_S": "0",
    }
    env.pop("COMPOSE_PROFILES", None)  # .env's default is what runs
    run = ComposeRun(project, f"http://127.0.0.1:{port}", env, tmp_path / "compose.log")
    run.grpc_address = f"127.0.0.1:{grpc_port}"
    run.timings["prepare_s"] = prepare_s
    run.timings.update({f"build_{name}_s": spent for name, spent in built.items()})
    with VLLM_LOCK.open("w") as lock:
        began = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)  # the containerised engine is a vLLM engine too
        run.timings["vllm_lock_wait_s"] = time.monotonic() - began
        try:
            began = time.monotonic()
            run.compose("up", "-d", "--scale", "gateway=2", timeout=600)
            run.timings["up_s"] = time.monotonic() - began
            run.timings["engine_ready_s"] = (
                wait_until(
                    lambda: bool(ready_workers(run.base)),
                    900,
                    "an engine worker behind the proxy",
                    2,
                )
                + run.timings["up_s"]
            )
            yield run
        finally:
            try:
                if run.containers():  # the test failed before its own down -v
                    for container in run.containers():  # kept in the captured output
                        logs = standins.podman("logs", "--tail", "60", container, check=False)
                        print(f"--- {container}\n{logs.stdout}{logs.stderr}")
                    print(run.log.read_text()[-6000:])
                    run.remove_extra_replicas()
                    run.compose("down", "-v", "-t", "10", timeout=300)
            finally:
                run.sweep()
                fcntl.flock(lock, fcntl.LOCK_UN)
                report = request.node.user_properties  # printed by tests/conftest.py
                report.append(("compose run", f"checks passed: {json.dumps(run.checks)}"))
                report.append(("compose run", f"timings: {json.dumps(run.timings)}"))


@pytest.mark.containers
@pytest.mark.timeout(3600)
async def test_compose_up_builds_the_images_and_serves_through_the_proxy(
    compose_run: ComposeRun,
) -> None:
    run, base = compose_run, compose_run.base
    gateways = run.containers("gateway")
    assert len(gateways) == 2, gateways
    assert run.containers("engine") == []  # the CPU profile is the default: no GPU engine
    (engine,) = run.containers("engine-cpu")
    run.passed("a plain up: the CPU engine, no GPU engine, two gateways")

    # Every service's own health check passes (podman 4.3 without systemd schedules none).
    for container in run.containers():
        run.podman("healthcheck", "run", container)

    # The gateway image carries neither torch nor vllm.
    probe = "import importlib.util as u; print([m for m in ('torch', 'vllm') if u.find_spec(m)])"
    assert run.podman("exec", gateways[0], "python", "-c", probe).strip() == "[]"
    run.passed("health checks of every service; no torch or vllm in the gateway image")

    async with httpx.AsyncClient(timeout=120) as client:
        # The web page, as a browser gets it.
        page = await client.get(f"{base}/")
        assert page.status_code == 200 and "<title>tokenspout chat</title>" in page.text
        (worker,) = (await client.get(f"{base}/ready")).json()["workers"]
        assert worker["model"] == MODEL and worker["backend"] == "vllm"
        run.passed("the web page; /ready lists the SmolLM2 worker")

        # A real SmolLM2 reply over SSE.
        session = await create_session(client, base)
        gid = await send(
            client, session, "What is the capital of France?", max_tokens=24, temperature=0
        )
        reading = await read_events(client, session, until_final_of=gid, timeout_s=600)
        assert reading.final(gid).event == "done", reading.final(gid).data
        assert "Paris" in reading.text(gid)
        run.passed("a SmolLM2 reply over SSE")

        # A real reply over a WebSocket, through the proxy's upgrade.
        ws = await open_ws(base)
        try:
            ack = await ws.generate("w", "Name a colour.", max_tokens=12, temperature=0)
            assert ack["type"] == "ack", ack
            final = await ws.final_of("w", timeout_s=600)
            assert final["type"] == "done", final
            assert ws.text("w").strip()
        finally:
            await ws.conn.close()
        run.passed("a SmolLM2 reply over a WebSocket")

        # A real reply over gRPC (Triton's client), through the proxy's HTTP/2 side.
        grpc_answer = await asyncio.to_thread(
            triton_reply, run.grpc_address, MODEL, "Name a colour."
        )
        assert grpc_answer.final["completion_tokens"] > 0 and grpc_answer.text.strip()
        run.passed("a SmolLM2 reply over gRPC (tritonclient), through the proxy")

        # A cancel: the stream ends with one `cancelled`, nothing after it.
        session = await create_session(client, base)
        # The story runs to its max_tokens on any CPU: min_tokens keeps the end of
        # sequence away (greedy text can differ between CPUs, and with it where it ends).
        long = "Write a long story about a lighthouse keeper."
        story = {"max_tokens": 400, "min_tokens": 400, "temperature": 0}
        gid = await send(client, session, long, **story)
        reading = await cancel_mid_reply(client, session, gid, 5, timeout_s=600)
        assert reading.final(gid).event == "cancelled"
        assert reading.final(gid).json()["reason"] == "user"
        assert_gap_free(reading.events, gid)
        run.passed("a cancel")

        # --scale gateway=2: the replica serving a stream stops mid-stream; the client
        # reconnects through the proxy with Last-Event-ID and the reply goes on, gap-free.
        session = await create_session(client, base)
        # The replica is found from the host's /proc (no podman exec, which took seconds
        # under load: a 200-token reply once ended before the stop reached it).
        pids = {g: int(run.podman("inspect", "--format", "{{.State.Pid}}", g)) for g in gateways}
        gid = await send(client, session, long, **story)
        reading = Reading()
        first = asyncio.create_task(
            read_events(client, session, until_final_of=gid, reading=reading, timeout_s=600)
        )
        await until_events(reading, 6, first)
        serving = [g for g in gateways if open_connections(pids[g], 8000) >= 1]
        assert len(serving) == 1 and open_connections(pids[serving[0]], 8000) == 1, serving
        # SIGTERM from the host reaches it at once and, with no grace, cuts the stream (podman's
        # own stop can take seconds: the stream must not end before the stop); `podman stop`
        # then keeps it stopped.
        at_stop = len(reading.events)
        replica = process_state(pids[serving[0]])  # what took the signal, should it not act
        os.kill(pids[serving[0]], signal.SIGTERM)
        stopped = time.monotonic()

        # The client comes back at once, as EventSource does, while `podman stop` is on its
        # way: a reader that waits for the stop (seconds, or more, under load) leaves the
        # reply unread, and past the abandon grace (30 s) the engine rightly cancels it.
        def stop_replica() -> float:
            run.podman("stop", "--time", "2", serving[0])
            return time.monotonic() - stopped

        stop = asyncio.create_task(asyncio.to_thread(stop_replica))
        try:
            await first  # the stream closes when its replica goes
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            print(f"the stream on {serving[0]} broke as its replica stopped: {exc!r}")
        after_stop = [(e.event, e.data) for e in reading.events[at_stop:]]
        print(f"{len(after_stop)} events came after the SIGTERM, the last: {after_stop[-1:]}")
        print(f"the SIGTERM went to {replica}")
        if any(e.event in TERMINAL for e in reading.of(gid)):
            await stop
            logs = run.podman("logs", "--tail", "40", serving[0])
            pytest.fail(
                f"the stream went on to its end after the SIGTERM: {after_stop[-2:]}\n"
                f"the process signalled: {replica}\nits container's log:\n{logs}"
            )
        seen = len(reading.events)
        away_s = time.monotonic() - stopped
        breaks = await resume_until_final(client, session, gid, reading)
        run.timings["replica_stop_command_s"] = await stop
        print(f"the reader came back {away_s:.1f} s after the SIGTERM; {breaks} more breaks")
        assert any(e.event == "token" for e in reading.events[seen:]), "nothing was resumed"
        tokens = sum(e.event == "token" for e in reading.of(gid))
        print(f"the story: {tokens} tokens, {at_stop} events before the SIGTERM")
        assert reading.final(gid).event == "done", reading.final(gid).data
        assert_gap_free(reading.events, gid)
        assert active_streams(run, next(g for g in gateways if g != serving[0])) == 0
        run.passed("a replica stopped mid-stream, the reply resumed through the proxy")

        # The engine is killed mid-reply and started again: the reply survives it. The
        # gateway's reaper sees the lease close and queues the continuation; the restarted
        # engine claims it (`resumed`) and streams on to `done`.
        # The engine is frozen first (SIGSTOP from the host, at once), so the restart finds
        # the reply running however long podman takes: on CI a 300-token reply once ended
        # `done` with no takeover, the restart having reached the engine only after it.
        session = await create_session(client, base)
        engine_pid = int(run.podman("inspect", "--format", "{{.State.Pid}}", engine))
        gid = await send(client, session, long, **(story | {"max_tokens": 300, "min_tokens": 300}))
        reading = Reading()
        interrupted = asyncio.create_task(
            read_events(client, session, until_final_of=gid, reading=reading, timeout_s=900)
        )
        await until_events(reading, 5, interrupted)
        os.kill(engine_pid, signal.SIGSTOP)  # frozen at once; podman's SIGKILL ends it
        began = time.monotonic()
        # Killed, waited for, started: `podman restart` gives up ("given PIDs did not die
        # within timeout") when a loaded machine takes seconds to tear a vLLM engine down.
        await asyncio.to_thread(run.podman, "kill", engine)
        await asyncio.to_thread(
            wait_until, lambda: not run.running(engine), 120, "the killed engine to stop", 0.5
        )
        await asyncio.to_thread(run.podman, "start", engine)
        run.timings["engine_restart_command_s"] = time.monotonic() - began
        await interrupted
        final = reading.final(gid)
        print(f"engine restart: the interrupted reply ended with {final.event} {final.data}")
        assert final.event == "done", final.data
        resumed_events = [e for e in reading.of(gid) if e.event == "resumed"]
        assert len(resumed_events) == 1, [e.event for e in reading.of(gid)]
        (resumed,) = resumed_events
        assert resumed.json()["takeover"] == 1, resumed.data
        assert_gap_free(reading.events, gid)
        run.timings["engine_restart_final_s"] = time.monotonic() - began
        run.timings["engine_restart_ready_s"] = await asyncio.to_thread(
            wait_until, lambda: bool(ready_workers(base)), 900, "the restarted engine", 2
        )
        gid = await send(
            client, session, "What is the capital of France?", max_tokens=24, temperature=0
        )
        reading = await read_events(
            client, session, until_final_of=gid, last_event_id=reading.events[-1].id, timeout_s=600
        )
        assert reading.final(gid).event == "done" and "Paris" in reading.text(gid)
        run.passed("an engine restart: the reply survived it (takeover), then a new reply")

    # `down -v` leaves no container, network or volume of the project. podman-compose 1.6's
    # `down` knows only the replicas compose.yaml declares, and its `up --scale gateway=1`
    # leaves the extra ones running (docker compose does both itself), so the replica
    # `--scale` added is removed first, as docs/containers.md tells podman-compose users.
    began = time.monotonic()
    run.remove_extra_replicas()
    run.compose("down", "-v", "-t", "10", timeout=300)
    run.timings["down_s"] = time.monotonic() - began
    assert run.left_over() == {"containers": [], "networks": [], "volumes": []}
    run.passed("down -v: no container, network or volume left")
