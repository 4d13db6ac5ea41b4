"""The ``n`` choices of one request, each a generation of its own.

A request with ``n=3`` queues three generations; each has its own stateless session, queue
entry, cancel and takeover, so every guarantee of one generation holds for each choice
unchanged (a worker lost mid-reply is taken over per choice; closing the response cancels
all of them). Workers may run the choices side by side. A request with a ``seed`` gives
choice ``i`` the seed ``seed + i``: the choices differ, and the same request gives the same
choices again. A request of one choice (most) is one generation, with nothing added.

    choices = await Choices.open(submitter, hub, ask, model, heartbeat_s)  # ask.n queued
    async for batch in choices.batches():             # [(choice index, GenerationItem), ...]
        ...
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from litestar.background_tasks import BackgroundTask

from gateway.core.ask import GenerationAsk
from gateway.core.generation_stream import Collected, GenerationStream
from gateway.core.relay.hub import RelayHub
from gateway.core.store.submitter import Submitter
from gateway.core.walk import IndexedItem

_END = object()
"""What a choice's pump puts on the queue after its final event."""


class Choices:
    def __init__(self, streams: list[GenerationStream]) -> None:
        self.streams = streams

    @classmethod
    async def open(
        cls,
        submitter: Submitter,
        hub: RelayHub,
        ask: GenerationAsk,
        model: str,
        heartbeat_s: float,
    ) -> Choices:
        """Queue the ask's ``n`` generations for ``model`` at once, each in a throwaway
        session whose feed opens before it is queued (``GenerationStream.submit``); if one
        cannot be queued, those that were are cancelled and its error is raised."""
        opening = [
            GenerationStream.submit(submitter, hub, ask, model, heartbeat_s, choice)
            for choice in range(ask.n)
        ]
        if ask.n == 1:  # the common case: one generation, nothing to gather
            return cls([await opening[0]])
        results = await asyncio.gather(*opening, return_exceptions=True)
        streams = [result for result in results if isinstance(result, GenerationStream)]
        failed = [result for result in results if isinstance(result, BaseException)]
        if failed:
            await asyncio.gather(*(stream.close() for stream in streams))
            raise failed[0]
        return cls(streams)

    @property
    def n(self) -> int:
        """How many choices: the ask's ``n``."""
        return len(self.streams)

    @property
    def generation_id(self) -> str:
        """The first choice's generation id: the one the response's id is made from."""
        return self.streams[0].generation_id

    def batches(self) -> AsyncIterator[list[IndexedItem]]:
        """The choices' items as they arrive, each with its choice index; it ends when
        every choice has ended (each with exactly one final event)."""
        if len(self.streams) == 1:  # the common case: the generation's own, no task
            return self.streams[0].batches()
        return self._merged()

    async def _merged(self) -> AsyncIterator[list[IndexedItem]]:
        arrived: asyncio.Queue[object] = asyncio.Queue()
        pumps = [
            asyncio.create_task(self._pump(stream, arrived), name=f"choice-{index}")
            for index, stream in enumerate(self.streams)
        ]
        running = len(pumps)
        try:
            while running:
                got = await arrived.get()
                if got is _END:
                    running -= 1
                    continue
                if isinstance(got, BaseException):
                    raise got
                assert isinstance(got, list)
                yield got
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)

    @staticmethod
    async def _pump(stream: GenerationStream, arrived: asyncio.Queue[object]) -> None:
        try:
            async for items in stream.batches():
                arrived.put_nowait(items)
        except Exception as exc:  # handed to the reader, which raises it
            arrived.put_nowait(exc)
        finally:
            arrived.put_nowait(_END)

    async def collect(self) -> list[Collected]:
        """Every choice whole, in index order; the first failure cancels the rest and is
        raised."""
        if len(self.streams) == 1:  # the common case: awaited here, no task (it closes)
            return [await self.streams[0].collect()]
        tasks = [asyncio.create_task(stream.collect()) for stream in self.streams]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close()

    async def close(self) -> None:
        """Cancel every choice that has not ended (the client went away)."""
        if len(self.streams) == 1:
            await self.streams[0].close()
        else:
            await asyncio.gather(*(stream.close() for stream in self.streams))

    def on_response_end(self) -> BackgroundTask:
        """Runs after the streamed response ends, however it ends (done or disconnected)."""
        return BackgroundTask(self.close)
