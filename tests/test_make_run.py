"""``make run`` (``python -m stack``): the whole product starts, serves, and Ctrl-C leaves
nothing behind: no process of the stack, no embedded Redis, no Redis data folder.

The synthetic engine stands in for vLLM here only to keep the test short; the same launcher
starts vLLM (``--backend vllm`` is its default), which tests/test_vllm_end_to_end.py covers.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stack.processes import ROOT
from stack.redis_server import free_port
from tests.support.http import create_session, read_events, send


def sessions_of(leaders: set[int]) -> set[int]:
    """Live processes whose session id is one of ``leaders`` (the stack starts each child in
    its own session, so this finds their children too)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # it ended while we looked
        fields = stat.rsplit(")", 1)[1].split()
        state, session = fields[0], int(fields[3])
        if session in leaders and state != "Z":
            found.add(int(entry.name))
    return found


def children_of(pid: int) -> set[int]:
    tasks = Path(f"/proc/{pid}/task")
    return {
        int(child) for task in tasks.iterdir() for child in (task / "children").read_text().split()
    }


def port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


async def talk_to(base: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        page = await client.get(f"{base}/")
        assert page.status_code == 200 and "<html" in page.text.lower()
        session = await create_session(client, base)
        generation = await send(client, session, "hello", max_tokens=5)
        reading = await read_events(client, session, until_final_of=generation)
        assert reading.final(generation).event == "done"
        assert len([e for e in reading.of(generation) if e.event == "token"]) == 5


def make_run(port: int, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``python -m stack`` with the synthetic engine on ``port``, its output in ``log``, the
    file that says where its Redis is beside it (not the user's, in ~/.cache)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "stack", "--backend", "synthetic"),
                *("--port", str(port), "--grpc-port", str(free_port())),
            ],
            cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT), "TOKENSPOUT_STACK_ENV": str(stack_env(log))},
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def stack_env(log: Path) -> Path:
    return log.with_name("stack.env")


def keys_cli(log: Path) -> subprocess.CompletedProcess[str]:
    """``python -m gateway keys list`` as a person types it after make run: no REDIS_URL."""
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    return subprocess.run(
        [sys.executable, "-m", "gateway", "keys", "list"],
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT), "TOKENSPOUT_STACK_ENV": str(stack_env(log))},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def wait_for_line(stack: subprocess.Popen[bytes], log: Path, text: str) -> None:
    """Until ``text`` is in the log; fails if the stack exits or two minutes pass."""
    deadline = time.monotonic() + 120
    while text not in log.read_text():
        assert stack.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


def test_make_run_serves_and_ctrl_c_leaves_nothing_behind(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    log = tmp_path / "stack.log"
    stack = make_run(port, env, log)
    try:
        wait_for_line(stack, log, "tokenspout is running")
        text = log.read_text()
        assert f"http://127.0.0.1:{port}" in text
        found = re.search(r"redis://127\.0\.0\.1:(\d+)/0, data in (\S+) \(removed at exit\)", text)
        assert found, text
        redis_port, redis_dir = int(found[1]), Path(found[2])
        assert redis_dir.is_dir()
        leaders = children_of(stack.pid)
        assert len(leaders) == 3, leaders  # Redis, the engine worker, the gateway
        assert sessions_of(leaders) >= leaders

        asyncio.run(talk_to(f"http://127.0.0.1:{port}"))
        the_keys_cli_finds_its_redis(log, redis_port)
        a_second_make_run_fails_at_once_naming_the_holder(port, env, tmp_path)

        stack.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process
        assert stack.wait(timeout=60) == 0, log.read_text()
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
    assert sessions_of(leaders) == set(), "processes outlived make run"
    assert not port_open(port) and not port_open(redis_port)
    assert not redis_dir.exists(), "the embedded Redis left its folder behind"
    assert "[tokenspout] stopped" in log.read_text()
    assert not stack_env(log).exists(), "make run left its Redis's address behind"
    gone = keys_cli(log)
    assert gone.returncode == 1 and "REDIS_URL" in gone.stderr, gone.stderr


def the_keys_cli_finds_its_redis(log: Path, redis_port: int) -> None:
    """The banner says where its Redis is, and the keys CLI finds it with no REDIS_URL."""
    assert f"REDIS_URL=redis://127.0.0.1:{redis_port}/0 is in {stack_env(log)}" in log.read_text()
    listed = keys_cli(log)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.strip().startswith("{") and '"keys": []' in listed.stdout


def a_second_make_run_fails_at_once_naming_the_holder(
    port: int, env: dict[str, str], tmp_path: Path
) -> None:
    """One line naming the process on the port, within seconds, and nothing started: no
    traceback, no 'still loading' while the first one answers its health checks."""
    (tmp_path / "second").mkdir()
    log = tmp_path / "second" / "stack.log"
    began = time.monotonic()
    second = make_run(port, env, log)
    assert second.wait(timeout=30) == 1
    took = time.monotonic() - began
    lines = log.read_text().splitlines()
    assert len(lines) == 1 and f"HTTP port {port} is taken by pid " in lines[0], lines
    assert "python -m gateway" in lines[0] and "PORT=" in lines[0], lines
    assert not stack_env(log).exists()
    print(f"\na second make run on port {port}: exit 1 in {took:.1f} s: {lines[0]}")


def test_ctrl_c_while_it_starts_stops_it_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """Here the engine never gets ready (its Redis is nowhere), as vLLM loading a model is
    not for a minute: Ctrl-C during that wait stops everything."""
    port = free_port()
    env = {**os.environ, "REDIS_URL": f"redis://127.0.0.1:{free_port()}"}
    log = tmp_path / "stack.log"
    stack = make_run(port, env, log)
    try:
        wait_for_line(stack, log, "waiting for the engine")
        leaders = children_of(stack.pid)
        assert len(leaders) == 2, leaders  # the engine worker, the gateway
        stack.send_signal(signal.SIGINT)
        assert stack.wait(timeout=60) == 0, log.read_text()
    finally:
        if stack.poll() is None:
            stack.kill()
            stack.wait()
    text = log.read_text()
    assert "ready in" not in text and "[tokenspout] stopped" in text, text
    assert sessions_of(leaders) == set(), "processes outlived make run"
    assert not port_open(port)
