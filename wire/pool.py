"""redis-py's connection pools, less their cost per command.

redis-py 8 takes a connection for every command and pipeline through a lock (a condition
and a timeout too in the blocking pool), an ``asynccontextmanager``, two observability
hooks and a connect call; it gives it back through the lock again, an event dispatch and
another hook. On the gateway's machine a GET costs the client about 150 us of CPU through
redis-py's blocking pool and 60-90 us through this one (docs/bench.md, "Every core, and
the request's cost again"), and on Python 3.11 each asyncio lock and timeout makes
``getpid`` system calls (``get_running_loop``).

The fast path here: an idle connection is handed out and taken back as plain list and set
operations, which is what redis-py's own pool does under its lock (one event loop: no
await comes between them), after redis-py's own check that it holds no unread reply and
its server has not gone (``can_read``: no wait with hiredis). Everything else
goes through redis-py's own code: no idle connection, a connection to check again or
reconnect, requests waiting for a connection (the blocking pool's release must wake
them), a connection to drop, maintenance mode. This reads redis-py's pool internals
(``_available_connections``, ``_in_use_connections``, ``_in_maintenance``): redis is pinned
in pyproject.toml, and tests/inprocess/test_redis_pool.py covers each path.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError


class _FastIdleConnections:
    """The fast path, for either of redis-py's pools (the mixin's base)."""

    _available_connections: list[AbstractConnection]
    _in_use_connections: set[AbstractConnection]
    _waiting = 0
    """Requests in redis-py's own ``get_connection`` (a blocking pool's may wait there)."""

    def _in_maintenance_mode(self) -> bool:
        return bool(getattr(self, "_in_maintenance", False))

    async def get_connection(self, *args: Any, **options: Any) -> AbstractConnection:
        idle = self._available_connections
        if not idle or self._in_maintenance_mode():
            self._waiting += 1
            try:
                connection: AbstractConnection = await super().get_connection()  # type: ignore[misc]
                return connection
            finally:
                self._waiting -= 1
        connection = idle.pop()
        self._in_use_connections.add(connection)
        try:
            # redis-py's own check, cheap with hiredis: a reply left unread, or the
            # server gone (EOF); an error in it has already disconnected the connection.
            ready = connection.is_connected and not await connection.can_read()
        except (RedisConnectionError, OSError):
            ready = False
        try:
            if not ready:  # reconnected and checked again, as redis-py's pool does
                await self.ensure_connection(connection)  # type: ignore[attr-defined]
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def release(self, connection: AbstractConnection) -> None:
        if (
            self._waiting == 0
            and connection.is_connected
            and not connection.should_reconnect()  # type: ignore[no-untyped-call]
            and not self._in_maintenance_mode()
        ):
            self._in_use_connections.remove(connection)
            self._available_connections.append(connection)
            return
        await super().release(connection)  # type: ignore[misc]


class LeanConnectionPool(_FastIdleConnections, aioredis.ConnectionPool):
    """redis-py's pool (no limit by default: the engine's)."""


class LeanBlockingConnectionPool(_FastIdleConnections, aioredis.BlockingConnectionPool):
    """redis-py's blocking pool: at most ``max_connections``, a command waits up to
    ``timeout`` for one (the gateway's)."""
