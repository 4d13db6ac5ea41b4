"""Real parts for every test: a Redis server, gateway and engine processes, vLLM on the CPU."""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from stack.redis_cluster import EmbeddedCluster
from stack.redis_sentinel import EmbeddedSentinel
from stack.redis_server import EmbeddedRedis, free_port
from tests.support import groups
from tests.support.engines import RUNNING, SYNTHETIC_TOKENS_PER_S, EngineUnderTest
from tests.support.stack import VLLM_LOCK, Gateway, Stack, VllmStack

if TYPE_CHECKING:
    from playwright.async_api import Browser


def _closes_an_async_generator(task: asyncio.Task[object]) -> bool:
    """The loop's own task that closes an async generator dropped before its end (clients'
    SSE decoders leave those when a stream ends): it finishes by itself."""
    return type(task.get_coro()).__name__ == "async_generator_athrow"


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives as long as the session: frozen, the collector no
    longer walks it, so the collection each test ends with (``no_task_outlives_its_test``)
    looks at what the tests made only. It walked some 140,000 objects each time: 60 to
    230 ms a test, a third to a half of the in-process tier's time."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
async def no_task_outlives_its_test() -> AsyncIterator[None]:
    """A test ends with every task it started ended, and its garbage collected.

    A task left running is destroyed when the test's event loop closes; what it held (a
    half-open connection, a coroutine it never started) then warns from the garbage
    collector, in whichever later test that happens to run, and fails that one instead.
    """
    yield
    gc.collect()  # what the test dropped warns here, in this test
    await asyncio.sleep(0)  # and the generators it dropped start closing
    current = asyncio.current_task()
    pending = [task for task in asyncio.all_tasks() if task is not current and not task.done()]
    leaked = [
        task
        for task in pending
        if not task.cancelling() and not _closes_an_async_generator(task)  # those end now
    ]
    for task in leaked:
        task.cancel()
    async with asyncio.timeout(10):
        await asyncio.gather(*pending, return_exceptions=True)
    assert not leaked, f"tasks outlived the test: {leaked}"


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def restartable_redis(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    """A Redis of the test's own, with its data on disk (AOF): the test may stop, kill or
    wipe it and start it again."""
    server = EmbeddedRedis(data_dir=tmp_path / "redis", persist=True)
    server.data_dir.mkdir()
    with server:
        yield server


@pytest.fixture(name="redis")
async def async_redis(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client of the session's Redis server (the fixture is named ``redis``)."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def stack(redis_server: EmbeddedRedis, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(redis_server.url, f"t-{secrets.token_hex(4)}", tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[EmbeddedCluster]:
    """A Redis Cluster on loopback: 3 primaries with a replica each (stack/redis_cluster.py),
    shared by the session; a test that kills a node waits for the cluster to heal after."""
    with EmbeddedCluster(primaries=3, replicas=1) as cluster:
        yield cluster


@pytest.fixture
def cluster_stack(redis_cluster: EmbeddedCluster, tmp_path: Path) -> Iterator[Stack]:
    """A test's processes on the cluster (``REDIS_URL=redis+cluster://...``)."""
    stack = Stack(redis_cluster.url, f"c-{secrets.token_hex(4)}", tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def redis_sentinel() -> Iterator[EmbeddedSentinel]:
    """A primary, one replica and 3 Sentinels on loopback (stack/redis_sentinel.py), one
    set per test: a test may kill the primary."""
    with EmbeddedSentinel(replicas=1, sentinels=3) as sentinel:
        yield sentinel


@pytest.fixture
def sentinel_stack(redis_sentinel: EmbeddedSentinel, tmp_path: Path) -> Iterator[Stack]:
    """A test's processes on Sentinel (``REDIS_URL=redis+sentinel://...``)."""
    stack = Stack(redis_sentinel.url, f"s-{secrets.token_hex(4)}", tmp_path)
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def vllm_stack(
    redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmStack]:
    """One real vLLM worker (SmolLM2 on the CPU) and a gateway, shared by the session."""
    logs = tmp_path_factory.mktemp("vllm")
    stack = Stack(redis_server.url, f"v-{secrets.token_hex(4)}", logs)
    with VLLM_LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            engine = stack.engine(
                "--backend",
                "vllm",
                "--model",
                "default",
                "--capacity",
                "8",
                "--tool-call-parser",
                "hermes",
                "--metrics-port",
                str(free_port()),
            )
            gateway = stack.gateway()
            yield VllmStack(stack, gateway, engine)
        except Exception:
            for path in logs.iterdir():
                print(path.read_text()[-4000:])
            raise
        finally:
            stack.stop()
            fcntl.flock(lock, fcntl.LOCK_UN)


_vllm_gateways: dict[str, dict[str, Gateway]] = {}
"""Extra gateways of the session's vLLM stack (by key prefix), kept as long as the stack is."""


@pytest.fixture(
    params=[
        pytest.param("synthetic", id="synthetic"),
        pytest.param("synthetic-cluster", id="synthetic-cluster", marks=pytest.mark.cluster),
        pytest.param("vllm", id="vllm", marks=pytest.mark.vllm),
    ]
)
def engine(request: pytest.FixtureRequest) -> Iterator[EngineUnderTest]:
    """The engine under test of tests/test_backend_*.py, once per backend (the synthetic
    one also on a Redis Cluster)."""
    if request.param.startswith("synthetic"):
        on_cluster = request.param == "synthetic-cluster"
        stack: Stack = request.getfixturevalue("cluster_stack" if on_cluster else "stack")
        # Capacity 1: one long generation fills the worker for the cancel-while-queued case;
        # every other test runs one generation at a time.
        process = stack.synthetic(
            SYNTHETIC_TOKENS_PER_S, "--capacity", "1", "--metrics-port", str(free_port())
        )
        yield EngineUnderTest(request.param, stack, stack.gateway(), process, short_max_tokens=20)
        return
    vllm: VllmStack = request.getfixturevalue("vllm_stack")
    under_test = EngineUnderTest(
        "vllm",
        vllm.stack,
        vllm.gateway,
        vllm.engine,
        short_max_tokens=20,
        sampling={"temperature": 0},
        _gateways=_vllm_gateways.setdefault(vllm.stack.prefix, {}),
    )
    # A test that failed half-way may have left requests in the shared engine.
    deadline = time.monotonic() + 60
    while under_test.metric(RUNNING) != 0:
        assert time.monotonic() < deadline, "the shared vLLM engine stays busy"
        time.sleep(0.2)
    yield under_test


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """Headless Chromium (tests/support/browser.py), for the web chat's tests."""
    from tests.support.browser import chromium

    async with chromium() as browser:
        yield browser


def pytest_report_header() -> str:
    return f"tokenspout tests: real Redis, real processes (pid {os.getpid()})"


REPORTED = ("compose run",)
"""Properties a test records (``request.node.user_properties``) that the session prints at
its end, pass or fail: CI's log keeps the compose run's build and up times. They come with
the test's reports, so a run's worker processes (pytest-xdist) send them too."""
_reported: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _reported.extend(
            f"{name} {line}" for name, line in report.user_properties if name in REPORTED
        )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _reported:
        terminalreporter.write_line(line)


VLLM_MARKS = ("vllm", "own_vllm", "ends_vllm", "containers")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Container tests and those with a vLLM of their own first: their engine takes VLLM_LOCK,
    which the session's ``vllm_stack`` holds from its first use to the session's end (a later
    take would wait on itself). The one that ends the session's vLLM last."""

    def place(item: pytest.Item) -> int:
        if any(map(item.get_closest_marker, ("containers", "own_vllm"))):
            return 0
        return 2 if item.get_closest_marker("ends_vllm") else 1

    items.sort(key=place)
    # `make test` runs two processes: every test that runs a vLLM engine goes to one of them,
    # in the order above, so one engine runs at a time and the session's starts once.
    groups.write_group(
        item.nodeid for item in items if any(map(item.get_closest_marker, VLLM_MARKS))
    )


def pytest_configure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "dist", "no") != "no":
        groups.name_the_file()


def pytest_unconfigure(config: pytest.Config) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        groups.forget_the_file()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> groups.OneGroupScheduling:
    return groups.OneGroupScheduling(config, log)
