"""On a Redis Cluster (REDIS_URL=redis+cluster://...): the test session's 3 primaries with a
replica each (stack/redis_cluster.py), real gateways and synthetic engines.

The backends suite runs here too (tests/test_backend_*.py, ``synthetic-cluster``). These
add what only a cluster has: sessions spread over the shards while a gateway holds one
pub/sub connection per shard; resume and takeover across shards; a primary killed
mid-stream (its replica promoted) and a slot moved to another primary under load, where
the reader's stream pauses and goes on with nothing lost or repeated, or ends with a
clear error, never hangs.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster

from bench.chaos.network import Proxy
from stack import processes
from stack.redis_cluster import EmbeddedCluster
from stack.redis_server import free_port
from stack.rig import sync_client, wait_worker
from tests.support.bench import log_tails
from tests.support.cluster import (
    check_reply,
    key_lookups,
    migrate_slot,
    outage_s,
    relay_connections,
    revive,
    slot_of,
)
from tests.support.http import cancel_mid_reply, create_session, follow, send
from tests.support.redis_probes import async_client
from tests.support.stack import Stack
from wire import Keys

pytestmark = [pytest.mark.timeout(240), pytest.mark.cluster]


async def test_sessions_spread_over_the_shards_on_one_pubsub_connection_per_shard(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """30 streams on one gateway: their sessions live on all 3 primaries, the gateway
    holds one pub/sub connection on each (not one per stream), every reply is whole."""
    stack = cluster_stack
    stack.synthetic(100, "--capacity", "30")
    gateway = stack.gateway()
    keys = Keys(stack.prefix)
    content, max_tokens = "spread me", 300  # 3 s: open while counted
    async with httpx.AsyncClient(timeout=60) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(30)]
        gids = [await send(client, s, content, max_tokens=max_tokens) for s in sessions]
        followers = [follow(client, s, g) for s, g in zip(sessions, gids, strict=True)]
        for follower in followers:
            await follower.until_tokens(3)
        shards = {redis_cluster.primary_of(keys.events(s.session_id)).port for s in sessions}
        held = {
            node.port: relay_connections(redis_cluster, node, gateway.process.pid)
            for node in redis_cluster.primaries_now()
        }
        await asyncio.wait_for(asyncio.gather(*(f.task for f in followers if f.task)), 120)
    assert len(shards) == 3, shards
    assert held == dict.fromkeys(held, 1), held
    for follower, gid in zip(followers, gids, strict=True):
        assert check_reply(follower.reading.events, gid, content, max_tokens)["usage"]


async def test_stream_reads_go_to_their_keys_primary_with_no_key_lookup(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """A worker's reads of the request queue (XREADGROUP) and of cancels (XREAD) go by key
    to the primary of the stream's slot. redis-py would ask a node ``COMMAND GETKEYS``
    before each (their keys are "movable"): a round trip more, failing while that node
    fails over; once it failed inside redis-py with an AttributeError, and the worker
    ended. A reply and a cancel, then not one lookup on any node."""
    stack = cluster_stack
    before = key_lookups(redis_cluster)
    stack.synthetic(50)
    gateway = stack.gateway()
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, "a whole reply", max_tokens=60)
        follower = follow(client, session, gid)
        await follower.until_end(60)
        check_reply(follower.reading.events, gid, "a whole reply", 60)
        gid = await send(client, session, "a cancelled reply", max_tokens=400)
        after = follower.reading.events[-1].id
        reading = await cancel_mid_reply(client, session, gid, 5, after=after, timeout_s=60)
        assert reading.final(gid).event == "cancelled"
    assert key_lookups(redis_cluster) - before == 0


async def test_a_reply_resumed_on_another_gateway_is_whole(cluster_stack: Stack) -> None:
    stack = cluster_stack
    stack.synthetic(50)
    first, second = stack.gateway(), stack.gateway()
    content, max_tokens = "resume across gateways", 80
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, first.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        before = follow(client, session, gid)
        await before.until_tokens(10)
        assert before.task is not None
        before.task.cancel()
        await asyncio.gather(before.task, return_exceptions=True)
        moved = type(session)(second.url, session.session_id, session.token)
        after = follow(client, moved, gid, after=before.reading.events[-1].id)
        await after.until_end(60)
    check_reply(before.reading.events + after.reading.events, gid, content, max_tokens)


async def test_the_reaper_hands_a_killed_workers_reply_to_another(cluster_stack: Stack) -> None:
    """SIGKILL the worker mid-reply: the gateways' reaper (lease connection checked on
    its node) queues the continuation, the other worker goes on byte for byte."""
    stack = cluster_stack
    doomed = stack.synthetic(20)
    gateway = stack.gateway()
    # Long enough to outlast the other worker's start after the 10th token (3.3 s in a
    # loaded fresh-clone run, where 60 tokens at 20/s had ended before the kill).
    content, max_tokens = "carry on over the shards", 200
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, gateway.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        follower = follow(client, session, gid)
        await follower.until_tokens(10)
        stack.synthetic(20)
        processes.kill(doomed)
        killed_at = time.monotonic()
        await follower.until_end(60)
    check_reply(follower.reading.events, gid, content, max_tokens)
    resumed = [e.json() for e in follower.reading.events if e.event == "resumed"]
    assert len(resumed) == 1, resumed
    print(f"\nSIGKILL -> next token {follower.first_token_after(killed_at) * 1000:.0f} ms")


async def test_a_primary_killed_mid_stream_pauses_the_stream_then_it_goes_on(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """SIGKILL the primary of the session's slot while two readers (on two gateways)
    follow the reply: its replica takes over; both readers get every event once, in
    order, with the whole text (or a clear error if the replica lacked writes), and the
    stream goes on within seconds."""
    stack = cluster_stack
    stack.synthetic(20)
    first, second = stack.gateway(), stack.gateway()
    keys = Keys(stack.prefix)
    content, max_tokens = "survive the failover", 200
    async with httpx.AsyncClient(timeout=60) as client:
        session = await create_session(client, first.url)
        gid = await send(client, session, content, max_tokens=max_tokens)
        readers = [
            follow(client, session, gid),
            follow(client, type(session)(second.url, session.session_id, session.token), gid),
        ]
        for reader in readers:
            await reader.until_tokens(20)
        victim = redis_cluster.primary_of(keys.events(session.session_id))
        victim.kill()
        killed_at = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.gather(*(r.task for r in readers if r.task)), 120)
        except TimeoutError:
            said = [(r.tokens(), r.reading.events[-1:]) for r in readers]
            raise AssertionError(
                f"the readers (tokens, last event) {said} did not end 120 s after the kill; "
                f"the processes' last lines:\n{log_tails(stack.logs, 30)}"
            ) from None
        finally:
            revive(redis_cluster, victim)
    for reader in readers:
        final = check_reply(reader.reading.events, gid, content, max_tokens)
        tokens = sum(e.event == "token" for e in reader.reading.events)
        print(
            f"\nprimary killed: outage {outage_s(reader.arrived, killed_at):.2f} s, "
            f"final {final.get('type', 'done')}, {tokens} tokens, nothing repeated"
        )
    assert readers[0].reading.events == readers[1].reading.events


async def test_a_slot_moved_to_another_primary_under_load(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """Move the slot of a streaming session (with its keys) to another primary while 10
    other streams run: the reader gets the server's sunsubscribe, subscribes again on the
    new owner, re-reads the stream: every reply whole, nothing repeated."""
    stack = cluster_stack
    stack.synthetic(20, "--capacity", "11")
    gateway = stack.gateway()
    keys = Keys(stack.prefix)
    content, max_tokens = "move my slot", 150
    async with httpx.AsyncClient(timeout=60) as client:
        sessions = [await create_session(client, gateway.url) for _ in range(11)]
        gids = [await send(client, s, content, max_tokens=max_tokens) for s in sessions]
        followers = [follow(client, s, g) for s, g in zip(sessions, gids, strict=True)]
        for follower in followers:
            await follower.until_tokens(10)
        key = keys.events(sessions[0].session_id)
        source = redis_cluster.primary_of(key)
        target = next(node for node in redis_cluster.primaries_now() if node is not source)
        moved_at = time.monotonic()
        took = await asyncio.to_thread(
            migrate_slot, redis_cluster, slot_of(redis_cluster, key), target
        )
        assert redis_cluster.primary_of(key) is target
        await asyncio.wait_for(asyncio.gather(*(f.task for f in followers if f.task)), 120)
    for follower, gid in zip(followers, gids, strict=True):
        assert check_reply(follower.reading.events, gid, content, max_tokens)["usage"]
    print(
        f"\nslot moved in {took:.2f} s; the moved session's longest pause "
        f"{outage_s(followers[0].arrived, moved_at):.2f} s"
    )


def test_a_blocking_cluster_client_closes_its_sockets(redis_cluster: EmbeddedCluster) -> None:
    """stack.rig.sync_client's cluster client (the tests' probes, ``make run``'s wait for
    its worker): ``close`` closes its connections, as every node sees, rather than leaving
    them to the garbage collector (a ResourceWarning in whichever later test collects)."""
    name = f"probe-{time.monotonic_ns()}"
    client = sync_client(f"{redis_cluster.url}?client_name={name}")
    for key in ("a", "b", "c", "d"):  # keys on every shard: a connection to each
        client.exists(key)

    def connected() -> int:
        count = 0
        for node in redis_cluster.primaries_now():
            with redis_cluster.client(node) as probe:
                count += sum(1 for entry in probe.client_list() if entry["name"] == name)
        return count

    assert connected() == len(redis_cluster.primaries_now())
    client.close()
    deadline = time.monotonic() + 5
    while connected() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert connected() == 0


async def test_one_shot_requests_started_together_all_run(cluster_stack: Stack) -> None:
    """Every one-shot request runs. On a cluster the request (on its queue's shard) and
    its generation (on its session's) are written on two nodes: a request queued before
    its generation exists is taken by a worker that finds nothing to claim, skips it, and
    its client waits forever. 384 requests started 48 at a time (a gateway opening new
    connections to the shards) hung some every run until the request went in after the
    generation was written."""
    stack = cluster_stack
    stack.synthetic(0, "--capacity", "64")
    gateway = stack.gateway()
    body = {"model": "synthetic", "prompt": "together", "max_tokens": 2}
    for _ in range(8):
        async with httpx.AsyncClient(timeout=30) as client:  # fresh connections each round
            answers = await asyncio.gather(
                *(client.post(f"{gateway.url}/v1/completions", json=body) for _ in range(48))
            )
        assert [a.status_code for a in answers] == [200] * len(answers)


def test_a_cluster_node_named_as_one_redis_stops_gateway_and_worker_with_the_url_to_use(
    cluster_stack: Stack, redis_cluster: EmbeddedCluster
) -> None:
    """``REDIS_URL=redis://`` at a cluster node once left the gateway never ready, logging
    a MOVED reply ten times a second, and the worker died with a traceback; both now stop
    at start-up saying what to write instead."""
    node = redis_cluster.primaries_now()[0]
    env = cluster_stack.base_env(REDIS_URL=f"redis://127.0.0.1:{node.port}/0")
    logs = {name: cluster_stack.logs / f"misconfigured-{name}.log" for name in ("gw", "engine")}
    started = [
        processes.gateway(free_port(), env, logs["gw"]),
        processes.engine(["--backend", "synthetic"], env, logs["engine"]),
    ]
    cluster_stack.children.extend(started)
    for process, log in zip(started, logs.values(), strict=True):
        assert process.wait(timeout=60) != 0
        output = log.read_text()
        assert "cannot start: REDIS_URL names a node of a Redis Cluster" in output, output
        assert f"use redis+cluster://127.0.0.1:{node.port}" in output
        assert "Traceback" not in output


def test_waiting_for_a_worker_outlasts_the_node_the_url_names_being_down(
    redis_cluster: EmbeddedCluster,
) -> None:
    """stack.rig.wait_worker (how the rig, the benches and the chaos run wait for a worker
    they start) while the node ``REDIS_URL`` names is down: it waits for the cluster rather
    than fail. The chaos run's replacement worker, started during a primary's failover,
    failed there: a cluster client cannot be made while that node is down."""
    named = redis_cluster.nodes[0]
    prefix, worker_id = f"t-{time.monotonic_ns()}", "late"
    # Stands in for the worker's process: alive while it registers.
    stand_in = subprocess.Popen(["sleep", "120"])
    named.kill()
    try:
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(wait_worker, redis_cluster.url, prefix, worker_id, stand_in, 60)
            revive(redis_cluster, named)  # seconds: the waiter asks meanwhile
            assert not waiting.done(), waiting.exception()
            other = next(node for node in redis_cluster.live() if node is not named)
            with sync_client(f"redis+cluster://127.0.0.1:{other.port}") as client:
                client.set(Keys(prefix).worker(worker_id), b"{}", ex=60)
            waiting.result(timeout=30)
    finally:
        if named.process is None:
            revive(redis_cluster, named)
        stand_in.kill()
        stand_in.wait()


async def test_a_one_shot_request_whose_gateway_died_before_queueing_it_still_ends(
    tmp_path: Path,
) -> None:
    """On a cluster a one-shot request takes two round trips: SUBMIT writes its generation
    on its session's shard, then the request goes into its queue's. Its gateway SIGKILLed
    between the two (here: SUBMIT's answer held by a one-way partition of that gateway from
    every shard but the queue's) left the generation ``queued``, with no request, for its
    whole TTL, counting against its key's concurrent limit. Now the request is noted, whole,
    before SUBMIT, and another gateway's reaper queues it: it runs, and ends. Found by the
    chaos run (seed 3 on a cluster): a key limited to 3 concurrent generations kept one."""
    listen: dict[int, int] = {}
    cluster = EmbeddedCluster(reach=lambda port: listen.setdefault(port, free_port()))
    proxy = Proxy("redis", {node.port: listen[node.port] for node in cluster.nodes}, tmp_path)
    stack = Stack(cluster.url, "stranded", tmp_path)
    try:
        proxy.start()
        await asyncio.to_thread(cluster.start)
        keys = Keys(stack.prefix)
        queue_node = cluster.primary_of(keys.submitting("synthetic"))
        elsewhere = [listen[n.port] for n in cluster.nodes if n.port != queue_node.port]
        stack.synthetic(50)
        victim, reaper = stack.gateway(), stack.gateway()
        body = {"model": "synthetic", "prompt": "stranded", "max_tokens": 5}
        async with httpx.AsyncClient(timeout=60) as client:
            # Its answers from the other shards late, so the queue's shard can be cut off
            # once SUBMIT has run and before the request follows.
            await proxy.control.strike(
                "latency",
                pids=[victim.process.pid],
                listeners=elsewhere,
                held_s=120,
                delay_s=0.3,
            )
            # SUBMIT's answer is 0.3 s late: the cut must come within that, so the test
            # reads what SUBMIT made with one client made beforehand and the slots it knows
            # (a client made for each read, and a CLUSTER SLOTS for each shard asked, took
            # longer than that on a loaded machine).
            redis = async_client(cluster.url)
            assert isinstance(redis, AsyncRedisCluster)
            await redis.initialize()
            queue_shard = redis.get_node_from_key(keys.submitting("synthetic")).name
            seen: set[bytes] = set()
            for _ in range(10):  # until a session lands on another shard than the queue's
                sent = asyncio.create_task(client.post(f"{victim.url}/v1/completions", json=body))
                async with asyncio.timeout(30):
                    while not (made := await _generations(redis, keys) - seen):
                        await asyncio.sleep(0.01)
                seen |= made
                (stranded,) = made
                if redis.get_node_from_key(stranded).name != queue_shard:
                    break
                assert (await sent).status_code == 200
            await redis.aclose()
            await proxy.control.strike(
                "oneway",
                pids=[victim.process.pid],
                listeners=[listen[queue_node.port]],
                held_s=120,
                direction="up",
            )
            await asyncio.sleep(1)
            assert not sent.done(), "the request was queued before the cut"
            processes.kill(victim.process)  # between SUBMIT and the queueing
            with pytest.raises(httpx.TransportError):
                await sent
        with sync_client(cluster.url) as redis:
            async with asyncio.timeout(30):
                while redis.hget(stranded, "state") in (b"queued", b"running"):
                    await asyncio.sleep(0.2)
            assert redis.hget(stranded, "final") is not None
        assert reaper.process.poll() is None
    finally:
        stack.stop()
        await proxy.control.close()
        proxy.stop()
        cluster.cleanup()


async def _generations(redis: AsyncRedisCluster, keys: Keys) -> set[bytes]:
    return {key async for key in redis.scan_iter(match=f"{keys.prefix}:{{*}}:gen:*", count=1000)}


async def test_a_primary_killed_and_started_again_keeps_its_shard_though_its_replica_saw_it_late(
    tmp_path: Path,
) -> None:
    """A node started again comes back as the primary of its slots, empty (no persistence),
    unless a replica took them over first; the cluster looks healthy until its replicas see
    their link drop, which through a proxy comes late (here: held). Waiting only for it to
    look healthy, the chaos run's primary_kill started the node again too soon: its
    replica synced its emptiness, a third of the sessions and one key's usage gone (seed
    12). ``kill_primary`` returns once a replica serves the slots."""
    listen: dict[int, int] = {}
    cluster = EmbeddedCluster(reach=lambda port: listen.setdefault(port, free_port()))
    proxy = Proxy("redis", {node.port: listen[node.port] for node in cluster.nodes}, tmp_path)
    try:
        proxy.start()
        await asyncio.to_thread(cluster.start)
        victim = cluster.primary_of("kept")
        with cluster.client(victim) as redis:
            redis.set("kept", "yes")
            assert redis.wait(1, 5000) == 1  # its replica holds it
        await proxy.control.strike("blackhole", listeners=[listen[victim.port]], held_s=8)
        await asyncio.to_thread(cluster.kill_primary, victim, 60)
        assert cluster.primary_of("kept") is not victim, "the node would come back its primary"
        await asyncio.to_thread(victim.start)
        await asyncio.to_thread(cluster.wait_healthy, 60)
        # Straight to the slots' primary: the cluster's URL names the first node's
        # listener, the victim's ("kept" is in its slots), held for 8 s from the strike,
        # and a quick failover and restart come back before that.
        with cluster.client(cluster.primary_of("kept")) as redis:
            assert redis.get("kept") == "yes"
    finally:
        await proxy.control.close()
        proxy.stop()
        cluster.cleanup()
