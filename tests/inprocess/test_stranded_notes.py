"""gateway/recovery/stranded.py: the note a gateway makes of a one-shot request before its
SUBMIT (on a Redis Cluster the request is queued a round trip later) is kept while its
generation does not exist yet, so a gateway slow between the two (its scripts loaded again
over a slow link: seconds) that then dies before queueing still has its request queued by
the reaper. Found by tests/test_cluster.py's stranded-request test failing one run in
three: the reaper crossed the note off 3 s on, before the SUBMIT came."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

import wire
from gateway.core.ids import new_id
from gateway.core.settings import Settings
from gateway.recovery.stranded import UNSUBMITTED_GRACE_S, NothingKept, StrandedTurns
from gateway.server.app import Services
from stack.redis_server import EmbeddedRedis
from wire import GenerationRequest, Keys, SamplingParams
from wire.queue import RequestQueue, ServedTokens

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings(  # the whole app is built (tests/inprocess/test_hot_routes.py)
        "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
    ),
]

MODEL = "m"


@pytest.fixture
async def services(redis_server: EmbeddedRedis) -> AsyncIterator[Services]:
    services = Services(
        Settings(redis_url=redis_server.url, key_prefix=f"t-{secrets.token_hex(4)}")
    )
    yield services
    await services.redis.aclose()


def stranded_of(services: Services) -> StrandedTurns:
    stranded = services.reaper.stranded
    assert stranded is not None
    return stranded


async def noted(queue: RequestQueue, made_s_ago: float = 0.0) -> tuple[GenerationRequest, bytes]:
    """A one-shot request made ``made_s_ago`` and noted, as a gateway notes it before SUBMIT."""
    request = GenerationRequest(
        new_id("g"),
        new_id("s"),
        SamplingParams(),
        prompt="stranded",
        enqueued_at=time.time() - made_s_ago,
    )
    note = wire.encode(request)
    await queue.note_submitting(note)
    return request, note


async def notes(redis: aioredis.Redis, queue: RequestQueue) -> list[bytes]:
    return list(await redis.zrange(queue.submitting_key, 0, -1))


async def test_a_note_whose_generation_comes_late_is_kept_and_its_request_queued(
    services: Services,
) -> None:
    redis, keys, stranded = (
        services.redis,
        Keys(services.settings.key_prefix),
        stranded_of(services),
    )
    queue = services.service.queue.of(MODEL)
    request, note = await noted(queue)

    # No generation yet (its SUBMIT on its way): kept, looked at again later.
    assert await stranded.queue_stranded(queue, older_than_s=0) == 0
    assert await notes(redis, queue) == [note]
    assert await queue.fair_waiting() == 0

    # Its SUBMIT came (the generation, queued), then its gateway died before queueing.
    generation = keys.generation(request.session_id, request.generation_id)
    await redis.hset(generation, mapping={"state": "queued", "queue": MODEL})
    assert await stranded.queue_stranded(queue, older_than_s=0) == 1
    assert await notes(redis, queue) == []
    assert await queue.fair_waiting() == 1


async def test_a_note_whose_generation_never_came_is_crossed_off_after_the_grace(
    services: Services,
) -> None:
    redis, stranded = services.redis, stranded_of(services)
    queue = services.service.queue.of(MODEL)
    await noted(queue, made_s_ago=UNSUBMITTED_GRACE_S + 1)
    assert await stranded.queue_stranded(queue, older_than_s=0) == 0
    assert await notes(redis, queue) == []
    assert await queue.fair_waiting() == 0


async def test_a_noted_one_shot_request_is_not_lost_to_the_readers_deadline(
    services: Services,
) -> None:
    """The readers' deadline asks whether a one-shot request still ``queued`` is anywhere:
    one whose note is there (its gateway slow between the two round trips, the reaper yet
    to queue it) is on its way, not lost; nor once the reaper queued it, nor once a worker
    took it. Only with none of these is there nothing kept to queue again. In a chaos run
    on a Redis Cluster the deadline ended a noted request as lost 5 ms before the reaper
    queued it (its looks, in turns, saw no note and then no request)."""
    redis, keys, stranded = (
        services.redis,
        Keys(services.settings.key_prefix),
        stranded_of(services),
    )
    queue = services.service.queue.of(MODEL)
    await queue.ensure_group()
    request, _ = await noted(queue)
    generation = keys.generation(request.session_id, request.generation_id)
    await redis.hset(generation, mapping={"state": "queued", "queue": MODEL})

    assert await queue.locate(request.generation_id) == "noted"
    assert await stranded.requeue_lost(request.session_id, request.generation_id) is None

    assert await stranded.queue_stranded(queue, older_than_s=0) == 1
    assert await queue.locate(request.generation_id) == "waiting"
    assert await stranded.requeue_lost(request.session_id, request.generation_id) is None

    [(entry_id, fields)] = await queue.take("w1", 1, 10, ServedTokens())
    assert request.generation_id.encode() in fields[b"r"]
    assert await queue.locate(request.generation_id) == "taken"
    assert await stranded.requeue_lost(request.session_id, request.generation_id) is None

    # Given back by a worker that drains: in the stream again, for any worker.
    await queue.requeue([(entry_id, fields)])
    assert await queue.locate(request.generation_id) == "waiting"
    assert await stranded.requeue_lost(request.session_id, request.generation_id) is None

    [(entry_id, _)] = await queue.take("w1", 1, 10, ServedTokens())
    await queue.ack(entry_id)
    assert await queue.locate(request.generation_id) is None
    lost = await stranded.requeue_lost(request.session_id, request.generation_id)
    assert isinstance(lost, NothingKept), lost
