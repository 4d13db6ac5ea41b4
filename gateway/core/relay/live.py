"""Where the relay's live events come from: one pub/sub reader per gateway process.

``LiveSource`` is what the hub (gateway/core/relay/hub.py) needs of it: subscribe a session's live
channel, unsubscribe it, start and close; the source tells the hub each live message
(``Deliver``) and when a channel's subscription is confirmed or lost (``Confirmed``). Two
implementations: ``PlainLive`` below (one pub/sub connection to one Redis) and
``ShardedLive`` (gateway/core/relay/shards.py: sharded pub/sub on a Redis Cluster, one
connection per shard). Litestar's channel backends (``litestar/channels/backends/base.py``)
are the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import operator
from collections.abc import Callable
from typing import Any, Protocol

import redis.asyncio as aioredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from wire.connect import RETRY_MAX_S

log = logging.getLogger("tokenspout.relay")

Deliver = Callable[[bytes, bytes], None]
"""(channel, data) of one live message."""
Confirmed = Callable[[str, bool], None]
"""A channel's subscription is confirmed (True) or lost (False)."""
SUBSCRIBE, UNSUBSCRIBE = "subscribe", "unsubscribe"
UNSUBSCRIBE_AFTER_S = 0.1
UNSUBSCRIBE_BATCH = 32
"""A channel nobody watches any more is unsubscribed with others, in one command, once
``UNSUBSCRIBE_BATCH`` are left or ``UNSUBSCRIBE_AFTER_S`` after the first: at hundreds of
one-shot requests a second, not one command each. Meanwhile its messages are dropped."""


class RelayPubSub(PubSub):
    """redis-py's ``PubSub``, except that a command or read that fails does not reconnect
    in place: it drops the connection and raises ``ConnectionError``. The relay's reader
    alone opens a fresh ``RelayPubSub``, after telling every feed its channel was lost.

    In place, redis-py reconnects inside whichever task failed, reading the server's
    handshake there: a request's (un)subscribe would read while the reader waits on the
    same connection (``RuntimeError: read() called while another coroutine is already
    waiting``, a 500), and the resubscription it makes would never reach the feeds. This
    overrides redis-py's ``_reconnect`` and ``execute_command`` (redis is pinned)."""

    async def _reconnect(self, conn: Any, error: BaseException | None = None, *_: Any) -> None:
        await conn.disconnect()
        raise RedisConnectionError(f"the pub/sub connection was lost ({error})")

    async def execute_command(self, *args: Any) -> None:
        """Send a (un)subscribe without a health check in place: redis-py checks a
        connection subscribed to nothing with a PING and a read of its answer, beside the
        reader (the ``RuntimeError`` above, on a shard whose channels were all
        unsubscribed). The reader's own check (``get_message``) sends its PING unread."""
        await self.connect()  # type: ignore[no-untyped-call]
        connection = self.connection
        assert connection is not None  # connect() made it
        await self._execute(connection, connection.send_command, *args, check_health=False)


def relay_pubsub(redis: aioredis.Redis) -> RelayPubSub:
    return RelayPubSub(redis.connection_pool)


def connected(pubsub: PubSub) -> bool:
    """Its connection, once opened, is still up (else only the reader may reopen it)."""
    return pubsub.connection is None or bool(pubsub.connection.is_connected)


class LiveSource(Protocol):
    """One process's live events: each subscribed channel's messages go to ``Deliver``;
    a lost connection reports each of its channels lost, and confirmed once back."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def subscribe(self, channel: str) -> None:
        """Subscribe ``channel``; ``Confirmed(channel, True)`` follows once it holds."""

    async def unsubscribe(self, channel: str) -> None: ...


class PlainLive:
    """One pub/sub connection to one Redis (a primary, or one behind Sentinel)."""

    def __init__(
        self,
        redis: aioredis.Redis,
        deliver: Deliver,
        confirmed: Confirmed,
        connection_lost: Callable[[], None],
    ) -> None:
        self.redis = redis
        self.deliver = deliver
        self.confirmed = confirmed
        self.connection_lost = connection_lost
        self.channels: set[str] = set()
        """The channels subscribed (or to subscribe again once the connection is back)."""
        self._pubsub: PubSub = relay_pubsub(redis)
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._reconnecting = False
        """The connection was lost: the reader subscribes every channel on a fresh one."""
        self._commands = asyncio.Lock()
        """One (un)subscribe at a time: redis-py's PubSub opens its connection on first use,
        and concurrent first calls would each open one, stranding their channels."""
        self._asked: list[tuple[str, str]] = []
        """(command, channel) asked in this pass of the event loop, in order."""
        self._batch_sent: asyncio.Future[None] | None = None
        self._senders: set[asyncio.Task[None]] = set()
        """The batches' tasks: the one sending, and the next one waiting for it."""
        self._leaving: set[str] = set()
        """Channels to unsubscribe with the next batch of them."""
        self._leave_timer: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_forever(), name="relay-reader")

    async def close(self) -> None:
        if self._leave_timer is not None:
            self._leave_timer.cancel()
        senders = list(self._senders)
        for sender in senders:
            sender.cancel()
        # Awaited: one cancelled before its first step would otherwise be left pending
        # when the loop closes right after (its coroutine never run).
        await asyncio.gather(*senders, return_exceptions=True)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def subscribe(self, channel: str) -> None:
        """Subscribe, in one command with the other channels asked for in this pass of the
        event loop; it returns once that command is sent (so the caller's next command
        reaches Redis after it) or, while the connection is down, left to the reader's
        next one."""
        self.channels.add(channel)
        self._leaving.discard(channel)  # watched again: subscribed again, and confirmed
        await asyncio.shield(self._ask(SUBSCRIBE, channel))

    async def unsubscribe(self, channel: str) -> None:
        """Unsubscribe with the next batch of channels left (``UNSUBSCRIBE_BATCH``); nobody
        waits for it (messages of a channel nobody watches are dropped, and a new
        connection leaves it out)."""
        self.channels.discard(channel)
        self._leaving.add(channel)
        if len(self._leaving) >= UNSUBSCRIBE_BATCH:
            self._unsubscribe_left()
        elif self._leave_timer is None:
            loop = asyncio.get_running_loop()
            self._leave_timer = loop.call_later(UNSUBSCRIBE_AFTER_S, self._unsubscribe_left)

    def _unsubscribe_left(self) -> None:
        if self._leave_timer is not None:
            self._leave_timer.cancel()
            self._leave_timer = None
        for channel in self._leaving:
            self._ask(UNSUBSCRIBE, channel)
        self._leaving.clear()

    def _ask(self, command: str, channel: str) -> asyncio.Future[None]:
        """``command`` for ``channel`` in this pass's batch: the future of its sending."""
        self._asked.append((command, channel))
        if self._batch_sent is None:
            sent = self._batch_sent = asyncio.get_running_loop().create_future()
            # A task's first step runs in the loop's next pass: every request that runs
            # in this one adds its channel to the batch first.
            sender = asyncio.create_task(self._send_batch())
            self._senders.add(sender)
            sender.add_done_callback(functools.partial(self._batch_done, sent))
        return self._batch_sent

    def _batch_done(self, sent: asyncio.Future[None], sender: asyncio.Task[None]) -> None:
        """However the batch's task ended (sent, failed, or cancelled at ``close``, even
        before it ran), those waiting for it go on; a failure past the errors it handles
        (a bug) is logged, since no request awaits the task."""
        self._senders.discard(sender)
        if not sent.done():
            sent.set_result(None)
        if not sender.cancelled() and (exc := sender.exception()) is not None:
            log.error("sending a batch of (un)subscribes failed", exc_info=exc)

    async def _send_batch(self) -> None:
        """The batch's commands in the order asked, each run of one kind as one command
        (a channel unsubscribed, then subscribed again, ends subscribed)."""
        async with self._commands:
            self._batch_sent = None  # what is asked from now on goes in the next batch
            asked, self._asked = self._asked, []
            for command, run in itertools.groupby(asked, key=operator.itemgetter(0)):
                await self._send(command, [channel for _, channel in run])

    async def _send(self, command: str, channels: list[str]) -> None:
        try:
            await self._command(command, channels)
        finally:
            if command == SUBSCRIBE:
                self._subscribed.set()  # the reader, waiting for a first channel, reads on

    async def _command(self, command: str, channels: list[str]) -> None:
        if not connected(self._pubsub):  # the reader's next connection takes self.channels
            self._reconnecting = True
            return
        try:
            if command == SUBSCRIBE:
                await self._pubsub.subscribe(*channels)
            else:
                await self._pubsub.unsubscribe(*channels)
        except RedisConnectionError as exc:  # dropped: the reader opens a new one
            log.info(
                "%s of %d channel(s) found the connection lost: %s", command, len(channels), exc
            )
            self._reconnecting = True
        except (RedisError, OSError) as exc:  # the reader's next connection sets it right
            log.warning("%s of %d channel(s) failed: %s", command, len(channels), exc)
            self.connection_lost()
            self._reconnecting = True

    async def _read_forever(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._reconnecting:
                    async with self._commands:
                        if self.channels:
                            # A fresh connection after a loss. Channels subscribed while
                            # this reader waited to reconnect went to the lost connection:
                            # each is reported lost too, so its feed reads what it missed.
                            for channel in self.channels:
                                self.confirmed(channel, False)
                            await self._pubsub.subscribe(*self.channels)
                        self._reconnecting = False
                    continue
                if not self._pubsub.subscribed:
                    await self._subscribed.wait()
                    self._subscribed.clear()
                    continue
                if not connected(self._pubsub):  # a failed (un)subscribe dropped it
                    raise RedisConnectionError("the pub/sub connection was lost")
                await self._read_some()
                backoff = 0.05
            except (RedisError, OSError) as exc:
                # Pub/sub lost: every feed re-reads the stream once resubscribed.
                log.warning("relay pub/sub connection lost (%s); reconnecting", exc)
                self.connection_lost()
                for channel in list(self.channels):
                    self.confirmed(channel, False)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX_S)
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.aclose()  # type: ignore[no-untyped-call]
                self._pubsub = relay_pubsub(self.redis)
                self._reconnecting = True

    async def _read_some(self) -> None:
        """Wait up to a second for what the connection brings next, then dispatch every
        reply it completed (``_drain_parsed``): each socket read costs one wait, not one
        ``get_message`` (a timeout, a retry wrapper and a dict) for its first message."""
        parser = getattr(self._pubsub.connection, "_parser", None)
        if getattr(parser, "_reader", None) is None:  # not the hiredis parser
            message = await self._pubsub.get_message(timeout=1.0)
            if message is not None:
                self._dispatch(message)
            return
        try:
            async with asyncio.timeout(1.0):
                await parser.read_from_socket()  # type: ignore[union-attr]
        except TimeoutError:
            return
        await self._drain_parsed()

    async def _drain_parsed(self) -> None:
        """Dispatch the replies already read and parsed, without redis-py's per-message path.

        One socket read brings many live messages at load; ``get_message`` costs tens of
        microseconds each (timeouts, retry wrapper, a dict per message), the hiredis reader
        a microsecond. Live messages go straight to the feeds; anything else (subscribe
        confirmations) still goes through redis-py's ``handle_message`` bookkeeping.
        This reads redis-py's parser internals (``_parser._reader``, ``NOT_ENOUGH_DATA``):
        redis is pinned in pyproject.toml, and tests/test_sessions.py covers the path.
        """
        parser = getattr(self._pubsub.connection, "_parser", None)
        reader = getattr(parser, "_reader", None)
        if reader is None:  # not the hiredis parser: get_message does it all
            return
        pubsub = self._pubsub
        while (reply := reader.gets()) is not NOT_ENOUGH_DATA:
            if isinstance(reply, list) and len(reply) == 3 and reply[0] == b"message":
                self.deliver(reply[1], reply[2])
            elif isinstance(reply, Exception):
                raise reply
            elif reply not in pubsub.health_check_response:
                message = await pubsub.handle_message(reply)  # type: ignore[no-untyped-call]
                if message is not None:
                    self._dispatch(message)

    def _dispatch(self, message: dict[str, object]) -> None:
        kind = message["type"]
        channel = message["channel"]
        if kind == "message":
            data = message["data"]
            assert isinstance(channel, bytes) and isinstance(data, bytes)
            self.deliver(channel, data)
            return
        channel = channel.decode() if isinstance(channel, bytes) else str(channel)
        if kind == "subscribe":
            self.confirmed(channel, True)
