"""The generation queue, as the gateway sees it: what a generation may ask for, and the
queues of the models it goes to (``wire.queue``).

- ``sampling``: sampling parameters with the gateway's defaults and limits (422 past one);
- ``counts``: queued and running generations per model (the capacity's, gateway/core/
  admission.py, and /metrics');
- ``waiting``, ``enqueue``: a request for its tenant's list of its model's queue.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import redis.asyncio as aioredis

import wire
from gateway.core.errors import BadRequest
from gateway.core.settings import Settings
from gateway.core.store.models import ModelDirectory
from wire import MODEL_DEFAULTS, GenerationRequest, Keys, SamplingParams, prefixes
from wire.queue import RequestQueue, count_all, estimated_tokens
from wire.scripts import WaitingRequest

AT_FIELD = re.compile(r"at `\$\.([a-z_]+)")
QueueCounts = dict[str, tuple[int, int]]
"""Model -> (queued, running)."""


class GenerationQueue:
    def __init__(
        self,
        redis: aioredis.Redis,
        keys: Keys,
        settings: Settings,
        models: ModelDirectory,
        weight_of: Callable[[str], float],
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.settings = settings
        self.models = models
        self.weight_of = weight_of
        """A tenant's weight: its share of a model's engine against the others'."""
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
            prefixes=prefixes.asked(model, request),
        )

    def sampling(
        self,
        *,
        named: Mapping[str, str] | None = None,
        neutral: Mapping[str, Any] | None = None,
        **given: Any,
    ) -> SamplingParams:
        """Sampling parameters with the gateway's defaults and limits applied; ``named``:
        the client's own names of those its API spells otherwise (TGI's ``max_new_tokens``
        is ``max_tokens`` here), for errors to name the field as the client sent it. A
        field of ``MODEL_DEFAULTS`` left unset (None) is left to the model's recommended
        value, else ``neutral``'s (the API's own default: OpenAI's temperature is 1)."""
        names = named or {}
        params = {key: value for key, value in given.items() if value is not None}
        left = [name for name in MODEL_DEFAULTS if name not in params]
        params = {**(neutral or {}), **params, **({"model_defaults": left} if left else {})}
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

    async def counts(self, also: list[str] | None = None) -> QueueCounts:
        """Model -> (queued, running): requests no worker took yet, and taken but not
        finished, for every registered model (and ``also``), in one round trip."""
        return await self.count(await self.models_to_count(also or []))

    async def models_to_count(self, also: list[str]) -> list[str]:
        """Every registered model's name, and ``also``'s, and the default model's."""
        snapshot = await self.models.snapshot()
        # The default model may be queued for before any worker of it registered.
        default = [self.settings.default_model] if self.settings.default_model else []
        return sorted(set(snapshot.models) | set(also) | set(default))

    async def count(self, models: list[str]) -> QueueCounts:
        counted = await count_all(self.redis, [self.of(model) for model in models])
        return dict(zip(models, counted, strict=True))

    async def enqueue(
        self, model: str, request: GenerationRequest, submitted: bytes | None = None
    ) -> None:
        """A new request into its tenant's list of ``model``'s queue; ``submitted``: the
        note of this request to cross off with it (``RequestQueue.waiting``)."""
        await self.of(model).submit(self.waiting(model, request, submitted))
