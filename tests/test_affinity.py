"""Cache affinity over real processes (docs/affinity.md): two synthetic workers, a gateway,
Redis. A conversation's later turns are taken by the worker that ran its earlier ones (its
engine's cache holds their history); a request whose holder is busy or dead still runs, on
the other worker."""

from __future__ import annotations

import signal

import httpx
import pytest

from stack.redis_server import free_port
from tests.support.http import Session, create_session, read_events, send
from tests.support.metrics import sample, scrape
from tests.support.stack import Stack
from wire import Keys
from wire.connect import connect

pytestmark = pytest.mark.timeout(90)

AFFINITY = "tokenspout_engine_affinity_total"
WAITED = "tokenspout_engine_affinity_wait_seconds_count"
PREFILL_RATE = "tokenspout_engine_prefill_tokens_per_second"


class Rig:
    """Two synthetic workers (``capacity`` slots each) with /metrics, a gateway, a client."""

    def __init__(self, stack: Stack, capacity: int, *args: str) -> None:
        self.ports = {name: free_port() for name in ("wa", "wb")}
        self.workers = {
            name: stack.synthetic(
                200,
                *("--capacity", str(capacity), "--metrics-port", str(port), *args),
                worker_id=name,
            )
            for name, port in self.ports.items()
        }
        self.gateway = stack.gateway()
        self.keys = Keys(stack.prefix)
        self.redis = connect(stack.redis_url)
        self.client = httpx.AsyncClient(timeout=30)

    async def close(self) -> None:
        await self.client.aclose()
        await self.redis.aclose()

    async def turn(self, session: Session, content: str, max_tokens: int = 8) -> str:
        """The worker that served a turn, once it ended ``done``."""
        gid = await send(self.client, session, content, max_tokens=max_tokens)
        reading = await read_events(self.client, session, until_final_of=gid)
        assert reading.events[-1].event == "done", reading.events[-1]
        return await self.worker_of(session, gid)

    async def worker_of(self, session: Session, gid: str) -> str:
        worker = await self.redis.hget(self.keys.generation(session.session_id, gid), "worker")
        assert worker, gid
        return str(worker.decode())

    async def metric(self, worker: str, name: str, **labels: str) -> float:
        samples = await scrape(self.client, f"http://127.0.0.1:{self.ports[worker]}/metrics")
        return sample(samples, name, **labels) or 0.0

    async def affinity(self, worker: str, outcome: str) -> float:
        return await self.metric(worker, AFFINITY, outcome=outcome)


async def test_a_conversations_next_turns_are_taken_by_the_worker_that_ran_its_first(
    stack: Stack,
) -> None:
    """Four conversations of three turns, one after another: each conversation's second and
    third turns run on its first turn's worker (with two workers pulling, all eight would
    one time in 256), counted as hits, each hit's time queued in the wait's histogram; each
    worker measured its engine's prefill (400-word openings, at most 2,000 tokens a second);
    then that worker is killed, and the next turn, whose holder is gone, still runs on the
    other after the bounded wait, counted as a miss."""
    rig = Rig(stack, 4, "--prefill-tokens-per-s", "2000")
    try:
        sessions, first = [], []
        for number in range(4):
            session = await create_session(rig.client, rig.gateway.url)
            sessions.append(session)
            opening = f"conversation {number}: tell me a story about " + "the sea " * 200
            first.append(await rig.turn(session, opening))
        for session, holder in zip(sessions, first, strict=True):
            assert await rig.turn(session, "and then?") == holder
            assert await rig.turn(session, "and after that?") == holder
        assert await rig.affinity("wa", "hit") + await rig.affinity("wb", "hit") == 8
        waits = [await rig.metric(w, WAITED, outcome="hit") for w in rig.workers]
        assert sum(waits) == 8, waits
        for worker in set(first):
            assert 0 < await rig.metric(worker, PREFILL_RATE) <= 2_000
        dead = first[0]
        rig.workers[dead].send_signal(signal.SIGKILL)
        rig.workers[dead].wait()
        other = "wb" if dead == "wa" else "wa"
        assert await rig.turn(sessions[0], "are you still there?") == other
        assert await rig.affinity(other, "miss") >= 1
    finally:
        await rig.close()


@pytest.mark.cluster
async def test_on_a_cluster_a_conversations_next_turns_are_taken_by_its_first_worker(
    cluster_stack: Stack,
) -> None:
    """On a cluster a worker says what it holds on its queue's shard, in a call of its own
    before the final event (which goes to the session's shard): two conversations' next
    two turns each run on their first turn's worker, all four counted as hits."""
    rig = Rig(cluster_stack, 4)
    try:
        for number in range(2):
            session = await create_session(rig.client, rig.gateway.url)
            holder = await rig.turn(session, f"conversation {number}: " + "the sea " * 100)
            assert await rig.turn(session, "and then?") == holder
            assert await rig.turn(session, "and after that?") == holder
        assert await rig.affinity("wa", "hit") + await rig.affinity("wb", "hit") == 4
    finally:
        await rig.close()


async def test_a_turn_whose_worker_is_busy_runs_on_the_other_at_once(stack: Stack) -> None:
    """One slot a worker. Two conversations open alike, so one worker holds both beginnings;
    while a long reply of the first keeps that worker's slot, the second's next turn is
    taken by the other worker and ends before that long reply does."""
    rig = Rig(stack, capacity=1)
    try:
        one = await create_session(rig.client, rig.gateway.url)
        two = await create_session(rig.client, rig.gateway.url)
        holder = await rig.turn(one, "the same opening")
        assert await rig.turn(two, "the same opening") == holder
        long_gid = await send(rig.client, one, "go on at length", max_tokens=600)  # 3 s
        other = "wb" if holder == "wa" else "wa"
        assert await rig.turn(two, "a short question") == other
        assert await rig.worker_of(one, long_gid) == holder
        state = await rig.redis.hget(rig.keys.generation(one.session_id, long_gid), "state")
        assert state == b"running"
    finally:
        await rig.close()
