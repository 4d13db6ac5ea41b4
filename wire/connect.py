"""The one way gateway and engine open Redis, from ``REDIS_URL``, whatever serves it.

- ``redis://`` or ``rediss://``: one Redis (or a proxy in front of several).
- ``unix:///path/to/redis.sock``: one Redis on this machine, over its Unix socket.
- ``redis+cluster://host:port`` (``rediss+cluster://`` with TLS): a Redis Cluster, found
  from any one node (more seeds after a comma: ``redis+cluster://a:6379,b:6379``). Keys of
  one session share a hash tag, so every script touches one slot; live events go over
  sharded pub/sub (SPUBLISH in the scripts, SSUBSCRIBE per shard in the gateway's relay);
  each model's queue is its own key, so models spread over the shards.
- ``redis+sentinel://host:port[,host:port...]/service[/db]``: the primary that Sentinel
  names for ``service``, followed through failovers.

A cluster client is ``redis.asyncio.cluster.RedisCluster``: it answers the commands the
code uses with the ``Redis`` signatures, so callers keep typing it as ``Redis``; the few
places that differ ask the topology (wire/topology.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar, cast
from urllib.parse import parse_qs, urlsplit, urlunsplit

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.crc import key_slot
from redis.exceptions import (
    AuthenticationError,
    DataError,
    RedisClusterException,
    RedisError,
    ResponseError,
    SlotNotCoveredError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.maint_notifications import MaintNotificationsConfig
from redis.typing import EncodableT

from wire.pool import LeanBlockingConnectionPool, LeanConnectionPool

log = logging.getLogger("tokenspout.redis")
T = TypeVar("T")
RETRY_MAX_S = 0.5
"""The longest wait between tries of a Redis command while Redis is away (the relay's
reader, a worker's writes): each hears of Redis again within this, so a client is told
what Redis lost within the 2 s docs/reliability.md promises."""
WAITING_WARN_S = 10.0
"""How often a process waiting for Redis at its start says so."""
DEAD_PEER_S = 10
"""How long a silent server may keep a connection (TCP keepalive on an idle one, unanswered
writes on a busy one) before the connection counts as lost."""
_LIVENESS = {
    "TCP_KEEPIDLE": 4,
    "TCP_KEEPINTVL": 2,
    "TCP_KEEPCNT": 3,
    "TCP_USER_TIMEOUT": DEAD_PEER_S * 1000,
}
TCP_LIVENESS = {getattr(socket, name): v for name, v in _LIVENESS.items() if hasattr(socket, name)}
"""The options this platform has (Linux: all; macOS lacks ``TCP_USER_TIMEOUT``)."""
NO_COMMAND_TIMEOUT: dict[str, Any] = {"socket_timeout": None, "socket_connect_timeout": 5}
"""redis-py 8 gives every command a 5 s socket timeout. On Python 3.11 that wraps each
send in ``asyncio.wait_for`` (a task per command) and each read in a timer: measured with
1-token requests, 8-10 % of the gateway's CPU per request and 15-20 % of the worker's,
and at 500 streams the start burst's TTFT p50 halved without it. A dead server is found
by TCP instead (``TCP_LIVENESS``); a live one that is slow (a long script, a pause) is
waited for, not given up on and retried."""

NO_MAINT_NOTIFICATIONS: dict[str, Any] = {
    "maint_notifications_config": MaintNotificationsConfig(enabled=False)
}
"""redis-py 8 speaks RESP3 and, on every new TCP connection, asks for Redis Enterprise's
maintenance notifications (``CLIENT MAINT_NOTIFICATIONS``, an error on Redis and Valkey).
Besides a failed round trip per connection, that handshake reads a reply inside a
reconnect: on a pub/sub connection whose reader is waiting, it raises ``RuntimeError:
read() called while another coroutine is already waiting`` after a Redis restart, and a
request is answered 500."""
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
SENTINEL_SCHEMES = {"redis+sentinel", "rediss+sentinel"}


def kind_of(url: str) -> str:
    """``cluster``, ``sentinel`` or ``single``."""
    scheme = urlsplit(url).scheme
    if scheme in CLUSTER_SCHEMES:
        return "cluster"
    if scheme in SENTINEL_SCHEMES:
        return "sentinel"
    return "single"


async def misconfiguration(url: str) -> str | None:
    """Why ``url`` cannot work, in one sentence, when it names one Redis (``redis://``,
    ``unix://``) whose server is a Redis Cluster node, or whose server refuses the URL's
    credentials; or a Sentinel URL whose addresses are Redis servers, not Sentinels. None
    when it is fine, or does not answer now (a Redis that is down is not a configuration
    error: the clients wait for it). Cluster URLs are not checked here: redis-py's own
    errors for them name the problem."""
    if kind_of(url) == "sentinel":
        return await _not_sentinels(url)
    if kind_of(url) != "single":
        return None
    client = aioredis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=5)
    try:
        async with asyncio.timeout(10):
            info = await client.info("cluster")
    except AuthenticationError as exc:
        return f"Redis refused the credentials in REDIS_URL: {exc}"
    except (RedisError, OSError, TimeoutError):
        return None
    finally:
        await client.aclose()
    if int(info.get("cluster_enabled", 0)):
        node = urlsplit(url).netloc.rsplit("@", 1)[-1]
        return (
            f"REDIS_URL names a node of a Redis Cluster (cluster_enabled:1), as one Redis: "
            f"use redis+cluster://{node} (docs/configuration.md, Redis Cluster and Sentinel)"
        )
    return None


async def _not_sentinels(url: str) -> str | None:
    """Why a Sentinel URL cannot work: the first address that answers is a Redis server
    (no ``SENTINEL`` command), which would leave every client failing on each command."""
    parts = urlsplit(url)
    query = _query(parts.query)
    for host, port in _hosts(parts.netloc, 26379):
        client = aioredis.Redis(
            host=host,
            port=port,
            password=query.get("sentinel_password"),
            ssl=parts.scheme.startswith("rediss"),
            socket_connect_timeout=2,
            socket_timeout=5,
        )
        try:
            async with asyncio.timeout(10):
                await client.execute_command("SENTINEL", "MASTERS")  # type: ignore[no-untyped-call]
            return None
        except ResponseError as exc:
            if "unknown command" not in str(exc).lower():
                return None
            return (
                f"REDIS_URL names {host}:{port} as a Sentinel, but it is a Redis server "
                f"(it has no SENTINEL command): use redis://{host}:{port} for one Redis, or "
                "the Sentinels' own addresses (docs/configuration.md, Redis Cluster and Sentinel)"
            )
        except (RedisError, OSError, TimeoutError):
            continue  # down now: the next address, or none to judge
        finally:
            await client.aclose()
    return None


def _query(query: str) -> dict[str, str]:
    """A URL's query parameters, the last value of each."""
    return {key: values[-1] for key, values in parse_qs(query).items()}


def _retry() -> Retry:
    return Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3)


def connect(url: str, *, max_connections: int | None = None, **options: Any) -> aioredis.Redis:
    """A client for ``url``, with no command timeout and TCP liveness checks
    (``NO_COMMAND_TIMEOUT``, ``TCP_LIVENESS``). ``max_connections``: a blocking pool of
    that many (per node on a cluster) whose commands are retried on a lost connection (the
    gateway's); None: redis-py's pool (the engine's). One Redis's pools are wire/pool.py's,
    redis-py's with a fast path for an idle connection."""
    kind = kind_of(url)
    liveness: dict[str, Any] = {}
    if urlsplit(url).scheme != "unix":  # a local server that dies closes its socket
        liveness = {"socket_keepalive": True, "socket_keepalive_options": TCP_LIVENESS}
    options = {**NO_COMMAND_TIMEOUT, **liveness, **NO_MAINT_NOTIFICATIONS, **options}
    if kind == "cluster":
        return _cluster(url, max_connections, options)
    if kind == "sentinel":
        return _sentinel(url, max_connections, options)
    if max_connections is None:
        return aioredis.Redis.from_pool(_with_ours(LeanConnectionPool.from_url(url, **options)))
    client = aioredis.Redis(
        connection_pool=_with_ours(
            LeanBlockingConnectionPool.from_url(url, max_connections=max_connections, **options)
        ),
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    # The pool is the client's alone: its ``aclose`` closes the pool's connections too (as
    # ``from_pool`` does), or they stay open until the garbage collector finds them.
    client.auto_close_connection_pool = True
    return client


CLOSED_TRANSPORT = "the handler is closed"
"""What uvloop says when asked to write to a transport it has closed (``RuntimeError``)."""


class _ClosedIsLost:
    """A write to a connection whose peer has gone while nothing read it fails as the lost
    connection it is (``ConnectionError``: the caller's retry and failover handling take
    it): uvloop, the gateway's loop under uvicorn, refuses it with ``RuntimeError: unable
    to perform operation on <TCPTransport closed=True ...>; the handler is closed``, which
    redis-py passes on, turning only ``OSError`` into ``ConnectionError``: a request would
    be answered 500 for it on a cluster whose primary is killed (one Redis's pool finds
    such a connection closed before it hands it out, wire/pool.py)."""

    async def send_packed_command(
        self, command: bytes | str | Iterable[bytes], check_health: bool = True
    ) -> None:
        try:
            await super().send_packed_command(command, check_health)  # type: ignore[misc]
        except RuntimeError as exc:
            if CLOSED_TRANSPORT not in str(exc):
                raise
            raise RedisConnectionError(f"the connection was closed ({exc})") from exc


class _PackedByHiredis:
    """Commands packed by hiredis, in C, as redis-py's synchronous client packs them when
    hiredis is installed; its asyncio connections pack in Python. A script call of 23
    arguments (the submit's) takes 24 us in Python and 4 in hiredis; packed in Python,
    packing is 13 % of a gateway's loop time and 9 % of a worker's (docs/bench.md,
    "Commands packed in C"). The same bytes: str as UTF-8 (the only encoding these clients use),
    numbers as ``repr``; what neither takes (None, a bool) is the ``DataError`` redis-py
    raises."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        name = args[0]
        if isinstance(name, str):  # "CLUSTER SLOTS": the words go as separate arguments
            args = (*name.encode().split(), *args[1:])
        elif isinstance(name, bytes) and b" " in name:
            args = (*name.split(), *args[1:])
        try:
            # cast: hiredis's stub types the argument as a tuple of one item
            return [hiredis.pack_command(cast(Any, args))]
        except TypeError as exc:
            raise DataError(f"cannot send {args[0]!r} to Redis: {exc}") from None


class _StillNamedPrimary:
    """A connection to the primary Sentinel named stays only if Sentinel still names that
    address once it is open. The answer it connected by may be a failover old: asked just
    before the Sentinels called the primary down, and acted on after they promoted its
    replica (a busy loop, a retry's back-off, a connection held up on the way). The old
    primary, restarted meanwhile, is a primary again with its old data until the Sentinels
    make it a replica, seconds later, and then drops all it took: sessions and replies
    written there are silently gone, and a pub/sub connection there hears nothing of the
    real primary's events. Asked again with the connection open, Sentinel names the
    promoted one: this connection is dropped (``ConnectionError``) and the next is made
    there. One more Sentinel round trip a new connection."""

    connection_pool: SentinelConnectionPool

    async def connect_to(self, address: tuple[str, int]) -> None:
        await super().connect_to(address)  # type: ignore[misc]
        pool = self.connection_pool
        if not pool.is_master:
            return
        try:
            named = await pool.sentinel_manager.discover_master(pool.service_name)
        except BaseException:
            await self.disconnect()  # type: ignore[attr-defined]
            raise
        if tuple(named) != tuple(address):
            await self.disconnect()  # type: ignore[attr-defined]
            raise RedisConnectionError(
                f"{address[0]}:{address[1]} is no longer the primary Sentinel names for "
                f"{pool.service_name!r} (now {named[0]}:{named[1]})"
            )


PoolT = TypeVar("PoolT", bound=aioredis.ConnectionPool)
ConnectionT = TypeVar("ConnectionT", bound=AbstractConnection)


def _ours(connection_class: type[ConnectionT], *more: type) -> type[ConnectionT]:
    """``connection_class`` (TCP, TLS, Unix socket, Sentinel's) with ``_ClosedIsLost`` and
    ``_PackedByHiredis`` (and ``more`` mixins)."""
    name = connection_class.__name__
    mixins = (_ClosedIsLost, _PackedByHiredis, *more, connection_class)
    return cast(type[ConnectionT], type(name, mixins, {}))


def _with_ours(pool: PoolT, *more: type) -> PoolT:
    pool.connection_class = _ours(pool.connection_class, *more)
    return pool


def _hosts(netloc: str, default_port: int) -> list[tuple[str, int]]:
    hosts = []
    for part in netloc.rsplit("@", 1)[-1].split(","):
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
        hosts.append((host or "127.0.0.1", int(port or default_port)))
    return hosts


def _cluster(url: str, max_connections: int | None, options: dict[str, Any]) -> aioredis.Redis:
    parts = urlsplit(url)
    seeds = _hosts(parts.netloc, 6379)
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    first = f"{auth}{seeds[0][0]}:{seeds[0][1]}"
    plain = urlunsplit((CLUSTER_SCHEMES[parts.scheme], first, "", parts.query, ""))
    options.pop("timeout", None)  # a blocking pool's wait: the cluster's pools do not block
    if max_connections is not None:
        options["max_connections"] = max_connections
    client = RedisCluster.from_url(
        plain,
        startup_nodes=[ClusterNode(host, port) for host, port in seeds[1:]] or None,
        # Slots without a primary (a failover under way) leave the others usable.
        require_full_coverage=False,
        **options,
    )
    # Every node's connections, those it learns of later too (made with these arguments).
    ours = _ours(client.connection_kwargs["connection_class"])
    client.connection_kwargs["connection_class"] = ours
    for node in client.nodes_manager.startup_nodes.values():
        node.connection_class = ours
    return cast(aioredis.Redis, client)


class _BlockingSentinelPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """Connections to the primary Sentinel names, from a pool that waits up to ``timeout``
    for a free one when all are in use (the gateway's), as one Redis's blocking pool does."""


def _sentinel(url: str, max_connections: int | None, options: dict[str, Any]) -> aioredis.Redis:
    parts = urlsplit(url)
    path = [part for part in parts.path.split("/") if part]
    if not path:
        raise ValueError(f"{url}: name the service: redis+sentinel://host:port/SERVICE[/db]")
    service, db = path[0], int(path[1]) if len(path) > 1 else 0
    query = _query(parts.query)
    password = parts.password
    sentinel = Sentinel(  # type: ignore[no-untyped-call]
        _hosts(parts.netloc, 26379),
        sentinel_kwargs={"password": query["sentinel_password"]}
        if "sentinel_password" in query
        else {},
        password=password,
        username=parts.username,
        ssl=parts.scheme.startswith("rediss"),
        db=db,
    )
    if max_connections is None:
        pool = SentinelConnectionPool(service, sentinel, **options)  # type: ignore[no-untyped-call]
    else:
        pool = _BlockingSentinelPool(  # type: ignore[no-untyped-call]
            service, sentinel, max_connections=max_connections, **options
        )
    client = aioredis.Redis(
        connection_pool=_with_ours(pool, _StillNamedPrimary),
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    client.auto_close_connection_pool = True  # as one Redis's: ``aclose`` closes its connections
    return client


async def ready(redis: aioredis.Redis) -> None:
    """Learn a cluster's slot map now (a cluster client otherwise does on its first
    command), so that routing by key works from the start. Nothing for one Redis."""
    if isinstance(redis, RedisCluster):
        await redis.initialize()


async def when_redis_answers(step: Callable[[], Awaitable[T]], what: str) -> T:
    """``step()``, once Redis answers. A process that starts while Redis is down (restarting,
    failing over, not up yet) waits for it, as it does for an outage once running, with a
    warning now and every 10 s, instead of ending with a traceback."""
    delay, warned_at = 0.05, -WAITING_WARN_S
    while True:
        try:
            return await step()
        except REDIS_AWAY_ERRORS as exc:
            if not redis_away(exc):
                raise
            if time.monotonic() - warned_at >= WAITING_WARN_S:
                log.warning("%s: Redis does not answer (%s); waiting for it", what, exc)
                warned_at = time.monotonic()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)


REDIS_AWAY_ERRORS = (RedisError, OSError, RedisClusterException)
"""What a client raises while Redis does not answer; ``redis_away`` tells which to wait out."""


def redis_away(exc: BaseException) -> bool:
    """``exc`` says Redis does not answer now (restarting, failing over, not up yet): one
    to wait out. A cluster client that reached no node (the one the URL names is down: a
    process started during a failover) says so with a connection error as the cause; any
    other cause (a Redis that is not a cluster) is a mistake to stop on, not to wait out."""
    if isinstance(exc, RedisClusterException):
        return isinstance(exc.__cause__, RedisError | OSError)
    return isinstance(exc, RedisError | OSError)


def is_cluster(redis: object) -> bool:
    return isinstance(redis, RedisCluster)


async def on_key_node(redis: aioredis.Redis, key: str, *command: str | int) -> Any:
    """Run ``command`` (on ``key``) on the primary of ``key``'s slot, named by the slot map.
    For XREAD and XREADGROUP on a cluster: their keys are "movable", and redis-py's cluster
    client learns them by asking one node ``COMMAND GETKEYS`` before every call, a round
    trip more that fails whenever that node does. During a failover a worker's XREAD failed
    there with an AttributeError from inside redis-py, not a Redis error, and the worker
    ended. One Redis: the command as it is."""
    route: dict[str, Any] = {}
    if isinstance(redis, RedisCluster):
        await redis.initialize()  # the slot map, again after a failure (else nothing to do)
        try:
            route["target_nodes"] = redis.get_node_from_key(key)
        except SlotNotCoveredError as exc:
            raise RedisConnectionError(f"no primary serves {key} now ({exc})") from exc
    return await redis.execute_command(*command, **route)  # type: ignore[no-untyped-call]


def slot_of(session_id: str) -> int:
    """The cluster hash slot of a session's keys and live channel (``{<sid>}`` tags them
    all): a publisher groups a step's events by it to send each group to its shard."""
    return int(key_slot(session_id.encode()))


async def mget(redis: aioredis.Redis, keys: list[str]) -> list[bytes | None]:
    """MGET of keys that may lie in different slots (one round trip per shard on a
    cluster)."""
    if not keys:
        return []
    if isinstance(redis, RedisCluster):
        return cast(list[bytes | None], await redis.mget_nonatomic(keys))
    return cast(list[bytes | None], await redis.mget(keys))


def node_client(redis: aioredis.Redis, key: str, **options: Any) -> aioredis.Redis:
    """A plain one-node client (a pool of one connection) of the Redis that serves ``key``:
    ``redis`` itself for one Redis (its settings, its own pool); on a cluster, the primary
    of ``key``'s slot now, reached directly (connection-scoped commands: CLIENT ID)."""
    if isinstance(redis, RedisCluster):
        node = redis.get_node_from_key(key)
        kwargs = dict(node.connection_kwargs, **options)
        kwargs.pop("retry", None)
        return aioredis.Redis(
            connection_pool=aioredis.BlockingConnectionPool(
                connection_class=node.connection_class, max_connections=1, timeout=None, **kwargs
            )
        )
    pool = redis.connection_pool
    kwargs = dict(pool.connection_kwargs, **options)
    return aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool(
            connection_class=pool.connection_class, max_connections=1, timeout=None, **kwargs
        )
    )


def address_of(client: aioredis.Redis) -> str:
    """``host:port`` of a plain client's server ("" when it has none, a Unix socket)."""
    kwargs = client.connection_pool.connection_kwargs
    return f"{kwargs['host']}:{kwargs['port']}" if "host" in kwargs else ""


def node_by_address(
    redis: aioredis.Redis | RedisCluster, address: str, client_name: str | None = None
) -> aioredis.Redis | None:
    """On a cluster, a one-connection client of the node at ``address`` if the cluster
    still lists it (named ``client_name``); None elsewhere (one Redis: ``redis`` answers
    for itself)."""
    if not isinstance(redis, RedisCluster) or not address:
        return None
    host, _, port = address.rpartition(":")
    node = redis.get_node(host=host, port=int(port))
    if node is None:
        return None
    kwargs = dict(node.connection_kwargs)
    kwargs.pop("retry", None)
    if client_name is not None:
        kwargs["client_name"] = client_name
    return aioredis.Redis(
        connection_pool=aioredis.BlockingConnectionPool(
            connection_class=node.connection_class, max_connections=1, timeout=None, **kwargs
        )
    )
