"""gateway/recovery/reader_deadline.py: a generation the readers' deadline could not ask
Redis about (a failover with no primary yet) is looked at again at the next check, not
marked as looked at. Redis refuses for real here: the gateway's user loses its commands
(ACL), then gets them back."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from gateway.core.settings import Settings
from gateway.recovery.reader_deadline import REQUEUE_AFTER_S
from gateway.server.app import Services
from stack.redis_server import EmbeddedRedis

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings(  # the whole app is built (tests/inprocess/test_hot_routes.py)
        "ignore::litestar.exceptions.base_exceptions.LitestarDeprecationWarning"
    ),
]

USER, PASSWORD = "deadline", secrets.token_hex(8)


@pytest.fixture
async def admin(redis_server: EmbeddedRedis) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    await client.acl_setuser(
        USER,
        enabled=True,
        passwords=[f"+{PASSWORD}"],
        keys=["*"],
        channels=["*"],
        commands=["+@all"],
    )
    yield client
    await client.acl_deluser(USER)
    await client.aclose()


@pytest.fixture
async def services(redis_server: EmbeddedRedis, admin: aioredis.Redis) -> AsyncIterator[Services]:
    url = redis_server.url.replace("redis://", f"redis://{USER}:{PASSWORD}@", 1)
    services = Services(Settings(redis_url=url, key_prefix=f"t-{secrets.token_hex(4)}"))
    yield services
    await services.redis.aclose()


async def test_a_generation_redis_could_not_be_asked_about_is_looked_at_again(
    services: Services, admin: aioredis.Redis
) -> None:
    deadline, waiting = services.reader_deadline, services.hub.waiting
    waiting.book("s1", "g1", time.time() - REQUEUE_AFTER_S - 1)
    unlooked = [("s1", "g1")]
    assert waiting.queued_before(float("inf"), requeued=False) == unlooked

    await admin.acl_setuser(USER, enabled=True, commands=["-@all"])
    with pytest.raises(NoPermissionError):
        await deadline.requeue_lost()
    assert waiting.queued_before(float("inf"), requeued=False) == unlooked

    await admin.acl_setuser(USER, enabled=True, commands=["+@all"])
    assert await deadline.requeue_lost() == 0  # Redis knows no such generation: nothing to do
    assert waiting.queued_before(float("inf"), requeued=False) == []
    assert waiting.queued_before(float("inf"), requeued=True) == unlooked
