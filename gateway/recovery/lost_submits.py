"""Session turns this process answered, submitted again when Redis lost them.

Redis acknowledges a write once it holds it in memory: a Redis whose host crashed comes
back from an AOF that lacks what its last fsync did not cover (``appendfsync everysec``: up
to a second), a replica promoted in a failover lacks what it had not received. A turn
whose submit was lost so (its generation, its history's new message, its request) was
still answered 202: its client would wait for a reply nobody runs, with no event to tell
it (its reader's last event may be one Redis kept). So each turn this process answered is
looked at once more ``CHECK_AFTER_S`` later, when what Redis holds would survive (one
round trip a second for all of them, in a pipeline): one whose generation Redis no longer
holds is submitted again, as it was (the same generation id: its reader sees it queued
and streamed; a copy runs once). Its session gone too is not: its readers are told
(``session_lost``, 404 ``unknown_session``). ``TOKENSPOUT_WAIT_AOF`` and
``TOKENSPOUT_WAIT_REPLICAS`` keep such submits in the first place.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.core.errors import GatewayError
from gateway.core.store.submitter import Submitter

log = logging.getLogger("tokenspout.sessions")

CHECK_AFTER_S = 2.5
"""Past what a crash's AOF (fsync each second) or a replica's lag loses."""
GIVE_UP_AFTER_S = 60.0
"""A turn Redis could not be asked about for this long is no longer looked after."""


class LostSubmits:
    def __init__(self, redis: aioredis.Redis, submitter: Submitter) -> None:
        self.redis = redis
        self.submitter = submitter
        self.keys = submitter.keys

    async def run_forever(self, every_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.look()
            except (RedisError, OSError) as exc:  # Redis away: the same turns next time
                log.warning("looking for lost submits failed (%s); retrying", exc)

    async def look(self) -> int:
        """The turns answered over ``CHECK_AFTER_S`` ago: any whose generation Redis no
        longer holds is submitted again. Returns how many were."""
        answered, now = self.submitter.answered, time.monotonic()
        while answered and now - answered[0].at > GIVE_UP_AFTER_S:
            answered.popleft()
        due = []
        while answered and now - answered[0].at >= CHECK_AFTER_S:
            due.append(answered.popleft())
        if not due:
            return 0
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for answer in due:
                    turn = answer.turn
                    pipe.exists(self.keys.generation(turn.session_id, turn.generation_ids[0]))
                held = await pipe.execute()
        except BaseException:
            answered.extendleft(reversed(due))  # looked at again next time
            raise
        again = 0
        for answer, exists in zip(due, held, strict=True):
            if exists:
                continue
            try:
                again += await self.submitter.submit_again(answer)
            except GatewayError as exc:  # refused now (its session is busy, or gone)
                log.info("a lost turn of %s not submitted again: %s", answer.turn.session_id, exc)
        if again:
            log.warning(
                "submitted again %d session turns Redis lost after they were answered", again
            )
        return again
