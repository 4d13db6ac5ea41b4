"""The engine under test of the suite that runs on both backends (tests/test_backend_*.py):
a gateway URL, the worker's Prometheus ``/metrics`` (``tokenspout_engine_running``: requests
the inference engine itself holds) and ways to start more gateways on the same key prefix;
the ``engine`` fixture (tests/conftest.py) gives one per backend."""

from __future__ import annotations

import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from engine.model import MODEL_NAME
from tests.support.http import Reading, Session, cancel
from tests.support.metrics import sample, scrape_blocking, value
from tests.support.redis_probes import after_final, async_client, stream_entries, stream_events
from tests.support.stack import Gateway, Stack
from wire import Keys, entry_ms

LONG = 1500
"""max_tokens of a generation every test cancels: minutes of decoding for vLLM here (10-20
tokens/s) and 75 s for the synthetic engine, so it cannot end by itself during the test."""
SYNTHETIC_TOKENS_PER_S = 20
STOP_WITHIN_S = 10.0
"""How soon after a cancel the engine must hold no request: one decode step is well under a
second; the rest is slack for a shared CPU and the worker's 1 s metrics refresh."""
PROMPT = "Write a long story about a lighthouse keeper, the sea and a storm."
RUNNING = "tokenspout_engine_running"
WASTE = "tokenspout_engine_tokens_after_cancel_total"
CANCELS = "tokenspout_engine_cancels_total"


def engine_arg(process: subprocess.Popen[bytes], flag: str) -> str:
    args = [str(arg) for arg in process.args]  # type: ignore[union-attr]
    return args[args.index(flag) + 1]


def metric(port: str, name: str, unset: float | None = None, **labels: str) -> float:
    """A sample of the worker's Prometheus ``/metrics`` (a counter's ``_total``); ``unset``
    for a labelled counter that has no sample yet."""
    samples = scrape_blocking(f"http://127.0.0.1:{port}/metrics")
    if unset is not None and sample(samples, name, **labels) is None:
        return unset
    return value(samples, name, **labels)


@dataclass
class EngineUnderTest:
    backend: str
    stack: Stack
    gateway: Gateway
    process: subprocess.Popen[bytes]
    short_max_tokens: int
    """max_tokens of a generation that ends by itself, cheap on either engine."""
    sampling: dict[str, Any] = field(default_factory=dict)
    _gateways: dict[str, Gateway] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.gateway.url

    @property
    def model(self) -> str:
        return "synthetic" if self.backend.startswith("synthetic") else MODEL_NAME

    @property
    def capacity(self) -> int:
        return int(engine_arg(self.process, "--capacity"))

    def metric(self, name: str, unset: float | None = None, **labels: str) -> float:
        return metric(engine_arg(self.process, "--metrics-port"), name, unset, **labels)

    async def running(self) -> int:
        """Requests the engine holds unfinished (refreshed by the worker every second)."""
        return int(await asyncio.to_thread(self.metric, RUNNING))

    async def wait_running(self, value: int, timeout_s: float = 120) -> None:
        seen: list[int] = []
        try:
            async with asyncio.timeout(timeout_s):
                while (running := await self.running()) != value:
                    if not seen or seen[-1] != running:
                        seen.append(running)
                    await asyncio.sleep(0.1)
        except TimeoutError:
            raise AssertionError(
                f"the engine never held {value} request(s) in {timeout_s:g} s; it held, in "
                f"turn, {seen}; the worker's last log lines:\n{self.worker_log_tail()}"
            ) from None

    def worker_log_tail(self, lines: int = 40) -> str:
        worker_id = engine_arg(self.process, "--worker-id")
        log = self.stack.logs / f"engine-{worker_id}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    async def stops(self, since: float, case: str, within_s: float = STOP_WITHIN_S) -> float:
        """The engine holds no request within ``within_s`` of ``since``; the seconds it took."""
        while (running := await self.running()) != 0:
            elapsed = time.monotonic() - since
            assert elapsed < within_s, f"the engine still runs {running} after {elapsed:.1f} s"
            await asyncio.sleep(0.05)
        elapsed = time.monotonic() - since
        print(f"\n{self.backend} {case}: engine idle {elapsed:.2f} s after")
        return elapsed

    def extra_gateway(self, name: str, **env: str) -> Gateway:
        """Another gateway process on the same Redis and key prefix (started once per stack)."""
        if name not in self._gateways:
            self._gateways[name] = self.stack.gateway(**env)
        return self._gateways[name]


async def rest_cancel(client: httpx.AsyncClient, session: Session, gid: str) -> dict[str, Any]:
    body = await cancel(client, session, gid)
    assert body["generation_id"] == gid
    return body


async def timeline(engine: EngineUnderTest, session_id: str, reading: Reading | None = None) -> str:
    """The session's events as Redis took them, in ms after the first (an event's id is
    when it was written), and how much later the reader got each it read: where a late
    event waited, in the worker or on its way from Redis. Long runs of tokens are cut."""
    entries = await stream_entries(engine.stack.redis_url, engine.stack.prefix, session_id)
    arrived = reading.arrived if reading is not None else {}
    lines, first = [], None
    for entry_id, fields in entries:
        written = entry_ms(entry_id)
        first = written if first is None else first
        line = f"  {fields[b't'].decode():>9}  written at +{written - first} ms"
        if entry_id in arrived:
            line += f", read {arrived[entry_id] * 1000 - written:.0f} ms later"
        lines.append(line)
    if len(lines) > 16:
        lines[10:-4] = [f"  ... {len(lines) - 14} more"]
    return "\n".join(lines)


async def still_running(
    engine: EngineUnderTest, session_id: str, reading: Reading | None = None
) -> None:
    """The premise of a cancel mid-reply: the engine still holds the reply its reader has
    begun. Failing, it says when each of the session's events was written and read."""
    began = time.monotonic()
    try:
        await engine.wait_running(1)
        print(
            f"the engine held the reply {time.monotonic() - began:.1f} s after its reader's token"
        )
    except AssertionError as exc:
        events = await timeline(engine, session_id, reading)
        raise AssertionError(f"{exc}\nthe session's events:\n{events}") from None


async def story_of(
    engine: EngineUnderTest, session_id: str, gid: str, reading: Reading | None = None
) -> str:
    """For a failed check on a reply: its generation's record in Redis (its state, worker,
    takeovers) and its session's timeline."""
    redis = async_client(engine.stack.redis_url)
    try:
        record = await redis.hgetall(Keys(engine.stack.prefix).generation(session_id, gid))
    finally:
        await redis.aclose()
    fields = {k.decode(): v.decode()[:200] for k, v in record.items()}
    events = await timeline(engine, session_id, reading)
    return f"the generation: {fields}\nthe session's events:\n{events}"


async def nothing_after_the_final(engine: EngineUnderTest, session_id: str, gid: str) -> None:
    """In Redis, the generation has exactly one final event and nothing after it."""
    await asyncio.sleep(1.0)  # anything the engine still made would be in Redis by now
    events = await stream_events(engine.stack.redis_url, engine.stack.prefix, session_id)
    kinds = [e[b"t"] for e in events if e[b"g"].decode() == gid]
    assert sum(k in (b"done", b"cancelled", b"error") for k in kinds) == 1, kinds
    assert after_final(events, gid) == []


def check_partial_usage(final: dict[str, Any], tokens: list[dict[str, Any]]) -> None:
    """A cancelled generation's usage counts exactly the tokens delivered before it."""
    assert final["type"] == "cancelled" and final["reason"] == "user", final
    assert final["usage"]["completion_tokens"] == tokens[-1]["count"] >= 3
    assert final["usage"]["completion_tokens"] < LONG
    assert final["usage"]["prompt_tokens"] > 0
