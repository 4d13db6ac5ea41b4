"""The generation queue, as the gateway sees it: what a generation may ask for, whether
there is room for it, and the queues of the models it goes to (``wire.queue``).

- ``sampling``: sampling parameters with the gateway's defaults and limits (422 past one);
- ``guard_capacity``: 429 past ``TOKENSPOUT_MAX_INFLIGHT`` generations in flight, or past
  ``TOKENSPOUT_MAX_INFLIGHT_PER_MODEL`` of one model; ``admission``: the same check made by
  the SUBMIT script itself, for a stateless session on one Redis (one round trip, and
  atomic across gateways);
- ``counts``: queued and running generations per model (also for /metrics);
- ``enqueue`` and ``signal_cancel``: a request onto its model's queue, a cancel onto the
  stream every worker reads.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline

import wire
from gateway.core.errors import BadRequest, Overloaded
from gateway.core.models import ModelDirectory
from gateway.core.settings import Settings
from wire import CancelSignal, GenerationRequest, Keys, SamplingParams
from wire.limits import Limits
from wire.outcomes import OverCapacity
from wire.queue import RequestQueue, count_all, estimated_tokens
from wire.runtime import shared_read
from wire.scripts import Admission, WaitingRequest

CANCELS_MAXLEN = 10_000
AT_FIELD = re.compile(r"at `\$\.([a-z_]+)")
Counts = dict[str, tuple[int, int]]
"""Model -> (queued, running)."""


class CountsRead:
    """One read of the queue counts, on its way or done, that the capacity checks arriving
    while it is on its way share; ``admitted``: the generations they let in, per model."""

    __slots__ = ("admitted", "models", "task")

    def __init__(self, models: list[str], read: Coroutine[Any, Any, Counts]) -> None:
        self.models = models
        self.task = shared_read(read)
        self.admitted: dict[str, int] = {}


class GenerationQueue:
    def __init__(
        self, redis: aioredis.Redis, keys: Keys, settings: Settings, models: ModelDirectory
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.models = models
        self.requests_maxlen = settings.max_inflight * 20
        """Cap of each model's requests stream (approximate, whole nodes)."""
        self.weight_of: Callable[[str], float] = lambda tenant: 1.0
        """A tenant's weight: its share of a model's engine against the others' (the
        tenants' directory sets it; every tenant weighs 1 until then)."""
        self._read: CountsRead | None = None
        self._queues: dict[str, RequestQueue] = {}

    def of(self, model: str) -> RequestQueue:
        queue = self._queues.get(model)
        if queue is None:
            queue = self._queues[model] = RequestQueue(self.redis, self.keys, model)
        return queue

    def waiting(
        self, model: str, request: GenerationRequest, note: bytes | None = None
    ) -> WaitingRequest:
        """``request`` for its tenant's list of ``model``'s queue (all in one list, first
        come first served, with ``TOKENSPOUT_SCHEDULER=fifo``)."""
        tenant = request.tenant if self.settings.scheduler == "fair" else ""
        return self.of(model).waiting(
            wire.encode(request),
            estimate=estimated_tokens(request),
            tenant=tenant,
            weight=self.weight_of(tenant),
            submitted=note,
        )

    def sampling(self, *, named: Mapping[str, str] | None = None, **given: Any) -> SamplingParams:
        """Sampling parameters with the gateway's defaults and limits applied; ``named``:
        the client's own names of those its API spells otherwise (TGI's ``max_new_tokens``
        is ``max_tokens`` here), for errors to name the field as the client sent it."""
        names = named or {}
        params = {key: value for key, value in given.items() if value is not None}
        max_tokens = params.setdefault("max_tokens", self.settings.default_max_tokens)
        if not 1 <= max_tokens <= self.settings.max_tokens_limit:
            field = names.get("max_tokens", "max_tokens")
            raise BadRequest(
                f"{field} must be between 1 and {self.settings.max_tokens_limit} "
                "(TOKENSPOUT_MAX_TOKENS_LIMIT)",
                field=field,
            )
        if params.get("min_tokens", 0) > max_tokens:
            raise BadRequest(
                f"min_tokens must not exceed {names.get('max_tokens', 'max_tokens')} "
                f"({max_tokens})",
                field="min_tokens",
            )
        try:
            return msgspec.convert(params, SamplingParams)
        except msgspec.ValidationError as exc:
            at = AT_FIELD.search(str(exc))
            if at is None:
                raise BadRequest(str(exc)) from exc
            sent = names.get(at.group(1), at.group(1))
            raise BadRequest(f"{sent}: {exc}", field=sent) from exc

    async def guard_capacity(self, model: str) -> None:
        """429 past the global in-flight limit, or past the model's own.

        The counts come from the read on its way when there is one (``CountsRead``), plus
        the generations this process admitted on that read: a burst of requests costs one
        read at a time (a read each costs 5 to 8 us of gateway CPU per token at 500
        streams). A generation whose submit is still on its way is not seen by a check that
        read before it landed, and across gateways the check is not atomic: the SUBMIT
        script's own check (``admission``) is, on one Redis."""
        models = await self._models_to_count([model])
        read = self._read
        if read is None or read.task.done() or read.models != models:
            read = self._read = CountsRead(models, self._count(models))
        counts = await asyncio.shield(read.task)
        inflight = sum(queued + running for queued, running in counts.values())
        inflight += sum(read.admitted.values())
        if inflight >= self.settings.max_inflight:
            raise self.overloaded(OverCapacity("all", inflight), model)
        limit = self.settings.max_inflight_per_model
        queued, running = counts.get(model, (0, 0))
        of_model = queued + running + read.admitted.get(model, 0)
        if limit and of_model >= limit:
            raise self.overloaded(OverCapacity("model", of_model), model)
        read.admitted[model] = read.admitted.get(model, 0) + 1

    async def admission(
        self,
        model: str,
        request: GenerationRequest,
        limits: Limits | None = None,
        count_request: bool = True,
    ) -> Admission:
        """``guard_capacity``'s check, for the SUBMIT script to make as it queues
        ``request`` (one Redis: every queue counted is on the node the session is), and the
        ``limits`` of its key with it (none: no such check)."""
        models = await self._models_to_count([model])
        waiting = self.waiting(model, request)
        return Admission(
            queues=[self.of(name).key for name in models],
            target=models.index(model),
            limit=self.settings.max_inflight,
            model_limit=self.settings.max_inflight_per_model,
            request=waiting.element,
            tenant=waiting.tenant,
            weight=waiting.weight,
            stream_cap=self.requests_maxlen,
            limits=limits,
            count_request=count_request,
        )

    def overloaded(self, refusal: OverCapacity, model: str) -> Overloaded:
        """The 429 for a check that found the limit reached."""
        if refusal.scope == "all":
            limit = self.settings.max_inflight
            return Overloaded(
                f"{refusal.count} generations are in flight (limit {limit}, "
                "TOKENSPOUT_MAX_INFLIGHT); try again shortly",
                retry_after_s=1,
            )
        limit = self.settings.max_inflight_per_model
        return Overloaded(
            f"{refusal.count} generations of {model!r} are in flight (limit {limit} per "
            "model, TOKENSPOUT_MAX_INFLIGHT_PER_MODEL); try again shortly",
            retry_after_s=1,
        )

    async def counts(self, also: list[str] | None = None) -> Counts:
        """Model -> (queued, running): requests no worker took yet, and taken but not
        finished, for every registered model (and ``also``), in one round trip."""
        return await self._count(await self._models_to_count(also or []))

    async def _models_to_count(self, also: list[str]) -> list[str]:
        snapshot = await self.models.snapshot()
        # The default model may be queued for before any worker of it registered.
        default = [self.settings.default_model] if self.settings.default_model else []
        return sorted(set(snapshot.models) | set(also) | set(default))

    async def _count(self, models: list[str]) -> Counts:
        counted = await count_all(self.redis, [self.of(model) for model in models])
        return dict(zip(models, counted, strict=True))

    async def enqueue(
        self, model: str, request: GenerationRequest, submitted: bytes | None = None
    ) -> None:
        """A new request into its tenant's list of ``model``'s queue; ``submitted``: the
        note of this request to cross off with it (``RequestQueue.waiting``)."""
        await self.of(model).submit(self.waiting(model, request, submitted))

    def enqueue_in(self, pipe: Pipeline, model: str, request: GenerationRequest) -> None:
        """``enqueue`` queued in ``pipe`` (a bare EVALSHA: on NoScriptError, ``load_scripts``
        and send the pipeline again)."""
        self.of(model).submit_in(pipe, self.waiting(model, request))

    async def load_scripts(self, model: str) -> None:
        """What ``enqueue_in`` sends, loaded (a Redis that restarted lost its scripts)."""
        await self.of(model).load_scripts()

    async def signal_cancel(self, signal: CancelSignal) -> None:
        """Tell every worker (the one running it aborts), renewing the stream's TTL."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self.keys.cancels, {"c": wire.encode(signal)}, maxlen=CANCELS_MAXLEN)
            pipe.expire(self.keys.cancels, wire.SHARED_KEY_TTL_S)
            await pipe.execute()
