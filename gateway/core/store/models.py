"""Which models the gateway can route to: every name a worker registered, and which of them
have a live worker now.

Workers write their names (the model's, then aliases) into ``Keys.models`` with each
heartbeat and describe themselves in ``Keys.worker(id)``. ``ModelDirectory.resolve`` turns
the name a client asked for into the model whose queue takes the request:

- a name with a live worker: that model (aliases resolve to it);
- a name a worker once registered but none serves now: 503 ``model_unavailable`` with
  ``Retry-After`` (a restarting worker comes back; queued requests meet the queue timeout).
  Once registered as far as this process has seen: a Redis that lost its data forgets the
  names until their workers' next heartbeat, and a stopped worker's name is not wrong;
- any other name: 404 ``model_not_found`` (503 ``no_worker`` while no worker has ever
  registered: the gateway cannot tell a wrong name from a model still loading; 503
  ``model_unavailable`` while the names are younger than a live worker and than
  ``worker_timeout_s``: Redis lost them, and the workers write them again);
- no name (session API, TGI, web chat): ``TOKENSPOUT_DEFAULT_MODEL``, else the only live
  model, else 400 ``model_required`` naming the choices (503 when no worker is alive).
  A ``TOKENSPOUT_DEFAULT_MODEL`` that no worker has registered yet is queued for, not
  refused: at start-up the gateway is up before the engine has loaded its model.

The live view is cached for ``CACHE_S`` and read again in the background before it gets
that old (``refresh_forever``, in the gateway's lifespan): routing costs no Redis round trip
per request, the lone request after a pause included. A name the cache does not know is
looked up again at once before it is refused, so a worker that has just registered is
routable as soon as a client sees it in ``/v1/models``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

import wire
from gateway.core.errors import BadRequest, NotFound, Unavailable
from gateway.core.settings import Settings
from wire import Keys, WorkerInfo
from wire.connect import mget
from wire.runtime import shared_read

log = logging.getLogger("tokenspout.models")

CACHE_S = 1.0
"""A request uses a view of the workers at most this old (else it reads one)."""
REFRESH_S = CACHE_S / 2
"""How often ``refresh_forever`` reads the view: so a request always finds one in time."""
MODEL_RETRY_AFTER_S = 5
"""``Retry-After`` of a 503 for a model with no live worker: about a worker's restart."""
REGISTRY_SLACK_S = 2.0
"""A worker's first heartbeat comes this soon after it starts (a Redis that answers late
makes it later: the names then count as lost, for ``worker_timeout_s`` at most)."""
_worker_decoder = msgspec.json.Decoder(WorkerInfo)


@dataclass(frozen=True)
class Snapshot:
    workers: list[WorkerInfo]
    known: dict[str, str]
    """Every registered name -> its model, live or not."""
    registered_since: float | None = None
    """When the first heartbeat wrote the names (unix seconds; None: none did)."""
    taken_at: float = field(default_factory=time.monotonic)

    def refilling(self, within_s: float) -> float:
        """Seconds left (0: none) while the names are younger than ``within_s`` and than a
        live worker: Redis lost them after that worker started, and the workers write
        them again one heartbeat each (a stopped one, once it runs again)."""
        since = self.registered_since
        if since is None or not any(w.started_at < since - REGISTRY_SLACK_S for w in self.workers):
            return 0.0
        return max(0.0, since + within_s - time.time())

    @property
    def live(self) -> dict[str, list[WorkerInfo]]:
        """Model -> its live workers, models sorted by name."""
        by_model: dict[str, list[WorkerInfo]] = {}
        for worker in sorted(self.workers, key=lambda w: w.model):
            by_model.setdefault(worker.model, []).append(worker)
        return by_model

    @property
    def live_names(self) -> dict[str, str]:
        """Every name (model or alias) with a live worker -> its model."""
        return {name: worker.model for worker in self.workers for name in worker.names}

    @property
    def models(self) -> list[str]:
        """Every model (queue) ever registered, live or not."""
        return sorted(set(self.known.values()) | {w.model for w in self.workers})


class ModelDirectory:
    def __init__(self, redis: aioredis.Redis, keys: Keys, settings: Settings) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self._snapshot: Snapshot | None = None
        self._reading: asyncio.Future[Snapshot] | None = None
        self._ever_known: set[str] = set()
        """Every name this process has seen registered (Redis may lose them: a wipe)."""

    async def snapshot(self, *, fresh: bool = False) -> Snapshot:
        """The cached view, or a new read once it is ``CACHE_S`` old: the requests that find
        it old together share one read (a burst of requests made one read each, one per
        request in flight). ``fresh``: a read of its own, begun after this call."""
        cached = self._snapshot
        if not fresh and cached is not None and time.monotonic() - cached.taken_at < CACHE_S:
            return cached
        if fresh:
            return await self._read()
        if self._reading is None or self._reading.done():
            self._reading = shared_read(self._read())
        return await asyncio.shield(self._reading)

    async def refresh_forever(self, interval_s: float = REFRESH_S) -> None:
        """Keep the view younger than ``CACHE_S``, so no request waits for its read: a
        lone request (a chat's next turn, seconds after the last) would find it old every
        time, two round trips more on its way to the queue."""
        failing = False
        while True:
            try:
                await self.snapshot(fresh=True)
                failing = False
            except (RedisError, OSError) as exc:
                if not failing:  # once per outage: requests read it themselves meanwhile
                    log.warning("reading the engine workers failed (%s); retrying", exc)
                failing = True
            except Exception:
                log.exception("reading the engine workers failed; retrying")
            await asyncio.sleep(interval_s)

    async def _read(self) -> Snapshot:
        since = time.time() - self.settings.worker_timeout_s
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(self.keys.workers, since, "+inf")
            pipe.hgetall(self.keys.models)
            pipe.get(self.keys.models_since)
            worker_ids, known, since = await pipe.execute()
        workers: list[WorkerInfo] = []
        if worker_ids:
            raw = await mget(self.redis, [self.keys.worker(wire.text(w)) for w in worker_ids])
            workers = [_worker_decoder.decode(item) for item in raw if item is not None]
        names = {wire.text(name): wire.text(model) for name, model in known.items()}
        self._ever_known.update(names)
        registered_since = int(since) / 1000 if since is not None else None
        self._snapshot = Snapshot(workers, names, registered_since)
        return self._snapshot

    async def live_workers(self) -> list[WorkerInfo]:
        return (await self.snapshot(fresh=True)).workers

    async def max_model_len(self, model: str) -> int | None:
        """The context of ``model``'s live workers (the smallest, should they differ)."""
        lengths = [
            worker.max_model_len
            for worker in (await self.snapshot()).workers
            if worker.model == model and worker.max_model_len is not None
        ]
        return min(lengths) if lengths else None

    async def resolve(self, name: str | None) -> str:
        """The model that serves ``name`` (None: the default model); raises as described
        in the module's docstring."""
        if not name:
            return await self._default()
        snapshot = await self.snapshot()
        if name not in snapshot.live_names:
            snapshot = await self.snapshot(fresh=True)
        model = snapshot.live_names.get(name)
        if model is not None:
            return model
        if name in snapshot.known or name in self._ever_known:
            raise no_live_worker(name)
        if name == self.settings.default_model:
            # Named by the operator and never registered yet: its engine is still loading
            # (the gateway starts first). Queued, it is served when the engine comes, or
            # meets the queue timeout.
            return name
        if not snapshot.known and not snapshot.workers:
            raise _no_worker()  # nothing registered yet: starting up, not a wrong name
        live = ", ".join(snapshot.live_names) or "none"
        if left_s := snapshot.refilling(self.settings.worker_timeout_s):
            raise Unavailable(
                f"the model {name!r} is not registered now: Redis lost the workers' names "
                f"and they are writing them again (served now: {live}); try again",
                code="model_unavailable",
                retry_after_s=max(1, math.ceil(left_s)),
            )
        raise NotFound(
            f"the model {name!r} does not exist (served now: {live})",
            code="model_not_found",
            field="model",
        )

    async def _default(self) -> str:
        if self.settings.default_model:
            return await self.resolve(self.settings.default_model)
        snapshot = await self.snapshot()
        if len(snapshot.live) != 1:
            snapshot = await self.snapshot(fresh=True)
        live = list(snapshot.live)
        if len(live) == 1:
            return live[0]
        if not live:
            raise _no_worker()
        raise BadRequest(
            f"this gateway serves several models; name one of: {', '.join(live)}",
            code="model_required",
            field="model",
        )


def _no_worker() -> Unavailable:
    return Unavailable(
        "no engine worker is alive; try again later",
        code="no_worker",
        retry_after_s=MODEL_RETRY_AFTER_S,
    )


def no_live_worker(model: str) -> Unavailable:
    return Unavailable(
        f"the model {model!r} has no live engine worker now; try again later",
        code="model_unavailable",
        retry_after_s=MODEL_RETRY_AFTER_S,
    )
