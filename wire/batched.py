"""One script's calls with one round trip under way at a time: the calls made meanwhile go
together in the next, one pipeline on one connection.

A burst at a gateway (a thousand chat completions arriving within 100 ms) made one SUBMIT
call per request, each holding one of the process's 64 pooled Redis connections for its
round trip: the burst queued for connections (on a loaded host for seconds, until the
pool's 5 s wait failed some requests with a 503), and each request paid a whole call's CPU
in the gateway and in Redis. Batched, a call made when none is under way goes at once, as
before (a lone request waits for nothing); calls made while one is under way gather and go
in one pipeline when it is back, as the worker's publisher sends an engine step's events.
Each call still gets its own reply, or its own error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from wire.library import lost_scripts

Arg = str | bytes | int | float
_Call = tuple[Sequence[str | bytes], Sequence[Arg], "asyncio.Future[object]"]
_Args = tuple[Sequence[str | bytes], Sequence[Arg]]


class BatchedCalls:
    """Calls of a script on one Redis (not a cluster: a pipeline there splits by slot)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        command: tuple[str, str],
        load: Callable[[], Awaitable[None]],
    ) -> None:
        self._redis = redis
        self._command = command
        """What calls the script, before its keys (``wire.scripts.Script.command``)."""
        self._load = load
        """Loads the script (a pipeline only reports its loss: Redis restarted)."""
        self._under_way = False
        self._gathered: list[_Call] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def __call__(self, keys: Sequence[str | bytes], args: Sequence[Arg]) -> object:
        if self._under_way:
            reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
            self._gathered.append((keys, args, reply))
            return await reply
        self._under_way = True
        try:
            [answer] = await self._answers([(keys, args)])
        finally:
            self._send_gathered()
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _send_gathered(self) -> None:
        """The round trip under way is back: the calls gathered meanwhile go now."""
        if not self._gathered:
            self._under_way = False
            return
        calls, self._gathered = self._gathered, []
        task = asyncio.create_task(self._send(calls), name="batched-script-calls")
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, calls: list[_Call]) -> None:
        try:
            answers = await self._answers([(keys, args) for keys, args, _ in calls])
        except asyncio.CancelledError:
            for *_, reply in calls:
                reply.cancel()
            raise
        except Exception as exc:  # Redis away: each caller gets it, as from a call of its own
            for *_, reply in calls:
                if not reply.done():
                    reply.set_exception(exc)
        else:
            for (*_, reply), answer in zip(calls, answers, strict=True):
                if reply.done():  # its caller was cancelled
                    continue
                if isinstance(answer, Exception):
                    reply.set_exception(answer)
                else:
                    reply.set_result(answer)
        finally:
            self._send_gathered()

    async def _answers(self, calls: list[_Args]) -> list[object]:
        """Each call's reply, or the error Redis answered it with; a Redis without the
        script (restarted, flushed) gets it loaded and the calls sent once more."""
        answers = await self._round_trip(calls)
        if any(lost_scripts(answer) for answer in answers):
            await self._load()
            answers = await self._round_trip(calls)
        return answers

    async def _round_trip(self, calls: list[_Args]) -> list[object]:
        if len(calls) == 1:  # no pipeline for one (redis-py's costs about 20 us a call)
            [(keys, args)] = calls
            command = (*self._command, len(keys), *keys, *args)
            try:
                return [await self._redis.execute_command(*command)]  # type: ignore[no-untyped-call]
            except ResponseError as exc:  # its reply, as a pipeline would give it
                return [exc]
        async with self._redis.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                pipe.execute_command(*self._command, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))
